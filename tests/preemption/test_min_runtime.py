"""Minimum runtimes per preemption reason through the portal's cycle, on the test
database: a priority class's own reclaim minimum keeps a borrower's jobs running, the
waiting job says until when, and the cluster settings reach the engine."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from preemption.cycle import schedule_cycle
from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank
from preemption.services import job_submit
from preemption.snapshot import build_snapshot
from quotas.models import AuditEntry, PriorityClass
from quotas.services import priority_class_save

pytestmark = pytest.mark.django_db


def _running(world: Any, team: Any, node: str, name: str) -> Job:
    """A one-node job of 8 GPUs admitted by the cycle, placed on ``node``, running for an
    hour."""
    job = job_submit(
        submitter=world.users["admin"],
        team=team,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=8,
        command="true",
        priority_class=world.batch,
        name=name,
    )
    schedule_cycle(act=False)
    attempt = Attempt.objects.get(job=job)
    an_hour_ago = timezone.now() - timedelta(hours=1)
    Attempt.objects.filter(pk=attempt.pk).update(
        placement=[{"node": node, "ranks": 1}], admitted_at=an_hour_ago
    )
    Rank.objects.filter(attempt=attempt).update(node=node, state="running")
    Job.objects.filter(pk=job.pk).update(state=JobState.RUNNING, running_at=an_hour_ago)
    return job


def _borrowed_cluster(world: Any) -> Job:
    # nlp runs inside its guarantee; ops (guarantee 8) borrows org's idle 8 GPUs; vision
    # then asks for its own 8.
    _running(world, world.nlp, "h100-node-0", "nlp-own")
    _running(world, world.ops, "h100-node-1", "ops-own")
    _running(world, world.ops, "h100-node-2", "ops-borrowed")
    return job_submit(
        submitter=world.users["researcher"],
        team=world.vision,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=8,
        command="true",
        priority_class=world.batch,
        name="vision-own",
    )


def test_a_class_reclaim_minimum_keeps_borrowed_work_and_says_until_when(world: Any) -> None:
    PriorityClass.objects.filter(pk=world.batch.pk).update(reclaim_min_runtime_seconds=7200)
    waiting = _borrowed_cluster(world)
    schedule_cycle(act=False)
    assert not PreemptionEvent.objects.exists()
    waiting.refresh_from_db()
    assert waiting.state == JobState.PENDING
    assert "may be preempted (reclaim) only after their minimum runtime" in waiting.waiting_reason
    # Admitted an hour ago, protected for two: about an hour to go.
    seconds = float(waiting.waiting_reason.rsplit("(in ", 1)[1].split(" s)")[0])
    assert 3500 < seconds <= 3600


def test_without_a_class_minimum_the_guarantee_comes_back_at_once(world: Any) -> None:
    waiting = _borrowed_cluster(world)
    schedule_cycle(act=False)
    assert list(PreemptionEvent.objects.values_list("reason", flat=True)) == ["reclaim"]
    assert PreemptionEvent.objects.get().preemptor_id == waiting.pk


def test_the_snapshot_carries_the_settings_and_each_class_minimums(
    world: Any, settings: Any
) -> None:
    settings.QM_RECLAIM_MIN_RUNTIME_SECONDS = 120.0
    settings.QM_PRIORITY_MIN_RUNTIME_SECONDS = 30.0
    settings.QM_FAIR_SHARE_MIN_RUNTIME_SECONDS = 90.0
    settings.QM_CONSOLIDATION_MIN_RUNTIME_SECONDS = 900.0
    PriorityClass.objects.filter(pk=world.batch.pk).update(
        priority_min_runtime_seconds=0, consolidation_min_runtime_seconds=1800
    )
    snapshot = build_snapshot()
    assert snapshot.reclaim_min_runtime_seconds == 120.0
    assert snapshot.priority_min_runtime_seconds == 30.0
    assert snapshot.fair_share_min_runtime_seconds == 90.0
    assert snapshot.consolidation_min_runtime_seconds == 900.0
    classes = {c.name: c for c in snapshot.priority_classes}
    assert dict(classes[world.batch.name].min_runtime_by_reason) == {
        "priority": 0.0,
        "consolidate": 1800.0,
    }
    assert dict(classes[world.critical.name].min_runtime_by_reason) == {}


@pytest.mark.parametrize("value", [-1, 7 * 24 * 3600 + 1])
def test_a_class_minimum_out_of_range_is_refused_and_nothing_changes(
    world: Any, value: int
) -> None:
    before = PriorityClass.objects.get(pk=world.batch.pk)
    changed = PriorityClass.objects.get(pk=world.batch.pk)
    changed.reclaim_min_runtime_seconds = value
    with pytest.raises(ValidationError) as refused:
        priority_class_save(actor=world.users["admin"], priority_class=changed)
    assert "reclaim_min_runtime_seconds" in refused.value.message_dict
    after = PriorityClass.objects.get(pk=world.batch.pk)
    assert after.reclaim_min_runtime_seconds == before.reclaim_min_runtime_seconds is None


def test_a_class_minimum_is_saved_and_audited(world: Any) -> None:
    changed = PriorityClass.objects.get(pk=world.batch.pk)
    changed.fair_share_min_runtime_seconds = 300
    priority_class_save(actor=world.users["admin"], priority_class=changed)
    saved = PriorityClass.objects.get(pk=world.batch.pk)
    assert saved.min_runtime_by_reason() == {"fair-share": 300.0}
    entry = AuditEntry.objects.filter(action="priority_class.save").latest("at")
    assert entry.after["fair_share_min_runtime_seconds"] == 300
    assert entry.before["fair_share_min_runtime_seconds"] is None


def test_the_admin_edits_a_class_minimum_per_reason(world: Any, client: Any) -> None:
    client.force_login(world.users["admin"])
    url = f"/admin/quotas/priorityclass/{world.batch.pk}/change/"
    page = client.get(url)
    assert page.status_code == 200
    for field in ("priority", "fair_share", "reclaim", "consolidation"):
        assert f'name="{field}_min_runtime_seconds"' in page.content.decode()
    form = {
        "name": world.batch.name,
        "value": world.batch.value,
        "preemption_policy": world.batch.preemption_policy,
        "preemptible": "on",
        "grace_seconds": world.batch.grace_seconds,
        "notice_seconds": world.batch.notice_seconds,
        "min_runtime_seconds": 0,
        "reclaim_min_runtime_seconds": "-5",
        "description": "",
    }
    refused = client.post(url, form)
    assert refused.status_code == 200
    assert PriorityClass.objects.get(pk=world.batch.pk).reclaim_min_runtime_seconds is None
    form["reclaim_min_runtime_seconds"] = "900"
    saved = client.post(url, form)
    assert saved.status_code == 302
    assert PriorityClass.objects.get(pk=world.batch.pk).min_runtime_by_reason() == {
        "reclaim": 900.0
    }
