"""Consolidation through the portal's cycle, on the test database: free GPUs scattered
over the nodes, a gang inside its team's guarantee, and small jobs that the cycle
moves (reason "consolidate") so that the gang fits, with the job page's words."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from preemption.cycle import schedule_cycle
from preemption.models import Job, JobState, PreemptionEvent
from preemption.reasons import describe_preemption
from preemption.services import job_submit
from tests import builders

pytestmark = pytest.mark.django_db


def _running(world: Any, team: Any, gpus: int, node: str, name: str) -> Job:
    """A one-node job of ``gpus`` GPUs on ``node``, running for an hour."""
    an_hour_ago = timezone.now() - timedelta(hours=1)
    return builders.running_job(
        world,
        team,
        name=name,
        submitter=world.users["admin"],
        gpus_per_rank=gpus,
        command="true",
        node=node,
        admitted_at=an_hour_ago,
        running_at=an_hour_ago,
        rank_fields={},
    )


def test_small_jobs_move_so_that_a_gang_fits_inside_its_guarantee(world: Any) -> None:
    # 2 free on node 0, 2 on node 1, 4 on node 2: 8 free, never 8 together; every team
    # at or under its guarantee, so no reclaim can help.
    _running(world, world.nlp, 6, "h100-node-0", "nlp-big")
    _running(world, world.ops, 6, "h100-node-1", "ops-big")
    small_nlp = _running(world, world.nlp, 2, "h100-node-2", "nlp-small")
    small_ops = _running(world, world.ops, 2, "h100-node-2", "ops-small")

    gang = job_submit(
        submitter=world.users["researcher"],
        team=world.vision,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=8,
        command="true",
        priority_class=world.batch,
        name="gang",
    )
    schedule_cycle(act=False)

    events = PreemptionEvent.objects.filter(reason="consolidate").order_by("job_id")
    assert [event.job_id for event in events] == [small_nlp.pk, small_ops.pk]
    assert all(event.preemptor_id == gang.pk for event in events)
    assert "so that job" in events[0].cause and "vision" in events[0].cause
    story = describe_preemption(events[0])
    assert f"job {gang.pk} of vision" in story and "restarts at once" in story
    gang.refresh_from_db()
    assert gang.state == JobState.PENDING
    assert "released by" in gang.waiting_reason
    # The big jobs stay where they are.
    assert not PreemptionEvent.objects.exclude(reason="consolidate").exists()
