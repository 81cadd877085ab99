"""The drill's typed result: how it is judged against the mission's targets, the
JSON it stores, and that the telemetry page's mission matrix judges the same
figures the same way (both read `telemetry.mission`)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from drills.measure import stop_reached
from drills.result import ChaosRound, DrillResult, RoundFigures
from preemption.models import TrapEvent
from telemetry.mission import MISSION
from telemetry.models import DrillRun
from telemetry.report_selectors import mission_matrix
from tests.drills.rounds import GOOD

TARGET_SIGNAL = MISSION.signal_propagation_seconds
TARGET_RECOVERY = MISSION.recovery_seconds


def drill(figures: RoundFigures, *, grace: float = 60.0, ranks: int = 2) -> DrillResult:
    return DrillResult(runtime="local", ranks=ranks, grace_seconds=grace, figures=figures)


CASES: list[tuple[str, dict[str, Any], float, list[str]]] = [
    # name, changed figures, grace seconds, what the drill reports missed
    ("all targets met", {}, 60.0, []),
    (
        "signal just under the target",
        {"signal_propagation_seconds": TARGET_SIGNAL - 0.01},
        60.0,
        [],
    ),
    (
        "signal at the target",
        {"signal_propagation_seconds": TARGET_SIGNAL},
        60.0,
        [f"signal propagation {MISSION.signal_text}"],
    ),
    (
        "the stop reached no rank",
        {"signal_propagation_seconds": None, "signals_received": 0, "ranks_told": 0},
        60.0,
        [
            f"signal propagation {MISSION.signal_text}",
            "the stop reached 0 of 2 ranks (their own signal: 0)",
        ],
    ),
    (
        "one rank stopped with its gang before its own signal came",
        {"signals_received": 1, "signal_latency_seconds": [0.30, None]},
        60.0,
        [],
    ),
    (
        "a document from before the count of ranks told judges the signals",
        {"signals_received": 1, "ranks_told": None},
        60.0,
        ["the stop reached 1 of 2 ranks (their own signal: 1)"],
    ),
    ("checkpoint fills the grace", {"checkpoint_seconds": 60.0}, 60.0, []),
    (
        "checkpoint past the grace",
        {"checkpoint_seconds": 61.0},
        60.0,
        [f"checkpoint of 61 s: {MISSION.checkpoint_text}"],
    ),
    (
        "no checkpoint",
        {"checkpoint_committed": False, "checkpoint_step": None},
        60.0,
        ["no checkpoint committed"],
    ),
    ("a rank killed", {"exit_codes": [0, 137]}, 60.0, ["exit codes [0, 137]"]),
    ("an orphaned port", {"orphaned_ports": 1}, 60.0, ["1 orphaned ports"]),
    ("resumed state differs", {"restart_integrity": False}, 60.0, ["restart integrity"]),
    (
        "recovery at the target",
        {"recovery_seconds": TARGET_RECOVERY},
        60.0,
        [f"recovery {MISSION.recovery_text}"],
    ),
    ("never resumed", {"recovery_seconds": None}, 60.0, [f"recovery {MISSION.recovery_text}"]),
]


@pytest.mark.parametrize(
    ("changes", "grace", "missed"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_round_is_judged_against_the_mission_targets(
    changes: dict[str, Any], grace: float, missed: list[str]
) -> None:
    result = drill(replace(GOOD, **changes), grace=grace)
    assert result.missed() == missed
    assert result.passed is (not missed)
    assert result.to_json()["passed"] is result.passed


def test_the_json_document_keeps_its_schema() -> None:
    document = drill(GOOD).to_json()
    assert document == {
        "schema_version": 1,
        "runtime": "local",
        "ranks": 2,
        "grace_seconds": 60.0,
        "borrower_job": 7,
        "critical_job": 8,
        "borrower_state": "succeeded",
        "signal_propagation_seconds": 0.31,
        "signal_latency_seconds": [0.30, 0.31],
        "signals_received": 2,
        "checkpoint_seconds": 2.5,
        "checkpoint_step": 15,
        "checkpoint_committed": True,
        "outcome": "graceful",
        "exit_codes": [0, 0],
        "orphaned_ports": 0,
        "restart_integrity": True,
        "restart_max_abs_diff": 0.0,
        "recovery_seconds": 12.0,
        "utilization": 0.8,
        # Added with the checkpoint notice; older documents lack them.
        "notice": False,
        "notice_committed": False,
        "lost_gpu_seconds": None,
        "time_to_free_seconds": None,
        "stall_sync_seconds": None,
        "stall_async_seconds": None,
        # Added with the drill on real nodes, where a rank may stop with its gang
        # before its own signal comes.
        "ranks_told": 2,
        # Added with the relay: the control plane's share of the propagation.
        "signal_sent_seconds": None,
        "passed": True,
    }


def test_a_chaos_series_passes_only_without_a_failure() -> None:
    clean = ChaosRound(1, "kill-rank", 0, 0, 0, 0, 0.0, [0, 0], "graceful")
    lossy = ChaosRound(2, "kill-worker", 0, 0, 0, 3, 0.0, [0, 0], "graceful")
    series = DrillResult(runtime="local", ranks=2, grace_seconds=60.0, chaos=[clean, lossy])
    assert series.missed() == ["round 2 (kill-worker): 3 lost events"]
    document = series.to_json()
    assert document["passed"] is False and document["chaos_rounds"] == 2
    assert document["lost_events"] == 3 and document["corrupt_checkpoints"] == 0
    assert [r["disturbance"] for r in document["rounds"]] == ["kill-rank", "kill-worker"]
    assert DrillResult(runtime="local", ranks=2, grace_seconds=60.0, chaos=[clean]).passed
    assert DrillResult(runtime="local", ranks=2, grace_seconds=60.0).missed() == [
        "no round was measured"
    ]


MATRIX_ROWS = {
    "signal": "Signal reaches every rank",
    "checkpoint": "Graceful window: checkpoint inside the grace",
    "recovery": "Recovery time",
}


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"signal_propagation_seconds": TARGET_SIGNAL},
        {"signal_propagation_seconds": TARGET_SIGNAL - 0.001},
        {"checkpoint_seconds": 60.0},
        {"checkpoint_seconds": 60.5},
        {"recovery_seconds": TARGET_RECOVERY},
        {"recovery_seconds": TARGET_RECOVERY - 0.1},
    ],
)
def test_the_drill_and_the_mission_matrix_agree(changes: dict[str, Any]) -> None:
    result = drill(replace(GOOD, **changes), grace=60.0)
    stored = DrillRun(
        started_at=datetime(2026, 1, 1, tzinfo=UTC),
        runtime="local",
        ranks=2,
        grace_seconds=60.0,
        result=result.to_json(),
    )
    rows = {row.name: row for row in mission_matrix([stored])}
    missed = " ".join(result.missed())
    assert rows[MATRIX_ROWS["signal"]].passed is ("signal" not in missed)
    assert rows[MATRIX_ROWS["checkpoint"]].passed is ("checkpoint" not in missed)
    assert rows[MATRIX_ROWS["recovery"]].passed is ("recovery" not in missed)
    assert rows[MATRIX_ROWS["signal"]].target == MISSION.signal_text == "max under 1.2 s"
    assert rows[MATRIX_ROWS["recovery"]].target == MISSION.recovery_text == "under 90 s"


def test_a_rank_is_told_of_the_stop_by_its_signal_or_its_gangs_agreed_step() -> None:
    def event(rank: int, name: str, at: float, step: int | None = None) -> TrapEvent:
        return TrapEvent(rank=rank, event=name, at=at, step=step, payload={})

    told = stop_reached(
        [
            # Before the decision: nothing it says is about this stop.
            event(0, "signal_received", 99.0),
            event(1, "checkpoint_started", 100.5, step=10),  # a periodic save
            event(0, "signal_received", 101.0),
            event(0, "checkpoint_started", 101.4, step=12),
            # Rank 1's node signals it late: it stopped at the agreed step first.
            event(1, "checkpoint_started", 101.5, step=12),
            event(1, "signal_received", 103.0),
            event(2, "notice_received", 100.8),
            event(3, "checkpoint_skipped", 101.6, step=12),
        ],
        decided=100.0,
        agreed_step=12,
    )
    assert told == {0: 101.0, 1: 101.5, 2: 100.8, 3: 101.6}
    # Without an agreed step only signals and notices tell.
    assert stop_reached(
        [event(1, "checkpoint_started", 101.5, step=12), event(0, "signal_received", 101.0)],
        decided=100.0,
        agreed_step=None,
    ) == {0: 101.0}
