"""Elastic jobs between the database and the engine: the snapshot offers a waiting
elastic job its sizes and counts a running one at its attempt's size, and a cycle
writes the size the engine admitted it at on the attempt and its ranks. The world:
three h100-80gb nodes of 8 GPUs; vision and nlp are guaranteed 8 each."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.utils import timezone

from preemption.cycle import schedule_cycle
from preemption.models import Attempt, JobState, Rank
from preemption.snapshot import decayed_usage, read_snapshot
from preemption.snapshot import workload_id as wid
from tests import builders


def test_the_snapshot_offers_sizes_while_waiting_and_the_attempt_size_while_running(
    world: Any,
) -> None:
    ranged = builders.job(world, world.vision, state=JobState.PENDING, ranks=8, ranks_min=6)
    sized = builders.job(
        world, world.vision, state=JobState.REQUEUED, ranks=8, ranks_min=2, rank_sizes=[2, 4, 8]
    )
    fixed = builders.job(world, world.vision, state=JobState.PENDING, ranks=8)
    running = builders.running_job(
        world, world.nlp, ranks=8, ranks_min=2, attempt_fields={"ranks": 4}
    )
    snapshot, _, _ = read_snapshot(reuse=False)
    workloads = {w.id: w for w in snapshot.workloads}
    assert (workloads[wid(ranged.pk)].ranks, workloads[wid(ranged.pk)].sizes) == (8, (6, 7, 8))
    assert (workloads[wid(sized.pk)].ranks, workloads[wid(sized.pk)].sizes) == (8, (2, 4, 8))
    assert (workloads[wid(fixed.pk)].ranks, workloads[wid(fixed.pk)].sizes) == (8, ())
    assert workloads[wid(running.pk)].ranks == 4
    assert workloads[wid(running.pk)].sizes == ()
    assert workloads[wid(running.pk)].placement == (("h100-node-0", 4),)


def test_a_cycle_admits_an_elastic_job_at_the_largest_size_that_fits(world: Any) -> None:
    # nlp runs 20 of the 24 GPUs; vision's job asks for 8 and may run at 2, 4 or 8.
    for node in ("h100-node-0", "h100-node-1"):
        builders.running_job(world, world.nlp, ranks=1, gpus_per_rank=8, node=node)
    builders.running_job(world, world.nlp, ranks=1, gpus_per_rank=4, node="h100-node-2")
    elastic = builders.job(
        world, world.vision, state=JobState.PENDING, ranks=8, ranks_min=2, rank_sizes=[2, 4, 8]
    )
    result = schedule_cycle(act=False)
    assert elastic.pk in result.admitted
    attempt = Attempt.objects.get(job=elastic)
    assert attempt.ranks == 4
    assert attempt.placement == [{"node": "h100-node-2", "ranks": 4}]
    assert list(
        Rank.objects.filter(attempt=attempt).order_by("index").values_list("index", "node")
    ) == [(i, "h100-node-2") for i in range(4)]


def test_decayed_usage_counts_the_gpus_each_attempt_held(world: Any) -> None:
    now = timezone.now()
    job = builders.job(world, world.vision, state=JobState.RUNNING, ranks=8, ranks_min=2)
    builders.attempt(job, ranks=2, admitted_at=now - timedelta(hours=1))
    fixed = builders.job(world, world.nlp, state=JobState.RUNNING, ranks=2)
    builders.attempt(fixed, admitted_at=now - timedelta(hours=1))
    usage = decayed_usage(now=now, half_life_seconds=7 * 86_400)
    assert usage["vision"]["h100-80gb"] == usage["nlp"]["h100-80gb"]
