"""Decayed usage and minimum runtimes where people read them, with the figures the
scheduler computed: the quota preview says which team's recent usage lowers its fair
share and by how much, the editor shows the minimum runtimes only admins set, and a
waiting job whose only victims are protected says until when.

The world: org (16) holds ml (16), whose children vision and nlp here guarantee 2
GPUs each; other and ops guarantee 8 and want nothing, so all 24 h100 GPUs of the
cluster go to ml's teams, 20 of them as surplus shared by weight."""

from __future__ import annotations

import math
from datetime import UTC, timedelta
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from preemption.cycle import schedule_cycle
from preemption.models import Attempt, Job, JobState, Rank
from preemption.quota_preview import quota_preview
from preemption.services import job_submit
from quotas.models import PriorityClass
from quotas.services import scheduling_policy_update
from tests import builders
from tests.portal.pages.conftest import page_client, seed_decayed_usage

pytestmark = pytest.mark.django_db


@pytest.fixture
def heavy_vision(world: Any) -> Any:
    seed_decayed_usage(world)
    return world


def test_the_preview_says_decayed_usage_lowers_a_fair_share(heavy_vision: Any) -> None:
    world = heavy_vision
    quota = world.quota(world.vision)
    result = quota_preview(quota=quota, lend_limit=0)
    effects = {item["team"]: item for item in result["decayed_usage"]}
    assert list(effects) == ["vision"]
    vision = effects["vision"]
    assert vision["usage_ratio"] == pytest.approx(2.0, abs=0.01)
    assert vision["fair_share"] == pytest.approx(8.0, abs=0.01)
    assert vision["weight_fair_share"] == pytest.approx(12.0, abs=0.01)
    assert vision["why"] == (
        "team vision used 2.0× its share of the spare h100-80gb GPUs over the last week: "
        "its fair share is 8.0 GPUs instead of 12.0"
    )
    response = page_client(world, "manager").post(
        reverse("quota-preview", args=[quota.pk]),
        {"guarantee": 2, "borrow_limit": "", "lend_limit": 0},
    )
    assert response.status_code == 200, response.content.decode()[:2000]
    body = response.content.decode()
    assert (
        '<li data-team="vision">Team vision used 2.0× its share of the spare h100-80gb GPUs '
        "over the last week: its fair share is 8.0 GPUs instead of 12.0.</li>"
    ) in body


def test_without_strength_the_preview_says_nothing_of_usage(world: Any) -> None:
    result = quota_preview(quota=world.quota(world.vision), guarantee=8)
    assert result["decayed_usage"] == []


def test_the_waiting_job_of_the_heavy_team_says_usage_is_the_reason(heavy_vision: Any) -> None:
    world = heavy_vision
    schedule_cycle(act=False)
    waiting = [
        job
        for job in Job.objects.filter(team=world.vision, state=JobState.PENDING)
        if "used 2.0× its share" in job.waiting_reason
    ]
    assert waiting, list(Job.objects.values_list("team__slug", "state", "waiting_reason"))
    page = page_client(world, "researcher").get(reverse("job-detail", args=[waiting[0].pk]))
    assert (
        "team vision used 2.0× its share of the spare h100-80gb GPUs over the last week: "
        "its fair share is 8.0 GPUs instead of 12.0"
    ) in page.content.decode()


def test_the_editor_shows_the_minimum_runtimes_admins_set(world: Any) -> None:
    PriorityClass.objects.filter(pk=world.batch.pk).update(reclaim_min_runtime_seconds=900)
    scheduling_policy_update(
        actor=world.users["admin"],
        usage_strength=0.5,
        usage_half_life_seconds=86_400.0,
        fair_share_min_runtime_seconds=120,
        consolidation_min_runtime_seconds=600,
    )
    page = page_client(world, "manager").get(
        reverse("quota-edit", args=[world.quota(world.vision).pk])
    )
    body = page.content.decode()
    assert (
        "counts with strength <strong>0.5</strong> and a half-life of <strong>1 d 0 h</strong>"
        in body
    )
    table = body[body.index('id="min-runtimes"') :]
    table = table[: table.index("</table>")]
    cells = [
        '<td class="num">none</td>',
        '<td class="num">2 min 0 s</td>',
        '<td class="num">none</td>',
        '<td class="num">10 min 0 s</td>',
    ]
    assert '<tr data-class=""><td class="muted">cluster</td>' + "".join(cells) in table
    # The batch class keeps the cluster's values but its own reclaim minimum.
    batch = table[table.index(f'data-class="{world.batch.name}"') :]
    assert '<td class="num">15 min 0 s</td>' in batch.split("</tr>")[0]
    assert "2 min 0 s (cluster)" in batch.split("</tr>")[0]
    # Managers see these, but the editor offers no field for them.
    assert 'name="reclaim_min_runtime_seconds"' not in body


