"""The drill with the checkpoint notice on and off: the comparison it reports and
how it is judged, and the lost work it measures from a victim's trap events."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from drills.measure import lost_gpu_seconds
from drills.result import DrillResult
from preemption.models import Attempt, PreemptionEvent, Rank, TrapEvent
from telemetry.mission import MISSION
from tests.drills.rounds import GOOD

BASE = replace(
    GOOD,
    checkpoint_seconds=0.5,
    checkpoint_step=46,
    lost_gpu_seconds=18.0,
    time_to_free_seconds=3.0,
    stall_sync_seconds=0.4,
)


def compared(**with_notice: Any) -> DrillResult:
    on = replace(BASE, notice=True, notice_committed=True, **with_notice)
    return DrillResult(
        runtime="local", ranks=2, grace_seconds=60.0, figures=on, without_notice=BASE
    )


@pytest.mark.parametrize(
    ("name", "with_notice", "missed"),
    [
        ("both goals met", {"lost_gpu_seconds": 0.5, "time_to_free_seconds": 3.2}, []),
        (
            "lost work at the 5% line",
            {"lost_gpu_seconds": 18.0 * MISSION.notice_lost_work_share},
            [f"lost work with the notice {MISSION.notice_lost_work_text}"],
        ),
        (
            "GPUs free later than one reconcile pass after today's",
            {"lost_gpu_seconds": 0.1, "time_to_free_seconds": 4.01},
            [f"time to free with the notice {MISSION.notice_time_to_free_text}"],
        ),
        (
            "nothing measured with the notice",
            {"lost_gpu_seconds": None, "time_to_free_seconds": None},
            [
                f"lost work with the notice {MISSION.notice_lost_work_text}",
                f"time to free with the notice {MISSION.notice_time_to_free_text}",
            ],
        ),
    ],
)
def test_the_notice_is_judged_against_the_same_round_without_it(
    name: str, with_notice: dict[str, Any], missed: list[str]
) -> None:
    assert compared(**with_notice).missed() == missed, name


def test_the_comparison_is_in_the_stored_document() -> None:
    document = compared(
        lost_gpu_seconds=0.45, time_to_free_seconds=2.5, stall_async_seconds=0.02
    ).to_json()
    assert document["notice"] is True
    assert document["without_notice"]["notice"] is False
    comparison = document["notice_comparison"]
    assert comparison["lost_gpu_seconds"] == {"with": 0.45, "without": 18.0}
    assert comparison["lost_work_share"] == 0.025
    assert comparison["lost_work_met"] and comparison["time_to_free_met"]
    assert comparison["stall_sync_seconds"] == {"with": 0.4, "without": 0.4}
    assert comparison["stall_async_seconds"] == {"with": 0.02, "without": None}
    assert document["passed"] is True
    alone = DrillResult(runtime="local", ranks=2, grace_seconds=60.0, figures=BASE).to_json()
    assert "notice_comparison" not in alone


T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


def trap(rank: int, event: str, seconds: float, step: int | None = None) -> TrapEvent:
    return TrapEvent(
        rank=rank, event=event, at=(T0 + timedelta(seconds=seconds)).timestamp(), step=step
    )


def victim(evicted: float) -> PreemptionEvent:
    attempt = Attempt(number=1, admitted_at=T0, launched_at=T0)
    return PreemptionEvent(
        victim_attempt=attempt,
        decided_at=T0 + timedelta(seconds=10),
        grace_seconds=60,
        deadline=T0 + timedelta(seconds=70),
        signal_sent_at=T0 + timedelta(seconds=evicted),
    )


def test_lost_work_runs_from_the_last_committed_step_to_the_stop() -> None:
    ranks = [Rank(index=0), Rank(index=1)]
    # A regular checkpoint of step 9 began at 2 s; the notice's of step 46 at 10.5 s
    # and committed at 10.9 s; the eviction came at 11.0 s and the ranks stopped at
    # 11.2 s (rank 0) and 11.3 s (rank 1), saving step 47.
    events = []
    for rank, stop in ((0, 11.2), (1, 11.3)):
        events += [
            trap(rank, "checkpoint_started", 2.0, 9),
            trap(rank, "checkpoint_committed", 2.1, 9),
            trap(rank, "checkpoint_started", 10.5, 46),
            trap(rank, "checkpoint_committed", 10.9, 46),
            trap(rank, "checkpoint_started", stop, 47),
            trap(rank, "checkpoint_committed", stop + 0.3, 47),
        ]
    assert lost_gpu_seconds(victim(11.0), ranks, events, gpus_per_rank=8) == pytest.approx(
        (0.7 + 0.8) * 8
    )
    # Without the notice's checkpoint: back to the regular one.
    regular = [e for e in events if e.step != 46]
    assert lost_gpu_seconds(victim(11.0), ranks, regular, gpus_per_rank=8) == pytest.approx(
        (9.2 + 9.3) * 8
    )
    # Without any checkpoint: back to the start; a killed rank stops at its exit.
    killed = [Rank(index=0, exited_at=T0 + timedelta(seconds=12)), Rank(index=1)]
    only_rank_1 = [e for e in events if e.rank == 1 and e.step == 47]
    assert lost_gpu_seconds(victim(11.0), killed, only_rank_1, gpus_per_rank=1) == pytest.approx(
        12.0 + 11.3
    )
    assert lost_gpu_seconds(PreemptionEvent(), ranks, events, gpus_per_rank=1) is None
