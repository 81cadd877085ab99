"""A history of resizes of elastic gangs, beside one preemption, written as real rows
for the tests of the resize figures (selectors, /metrics, the telemetry page).

Hand-computed, from `decided` = an hour ago:

| job | team | attempt | sizes | decided | every rank exited | lost GPU-s | |
| --- | --- | --- | --- | --- | --- | --- | --- |
| wide | vision | 1 (size unset: the job's 8) | 8 → 4 | +0 s | +6 s | 32.0 | shrink |
| narrow | vision | 1 | 2 → 1 | +300 s | +365 s (killed) | 20.5 | shrink |
| wide | vision | 2 | 4 → 8 | +600 s | +612.5 s | 0.0 | grow |
| borrower | ops | 1 | 4 → 2 | +100 s | still stopping | — | shrink |
| finisher | ops | 1 | 2 → 1 | +200 s | ended first | 0.0 | left out |

plus `seed_preemption`'s reclaim of an ops job (one preemption of ops, none of vision).
So: vision 2 shrinks (52.5 GPU-s lost; 6 s and 65 s to free) and 1 grow (0 GPU-s,
12.5 s); ops 1 shrink (nothing lost yet, not free yet) and 1 preemption.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from preemption.models import Attempt, Job, JobState, PreemptionEvent
from tests import builders
from tests.portal.pages.conftest import seed_preemption


@dataclass
class Resizes:
    decided: datetime
    wide: Job
    narrow: Job
    borrower: Job
    finisher: Job


def _resize(
    job: Job,
    attempt: Attempt,
    *,
    decided: datetime,
    to_ranks: int,
    exited_after: float | None,
    lost: float | None,
    outcome: str = PreemptionEvent.Outcome.GRACEFUL,
    cause: str = "",
) -> PreemptionEvent:
    return PreemptionEvent.objects.create(
        victim_attempt=attempt,
        job=job,
        reason=PreemptionEvent.Reason.RESIZE,
        cause=cause,
        decided_at=decided,
        grace_seconds=60.0,
        deadline=decided + timedelta(seconds=60),
        all_exited_at=None if exited_after is None else decided + timedelta(seconds=exited_after),
        outcome=outcome if exited_after is not None else "",
        lost_gpu_seconds=lost,
        resize_ranks=to_ranks,
        resize_placement=[{"node": "h100-node-0", "ranks": to_ranks}],
    )


def _elastic(world: Any, team: Any, name: str, *, ranks: int, gpus_per_rank: int) -> Job:
    return builders.job(
        world,
        team,
        name=name,
        ranks=ranks,
        ranks_min=1,
        gpus_per_rank=gpus_per_rank,
        submitter=world.users["admin"],
    )


def seed_resizes(world: Any) -> Resizes:
    decided = timezone.now() - timedelta(hours=1)
    seed_preemption(world, decided_at=decided - timedelta(minutes=5))

    wide = _elastic(world, world.vision, "wide", ranks=8, gpus_per_rank=1)
    # Written without its size, as rows from before elastic jobs were: the job's 8.
    first = builders.attempt(
        wide, admitted_at=decided - timedelta(minutes=30), ranks=None, placement=[]
    )
    _resize(
        wide,
        first,
        decided=decided,
        to_ranks=4,
        exited_after=6.0,
        lost=32.0,
        cause="shrunk from 8 to 4 ranks to reclaim team ops's guarantee for job 1",
    )
    Attempt.objects.filter(pk=first.pk).update(
        ended_at=decided + timedelta(seconds=6), end_reason=Attempt.EndReason.RESIZED
    )
    second = builders.attempt(wide, admitted_at=decided + timedelta(seconds=6), ranks=4)
    _resize(
        wide,
        second,
        decided=decided + timedelta(seconds=600),
        to_ranks=8,
        exited_after=12.5,
        lost=0.0,
        cause="grown from 4 to 8 ranks",
    )

    narrow = _elastic(world, world.vision, "narrow", ranks=2, gpus_per_rank=4)
    _resize(
        narrow,
        builders.attempt(narrow, admitted_at=decided - timedelta(minutes=20), ranks=2),
        decided=decided + timedelta(seconds=300),
        to_ranks=1,
        exited_after=65.0,
        lost=20.5,
        outcome=PreemptionEvent.Outcome.KILLED,
    )

    borrower = _elastic(world, world.ops, "elastic-borrower", ranks=4, gpus_per_rank=2)
    _resize(
        borrower,
        builders.attempt(borrower, admitted_at=decided - timedelta(minutes=10), ranks=4),
        decided=decided + timedelta(seconds=100),
        to_ranks=2,
        exited_after=None,
        lost=None,
    )
    Job.objects.filter(pk=borrower.pk).update(state=JobState.PREEMPTING)

    finisher = _elastic(world, world.ops, "finisher", ranks=2, gpus_per_rank=1)
    _resize(
        finisher,
        builders.attempt(finisher, admitted_at=decided - timedelta(minutes=10), ranks=2),
        decided=decided + timedelta(seconds=200),
        to_ranks=1,
        exited_after=1.0,
        lost=0.0,
        outcome=PreemptionEvent.Outcome.ENDED_FIRST,
    )
    Job.objects.filter(pk=finisher.pk).update(state=JobState.SUCCEEDED)
    return Resizes(decided=decided, wide=wide, narrow=narrow, borrower=borrower, finisher=finisher)