def _running(world: Any, team: Any, node: str, admitted_ago: timedelta) -> Job:
    job = job_submit(
        submitter=world.users["admin"],
        team=team,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=8,
        command="true",
        priority_class=world.batch,
    )
    schedule_cycle(act=False)
    attempt = Attempt.objects.get(job=job)
    admitted_at = timezone.now() - admitted_ago
    Attempt.objects.filter(pk=attempt.pk).update(
        placement=[{"node": node, "ranks": 1}], admitted_at=admitted_at
    )
    Rank.objects.filter(attempt=attempt).update(node=node, state="running")
    Job.objects.filter(pk=job.pk).update(state=JobState.RUNNING, running_at=admitted_at)
    return job


def test_a_job_whose_only_victims_are_protected_says_until_when(world: Any) -> None:
    # ops runs two jobs admitted 10 minutes ago, one of them on org's idle 8 GPUs; their
    # class must run 30 minutes before reclaim may take one, so vision's own 8 GPUs come
    # back 20 minutes from now.
    PriorityClass.objects.filter(pk=world.batch.pk).update(reclaim_min_runtime_seconds=1800)
    _running(world, world.nlp, "h100-node-0", timedelta(hours=1))
    _running(world, world.ops, "h100-node-1", timedelta(minutes=10))
    borrower = _running(world, world.ops, "h100-node-2", timedelta(minutes=10))
    waiting = job_submit(
        submitter=world.users["researcher"],
        team=world.vision,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=8,
        command="true",
        priority_class=world.batch,
    )
    schedule_cycle(act=False)
    waiting.refresh_from_db()
    expected = Attempt.objects.get(job=borrower).admitted_at + timedelta(seconds=1800)
    assert waiting.state == JobState.PENDING
    assert waiting.protected_until is not None, waiting.waiting_reason
    assert math.isclose(waiting.protected_until.timestamp(), expected.timestamp(), abs_tol=1.0)
    until = f"{expected.astimezone(UTC):%H:%M}"
    words = (
        f"until {until} UTC: the only jobs it could preempt are protected by their minimum "
        "runtime until then"
    )
    page = page_client(world, "researcher").get(reverse("job-detail", args=[waiting.pk]))
    assert f'<span id="why-waiting">{words} (' in page.content.decode()
    listing = page_client(world, "researcher").get(reverse("job-list"))
    assert words in listing.content.decode()
    api = world.client("researcher").get(f"/api/v1/jobs/{waiting.pk}/").json()
    assert api["why_waiting"].startswith(words)
    # Once the borrower is admitted elsewhere or the moment passes, the words go.
    Job.objects.filter(pk=waiting.pk).update(protected_until=timezone.now() - timedelta(seconds=1))
    api = world.client("researcher").get(f"/api/v1/jobs/{waiting.pk}/").json()
    assert api["why_waiting"] == waiting.waiting_reason


def test_the_job_page_says_where_its_ranks_must_sit(world: Any) -> None:
    required = builders.job(world, world.vision, state=JobState.PENDING, topology_level="rack")
    preferred = builders.job(
        world,
        world.vision,
        state=JobState.PENDING,
        topology_level="block",
        topology_required=False,
    )
    client = page_client(world, "researcher")
    page = client.get(reverse("job-detail", args=[required.pk])).content.decode()
    assert '<span id="topology">all ranks in one rack</span>' in page
    page = client.get(reverse("job-detail", args=[preferred.pk])).content.decode()
    assert (
        '<span id="topology">all ranks in one block if one has room, else anywhere</span>'
    ) in page
