"""The checkpoint cadence follows the risk of preemption, end to end on the local
runtime: real ranks (the runner user), the real database, the scheduling cycle, the
reconciler and the risk refresh the beat runs. The world fixture: org/ml/{vision,nlp}
and other/ops, 3 nodes x 8 h100 GPUs; vision, nlp and ops are guaranteed 8 each."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from preemption import risk
from preemption.cadence import preemption_risk_refresh
from preemption.models import Attempt, Checkpoint, Job, JobState, TrapEvent
from preemption.reconcile.logs import ingest_logs
from preemption.runtimes import LocalRuntime
from preemption.services import job_submit
from tests.preemption.conftest import ROOT, state_of, train_command

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

# The ranks import the trap from this checkout, as the portal does.
TRAP_ENV = {"PYTHONPATH": str(ROOT / "gracetrap" / "src")}


def submit(world: Any, team: Any, *, ranks: int, gpus: int, name: str) -> Job:
    return job_submit(
        submitter=world.users["researcher"],
        team=team,
        flavor=world.h100,
        ranks=ranks,
        gpus_per_rank=gpus,
        command=train_command(1_000_000, step_sleep=0.05, extra="--cadence --keep 50"),
        priority_class=world.batch,
        name=name,
        env=TRAP_ENV,
    )


def cadence_events(job: Job) -> list[TrapEvent]:
    return list(TrapEvent.objects.filter(job=job, event="cadence", rank=0).order_by("at"))


def test_a_borrower_whose_owner_waits_checkpoints_far_more_often_than_a_guaranteed_job(
    world: Any, drive: Any, local_runtime: LocalRuntime, settings: Any
) -> None:
    # The reclaim spares a job admitted less than an hour ago, so the owner's job waits
    # and the borrower keeps running under the threat of it.
    settings.QM_RECLAIM_MIN_RUNTIME_SECONDS = 3600

    def drive_with_refresh(condition: Any, **kwargs: Any) -> None:
        def refreshed() -> bool:
            preemption_risk_refresh(runtime=local_runtime)
            return bool(condition())

        drive(refreshed, **kwargs)

    # ops (guarantee 8) runs 2 x 8 GPUs, 8 of them borrowed; nlp runs 4 inside its 8.
    borrower = submit(world, world.ops, ranks=2, gpus=8, name="borrower")
    guaranteed = submit(world, world.nlp, ranks=2, gpus=2, name="guaranteed")
    drive_with_refresh(
        lambda: state_of(borrower) == state_of(guaranteed) == JobState.RUNNING,
        what="both jobs to run",
    )
    owner = submit(world, world.vision, ranks=1, gpus=8, name="owner")
    # Until the borrower wrote four checkpoints (each a folder step_N; --keep 50 keeps them).
    folder = Path(Job.objects.get(pk=borrower.pk).checkpoint_dir)
    drive_with_refresh(
        lambda: len(list(folder.glob("step_*"))) >= 4, timeout=180, what="four checkpoints"
    )
    # Should the owner get in, what ended and why is the way to tell how.
    ended = [
        (a.job.name, a.number, a.end_reason, getattr(a, "preemption", None) and a.preemption.cause)
        for a in Attempt.objects.filter(job__in=[borrower, guaranteed]).select_related("job")
        if a.ended_at is not None
    ]
    assert state_of(owner) == JobState.PENDING, ended
    assert state_of(borrower) == state_of(guaranteed) == JobState.RUNNING, ended

    lent = Attempt.objects.get(job=borrower, number=1)
    inside = Attempt.objects.get(job=guaranteed, number=1)
    assert lent.borrowed_gpus == 8 and inside.borrowed_gpus == 0
    assert lent.preemption_mtbp_seconds == risk.RECLAIM_IMMINENT
    assert "vision (1 job waiting)" in lent.preemption_risk_reasons[0]
    assert inside.preemption_mtbp_seconds == risk.CALM
    assert inside.preemption_risk_reasons[0].startswith("team nlp is inside its guarantee")

    # The events the ranks POST reach no portal here; read them from the rank logs as
    # the reconciler does when an attempt ends.
    for attempt in (lent, inside):
        ingest_logs(attempt.job, attempt, attempt.rank_set.all(), local_runtime)

    # The trap read the hint from its file and chose sqrt(2 x cost x MTBP).
    short, long = cadence_events(borrower)[-1].payload, cadence_events(guaranteed)[-1].payload
    assert short["mtbp_seconds"] == risk.RECLAIM_IMMINENT
    assert long["mtbp_seconds"] == risk.CALM
    for chosen in (short, long):
        assert chosen["interval_seconds"] == pytest.approx(
            (2 * chosen["save_cost"] * chosen["mtbp_seconds"]) ** 0.5, rel=1e-3
        )
    assert long["interval_seconds"] > 10 * short["interval_seconds"]

    # The recorded checkpoints: after the first (taken at once, it measured the cost),
    # each of the borrower's came the interval the trap had reported before it after
    # the previous one; the guaranteed job took only that first one.
    commits = list(Checkpoint.objects.filter(job=borrower).order_by("step"))
    assert len(commits) >= 4, commits
    chosen = cadence_events(borrower)
    intervals = []
    for previous, commit in itertools.pairwise(commits):
        interval = [e for e in chosen if e.step < commit.step][-1].payload["interval_seconds"]
        gap = (commit.committed_at - previous.committed_at).total_seconds()
        # Give or take the difference of two saves' lengths, a step and the trap's
        # re-measured cost (it reports a new interval only when it moves by a tenth):
        # on a busy machine a save or a step can take seconds longer than the last.
        assert interval / 2 <= gap <= 2 * interval + 3.0, (gap, interval)
        intervals.append((round(gap, 1), round(interval, 1)))
    # Meanwhile the guaranteed job, running as long, took only its first.
    assert Checkpoint.objects.filter(job=guaranteed).count() == 1
    ran = (commits[-1].committed_at - commits[0].committed_at).total_seconds()
    assert long["interval_seconds"] > ran
    print(
        f"borrower: MTBP {short['mtbp_seconds']:.0f} s, cost {short['save_cost']:.3f} s, "
        f"(gap, interval) {intervals}; guaranteed: MTBP {long['mtbp_seconds']:.0f} s, "
        f"cost {long['save_cost']:.3f} s, interval {long['interval_seconds']:.1f} s, "
        f"{Checkpoint.objects.filter(job=guaranteed).count()} checkpoint in {ran:.0f} s"
    )
