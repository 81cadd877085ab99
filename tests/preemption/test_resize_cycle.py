"""Resizes between the engine and the database: a cycle records the engine's resize of
an elastic gang as a graceful stop of reason `resize` that carries the size and the
placement the job is relaunched at, and until the relaunch the snapshot counts the
GPUs the job keeps (or, growing, gets) as its own and frees the rest for the job the
shrink was for. With the class's flag off the same reclaim evicts the whole gang.

The world: three h100 nodes of 8 GPUs; org's vision and nlp are guaranteed 8 each,
other's ops 8. nlp runs 8 GPUs on node 1 and ops 8 of its class `critical` (not
preemptible) on node 2, so ops's elastic gang of 8 ranks on node 0 runs on GPUs it
borrowed, which vision reclaims."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from preemption.cycle import resized_borrowing, schedule_cycle
from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank
from preemption.reconcile import reconcile_jobs
from preemption.services import job_cancel, job_submit
from preemption.snapshot import read_snapshot
from preemption.snapshot import workload_id as wid
from tests import builders

pytestmark = pytest.mark.django_db


def borrowed_elastic_gang(world: Any, *, shrink: bool) -> tuple[Job, Job]:
    """ops's elastic gang of 8 ranks (4 to 8) on borrowed GPUs, and vision's waiting
    job of 4 GPUs that reclaims them; the batch class shrinks elastic gangs if `shrink`."""
    world.batch.shrink_elastic = shrink
    world.batch.save(update_fields=["shrink_elastic"])
    an_hour_ago = timezone.now() - timedelta(hours=1)
    builders.running_job(
        world, world.nlp, ranks=1, gpus_per_rank=8, node="h100-node-1", admitted_at=an_hour_ago
    )
    builders.running_job(
        world,
        world.ops,
        ranks=1,
        gpus_per_rank=8,
        node="h100-node-2",
        priority_class=world.critical,
        admitted_at=an_hour_ago,
    )
    elastic = builders.running_job(
        world,
        world.ops,
        ranks=8,
        ranks_min=4,
        node="h100-node-0",
        borrowed=8,
        admitted_at=an_hour_ago,
        rank_fields={},
        name="elastic",
    )
    reclaimer = builders.job(world, world.vision, state=JobState.PENDING, ranks=4, name="owner")
    return elastic, reclaimer


def test_a_reclaim_shrinks_an_elastic_gang_whose_class_allows_it(world: Any) -> None:
    elastic, reclaimer = borrowed_elastic_gang(world, shrink=True)
    result = schedule_cycle(act=False)
    assert result.resized == [elastic.pk]
    assert result.preempted == [] and result.admitted == []

    stop = PreemptionEvent.objects.get(job=elastic)
    assert stop.reason == PreemptionEvent.Reason.RESIZE
    assert stop.victim_attempt == Attempt.objects.get(job=elastic, number=1)
    assert (stop.resize_ranks, stop.resize_placement) == (4, [{"node": "h100-node-0", "ranks": 4}])
    assert stop.preemptor_id == reclaimer.pk
    assert stop.cause == (
        f"shrunk from 8 to 4 ranks to reclaim team vision's guarantee for job {reclaimer.pk}"
    )
    assert stop.grace_seconds == world.batch.grace_seconds
    # Half of what it borrowed goes back; the 4 GPUs it keeps are still borrowed.
    assert stop.resize_borrowed_gpus == 4
    assert Job.objects.get(pk=elastic.pk).state == JobState.PREEMPTING
    # A resize is no preemption: every count and list of preemptions leaves it out.
    assert not PreemptionEvent.objects.preemptions().exists()
    assert list(PreemptionEvent.objects.resizes()) == [stop]

    # Until the relaunch the job holds the 4 GPUs it keeps, at its new size since the
    # decision; the 4 it gives up are being freed for the reclaimer, which waits.
    snapshot, _, _ = read_snapshot(reuse=False)
    workloads = {w.id: w for w in snapshot.workloads}
    kept = workloads[wid(elastic.pk)]
    assert (kept.state, kept.ranks, kept.placement, kept.sizes) == (
        "running",
        4,
        (("h100-node-0", 4),),
        (),
    )
    assert kept.admitted_at == pytest.approx(stop.decided_at.timestamp())
    freed = workloads[f"{elastic.pk} (shrinking)"]
    assert (freed.state, freed.ranks, freed.placement, freed.preemptor) == (
        "terminating",
        4,
        (("h100-node-0", 4),),
        wid(reclaimer.pk),
    )
    reclaimer.refresh_from_db()
    assert reclaimer.state == JobState.PENDING
    assert f"job {elastic.pk} is stopping" in reclaimer.waiting_reason

    # A second cycle decides nothing new: the stop is under way.
    again = schedule_cycle(act=False)
    assert (again.resized, again.preempted, again.admitted) == ([], [], [])
    assert PreemptionEvent.objects.count() == 1


def test_with_the_flag_off_the_same_reclaim_evicts_the_whole_gang(world: Any) -> None:
    elastic, reclaimer = borrowed_elastic_gang(world, shrink=False)
    result = schedule_cycle(act=False)
    assert result.resized == []
    assert result.preempted == [elastic.pk]
    stop = PreemptionEvent.objects.get(job=elastic)
    assert (stop.reason, stop.preemptor_id, stop.resize_ranks) == (
        PreemptionEvent.Reason.RECLAIM,
        reclaimer.pk,
        None,
    )
    snapshot, _, _ = read_snapshot(reuse=False)
    gang = {w.id: w for w in snapshot.workloads}[wid(elastic.pk)]
    assert (gang.state, gang.ranks, gang.preemptor) == ("terminating", 8, wid(reclaimer.pk))


def test_a_grow_keeps_the_free_gpus_it_takes_for_the_job_until_the_relaunch(
    world: Any, settings: Any
) -> None:
    settings.QM_FAIR_SHARE_MIN_RUNTIME_SECONDS = 0
    world.batch.shrink_elastic = True
    world.batch.save(update_fields=["shrink_elastic"])
    elastic = builders.running_job(
        world,
        world.vision,
        ranks=8,
        ranks_min=4,
        node="h100-node-0",
        attempt_fields={"ranks": 4},
        admitted_at=timezone.now() - timedelta(hours=1),
        rank_fields={},
    )
    result = schedule_cycle(act=False)
    assert result.resized == [elastic.pk]
    stop = PreemptionEvent.objects.get(job=elastic)
    assert (stop.reason, stop.cause, stop.preemptor_id) == (
        "resize",
        "grown from 4 to 8 ranks",
        None,
    )
    assert (stop.resize_ranks, stop.resize_placement) == (8, [{"node": "h100-node-0", "ranks": 8}])
    # Inside vision's guarantee of 8: nothing borrowed.
    assert stop.resize_borrowed_gpus == 0
    snapshot, _, _ = read_snapshot(reuse=False)
    workloads = [w for w in snapshot.workloads if w.id.startswith(wid(elastic.pk))]
    assert [(w.id, w.state, w.ranks, w.placement) for w in workloads] == [
        (wid(elastic.pk), "running", 8, (("h100-node-0", 8),))
    ]
    # So a job that would fit on the GPUs the grow takes is not admitted onto them.
    # Best fit would place 4 GPUs on node 0, the fullest node that holds them.
    other = builders.job(world, world.nlp, state=JobState.PENDING, ranks=1, gpus_per_rank=4)
    schedule_cycle(act=False)
    placed = Attempt.objects.get(job=other).placement
    assert placed[0]["node"] != "h100-node-0"


@pytest.mark.parametrize(
    ("borrowed", "before", "after", "queue", "expected"),
    [
        (8, 8, 4, 4, 4),  # a shrink gives back borrowed GPUs first
        (2, 8, 4, 0, 0),
        (0, 8, 4, 0, 0),
        (0, 4, 8, 0, 0),  # a grow inside the guarantee borrows nothing
        (0, 4, 8, 2, 2),  # ... beyond it, what its team borrows after the plan
        (2, 4, 8, 16, 6),  # ... never more than it adds
    ],
)
def test_resized_borrowing(
    borrowed: int, before: int, after: int, queue: int, expected: int
) -> None:
    assert (
        resized_borrowing(
            borrowed=borrowed, gpus_before=before, gpus_after=after, queue_borrowed=queue
        )
        == expected
    )


# --- carried out, on the mimic runtime -----------------------------------------------
# The mimic runtime starts no process: a signalled gang exits 0 at once. Enough to
# follow the database through a resize's stop, close and relaunch; the local runtime's
# tests (test_resize_local.py) follow real ranks through it.


def passes(mimic: Any, times: int = 3) -> None:
    for _ in range(times):
        reconcile_jobs(runtime=mimic)


def mimicked_shrink(world: Any, mimic: Any) -> tuple[Job, Job]:
    """The world of `borrowed_elastic_gang` on the mimic runtime, every gang launched,
    and the cycle's shrink of the elastic gang recorded."""
    world.batch.shrink_elastic = True
    world.batch.save(update_fields=["shrink_elastic"])
    submitted = [
        (world.nlp, 1, 8, None, world.batch),
        (world.ops, 1, 8, None, world.critical),
        (world.ops, 8, 1, 4, world.batch),
    ]
    jobs = []
    for team, ranks, gpus, ranks_min, priority_class in submitted:
        jobs.append(
            job_submit(
                submitter=world.users["researcher"],
                team=team,
                flavor=world.h100,
                ranks=ranks,
                ranks_min=ranks_min,
                gpus_per_rank=gpus,
                command="sleep 600",
                priority_class=priority_class,
            )
        )
        schedule_cycle()
        passes(mimic)
    elastic = jobs[-1]
    assert Job.objects.get(pk=elastic.pk).state == JobState.RUNNING
    owner = job_submit(
        submitter=world.users["researcher"],
        team=world.vision,
        flavor=world.h100,
        ranks=4,
        gpus_per_rank=1,
        command="sleep 600",
    )
    assert schedule_cycle(act=False).resized == [elastic.pk]
    return elastic, owner


