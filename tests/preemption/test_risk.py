"""The preemption-risk estimate behind the trap's checkpoint cadence: the pure rule
on hand-computed cases, then the measured rates and the whole estimate on real rows."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.utils import timezone

from portal.celery import app
from portal.tasks import refresh_preemption_risk
from preemption import risk
from preemption.models import Attempt, JobState, PreemptionEvent
from preemption.risk import MeasuredRate, Reclaimer, RunningJob, Standing, estimate_mtbp
from preemption.selectors import measured_preemption_rates, running_attempt_risks
from tests import builders

BATCH = RunningJob(team="ml", flavor="h100", preemptible=True, priority_class="batch")
PROD = RunningJob(team="ml", flavor="h100", preemptible=False, priority_class="prod")
INSIDE = Standing(guarantee=8, usage=4, fair_share=8.0)
BORROWING = Standing(guarantee=8, usage=16, fair_share=16.0)
OVER_SHARE = Standing(guarantee=8, usage=16, fair_share=12.0)
VISION_WAITS = (Reclaimer(team="vision", waiting_jobs=2),)

# (name, job, standing, reclaimers, others waiting, measured, MTBP in seconds, first reason)
CASES = [
    ("inside the guarantee", BATCH, INSIDE, (), False, None, 7 * 86400, "inside its guarantee"),
    ("not preemptible", PROD, BORROWING, VISION_WAITS, True, None, 30 * 86400, "not preemptible"),
    ("borrowing, owner waits", BATCH, BORROWING, VISION_WAITS, True, None, 600, "vision (2 jobs"),
    ("borrowing, nobody waits", BATCH, BORROWING, (), False, None, 4 * 3600, "no owner waits"),
    ("above fair share", BATCH, OVER_SHARE, (), True, None, 3600, "above its fair share"),
    # 2 GPUs preempted in 10 GPU-hours: one preemption per 5 GPU-hours, 18000 s.
    ("measured", BATCH, INSIDE, (), False, MeasuredRate(2, 10.0, 24.0), 18000, "measured: 2"),
    # Half a GPU-hour says too little: the guarantee decides.
    ("too little run", BATCH, INSIDE, (), False, MeasuredRate(1, 0.5, 24.0), 7 * 86400, "inside"),
    # 100 GPUs preempted per GPU-hour would be 36 s: held at the floor of 60 s.
    ("floor", BATCH, BORROWING, VISION_WAITS, True, MeasuredRate(100, 1.0, 24.0), 60, "measured"),
]


@pytest.mark.parametrize(
    ("job", "standing", "reclaimers", "others", "measured", "mtbp", "reason"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_estimate(
    job: RunningJob,
    standing: Standing,
    reclaimers: tuple[Reclaimer, ...],
    others: bool,
    measured: MeasuredRate | None,
    mtbp: float,
    reason: str,
) -> None:
    estimate = estimate_mtbp(
        job, standing=standing, reclaimers=reclaimers, others_waiting=others, measured=measured
    )
    assert estimate.mtbp_seconds == pytest.approx(mtbp)
    assert reason in estimate.reasons[0]


def test_every_cause_is_kept_in_words_the_deciding_one_first() -> None:
    estimate = estimate_mtbp(
        BATCH,
        standing=OVER_SHARE,
        reclaimers=(),
        others_waiting=True,
        measured=MeasuredRate(0, 40.0, 24.0),
    )
    assert estimate.mtbp_seconds == 3600
    assert estimate.reasons == (
        "team ml is above its fair share (16 of 12 h100 GPUs) while other teams wait",
        "team ml holds 16 h100 GPUs, 8 beyond its guarantee of 8; no owner waits for it now",
        "measured: no preemptions in 40.0 GPU-hours in the last 24 h",
    )


# --- on real rows -----------------------------------------------------------------------


def test_measured_rates_weigh_each_preemption_by_its_gpus_per_gpu_hour_run(world: Any) -> None:
    now = timezone.now()
    hours = timedelta(hours=1)
    # ops, borrowing: a 2-GPU attempt ran 3 h and was reclaimed an hour ago (6 GPU-hours,
    # 2 GPUs preempted) and a 1-GPU attempt has run 2 h (2 GPU-hours).
    reclaimed = builders.running_job(
        world, world.ops, gpus_per_rank=2, admitted_at=now - 4 * hours, borrowed=2
    )
    Attempt.objects.filter(job=reclaimed).update(ended_at=now - hours, end_reason="preempted")
    PreemptionEvent.objects.create(
        victim_attempt=Attempt.objects.get(job=reclaimed),
        job=reclaimed,
        reason=PreemptionEvent.Reason.RECLAIM,
        decided_at=now - hours - timedelta(seconds=5),
        grace_seconds=30,
        deadline=now - hours + timedelta(seconds=25),
    )
    builders.running_job(world, world.ops, admitted_at=now - 2 * hours, borrowed=1)
    # A cancel is no preemption, and an attempt that ended before the window ran in none.
    cancelled = builders.running_job(world, world.ops, admitted_at=now - 2 * hours, borrowed=1)
    PreemptionEvent.objects.create(
        victim_attempt=Attempt.objects.get(job=cancelled),
        job=cancelled,
        reason=PreemptionEvent.Reason.MANUAL,
        decided_at=now - hours,
        grace_seconds=30,
        deadline=now - hours + timedelta(seconds=30),
    )
    Attempt.objects.filter(job=cancelled).update(ended_at=now - hours)
    old = builders.running_job(world, world.ops, admitted_at=now - 30 * hours, borrowed=1)
    Attempt.objects.filter(job=old).update(ended_at=now - 25 * hours)
    # ops inside its guarantee: 4 GPUs for 10 h, 2 of which lie in the 8-hour window.
    builders.running_job(world, world.ops, gpus_per_rank=4, admitted_at=now - 10 * hours)

    rates = measured_preemption_rates(now=now, window_seconds=8 * 3600)

    borrowing = rates[("ops", world.h100.name, True)]
    assert borrowing.preempted_gpus == 2
    # 6 + 2 + 1 (the cancelled one, for the hour it ran) GPU-hours.
    assert borrowing.gpu_hours == pytest.approx(9.0, abs=1e-3)
    assert borrowing.mtbp_seconds == pytest.approx(9.0 / 2 * 3600, rel=1e-3)
    inside = rates[("ops", world.h100.name, False)]
    assert inside.preempted_gpus == 0 and inside.gpu_hours == pytest.approx(32.0, abs=1e-3)
    assert inside.mtbp_seconds is None
    assert set(rates) == {("ops", world.h100.name, True), ("ops", world.h100.name, False)}


def test_a_borrower_whose_owner_waits_gets_a_short_mtbp_a_guaranteed_job_a_long_one(
    world: Any, settings: Any
) -> None:
    # The borrower is spared by the reclaim's minimum runtime, so vision's job waits.
    settings.QM_RECLAIM_MIN_RUNTIME_SECONDS = 3600
    now = timezone.now()
    # ops (guarantee 8) runs 16 GPUs: 8 borrowed from org's idle guarantee.
    borrower = builders.running_job(
        world, world.ops, ranks=2, gpus_per_rank=8, node="h100-node-0", borrowed=8
    )
    Attempt.objects.filter(job=borrower).update(
        placement=[{"node": "h100-node-0", "ranks": 1}, {"node": "h100-node-1", "ranks": 1}]
    )
    # nlp (guarantee 8) runs 4 GPUs, inside it.
    guaranteed = builders.running_job(world, world.nlp, gpus_per_rank=4, node="h100-node-2")
    # A non-preemptible job of nlp, also inside.
    steady = builders.running_job(
        world, world.nlp, gpus_per_rank=2, node="h100-node-2", priority_class=world.critical
    )
    builders.job(world, world.vision, state=JobState.PENDING, gpus_per_rank=8)

    risks = running_attempt_risks(now=now, window_seconds=86400)

    def of(job: Any) -> risk.Risk:
        return risks[Attempt.objects.get(job=job, ended_at__isnull=True).pk]

    assert of(borrower).mtbp_seconds == risk.RECLAIM_IMMINENT
    assert of(borrower).reasons[0] == (
        f"team ops holds 16 {world.h100.name} GPUs, 8 beyond its guarantee of 8, and teams "
        "under their guarantee wait for it: vision (1 job waiting)"
    )
    assert of(guaranteed).mtbp_seconds == risk.CALM
    assert of(guaranteed).reasons[0].startswith("team nlp is inside its guarantee (6 of 8")
    assert of(steady).mtbp_seconds == risk.NEVER
    assert len(risks) == 3


def test_the_beat_runs_the_refresh_which_stores_each_estimate(world: Any) -> None:
    app.finalize()
    entry = app.conf.beat_schedule["refresh preemption risk"]
    assert entry["task"] == "preemption.tasks.refresh_preemption_risk"
    assert entry["schedule"] == settings.QM_RISK_SECONDS
    running = builders.running_job(world, world.vision, gpus_per_rank=4)

    assert refresh_preemption_risk.run() == 1

    attempt = Attempt.objects.get(job=running)
    assert attempt.preemption_mtbp_seconds == risk.CALM
    assert attempt.preemption_risk_reasons == [
        f"team vision is inside its guarantee (4 of 8 {world.h100.name} GPUs)"
    ]
    assert attempt.preemption_risk_at is not None