def test_the_relaunch_is_written_once_however_many_passes(world: Any, mimic: Any) -> None:
    elastic, owner = mimicked_shrink(world, mimic)
    passes(mimic, times=4)
    attempts = list(Attempt.objects.filter(job=elastic).order_by("number"))
    assert [(a.number, a.ranks, a.end_reason) for a in attempts] == [
        (1, 8, Attempt.EndReason.RESIZED),
        (2, 4, ""),
    ]
    assert attempts[1].launched_at is not None
    assert Rank.objects.filter(attempt=attempts[1]).count() == 4
    elastic.refresh_from_db()
    assert elastic.state == JobState.RUNNING
    # The reclaimer is admitted on the GPUs the shrink freed, by the next cycle.
    schedule_cycle()
    assert Job.objects.get(pk=owner.pk).state in (JobState.ADMITTED, JobState.RUNNING)
    node = attempts[1].placement[0]["node"]
    assert Attempt.objects.get(job=owner).placement == [{"node": node, "ranks": 4}]


def test_a_cancel_during_a_resize_ends_the_job_and_relaunches_nothing(
    world: Any, mimic: Any
) -> None:
    elastic, _ = mimicked_shrink(world, mimic)
    job_cancel(actor=None, job=elastic)
    passes(mimic)
    elastic.refresh_from_db()
    assert elastic.state == JobState.CANCELLED
    assert list(Attempt.objects.filter(job=elastic).values_list("number", "end_reason")) == [
        (1, Attempt.EndReason.CANCELLED)
    ]
    stop = PreemptionEvent.objects.get(job=elastic)
    assert (stop.reason, stop.requeued_at, stop.resume_step) == ("resize", None, None)
