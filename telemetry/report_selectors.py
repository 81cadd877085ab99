"""Reads of the drill and simulation reports: the mission matrix over recent drill
runs and the recorded simulation runs. Cluster-wide figures, not scoped to a
team; never writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import PurePath
from typing import Any

from telemetry.mission import MISSION
from telemetry.models import DrillRun, SimulationRun

# --- the mission matrix --------------------------------------------------------


@dataclass(frozen=True)
class MissionCriterion:
    """One row of the mission's matrix, measured over the latest drills."""

    name: str
    target: str
    latest: str
    over_runs: str
    passed: bool | None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    return None


def _count(value: Any) -> int | None:
    if isinstance(value, list | tuple | dict):
        return len(value)
    number = _number(value)
    return None if number is None else int(number)


def _utilization(value: Any) -> float | None:
    """A drill's utilization as a fraction: a number, or a mapping holding one."""
    number = _number(value)
    if number is None and isinstance(value, dict):
        for key in ("mean", "average", "during", "value", "utilization"):
            number = _number(value.get(key))
            if number is not None:
                break
    if number is not None and number > 1.0:
        number /= 100.0
    return number


def latest_drills(limit: int = 10) -> list[DrillRun]:
    return list(DrillRun.objects.filter(finished_at__isnull=False).order_by("-started_at")[:limit])


def mission_matrix(drills: list[DrillRun]) -> list[MissionCriterion]:
    """The mission's criteria, filled from the `--json` figures each drill stored."""
    if not drills:
        return []
    results = [drill.result or {} for drill in drills]
    runs = len(results)

    def seconds(value: float | None) -> str:
        return "—" if value is None else f"{value:.2f} s"

    propagation = [_number(r.get("signal_propagation_seconds")) for r in results]
    known_propagation = [p for p in propagation if p is not None]
    ckpt = [
        (
            _number(r.get("checkpoint_seconds")),
            _number(r.get("grace_seconds")) or drill.grace_seconds,
        )
        for r, drill in zip(results, drills, strict=True)
    ]
    inside = [c is not None and MISSION.checkpoint_met(c, g) for c, g in ckpt]
    committed = [bool(r.get("checkpoint_committed")) for r in results]
    codes = [list(r.get("exit_codes") or []) for r in results]
    clean_exits = [bool(c) and all(code == 0 for code in c) for c in codes]
    orphans = [_count(r.get("orphaned_ports")) for r in results]
    integrity = [r.get("restart_integrity") for r in results]
    recovery = [_number(r.get("recovery_seconds")) for r in results]
    known_recovery = [r for r in recovery if r is not None]
    utilization = [_utilization(r.get("utilization")) for r in results]
    known_utilization = [u for u in utilization if u is not None]

    latest_ckpt, latest_grace = ckpt[0]
    return [
        MissionCriterion(
            "Signal reaches every rank",
            MISSION.signal_text,
            seconds(propagation[0]),
            f"worst {max(known_propagation):.2f} s" if known_propagation else "—",
            all(MISSION.signal_met(p) for p in known_propagation) if known_propagation else None,
        ),
        MissionCriterion(
            "Graceful window: checkpoint inside the grace",
            MISSION.checkpoint_text,
            f"{seconds(latest_ckpt)} of {latest_grace:.0f} s",
            f"{sum(inside)} of {runs} runs inside",
            all(inside),
        ),
        MissionCriterion(
            "Checkpoint success rate",
            "100 %",
            "committed" if committed[0] else "not committed",
            f"{100.0 * sum(committed) / runs:.0f} % of {runs} runs",
            all(committed),
        ),
        MissionCriterion(
            "Every rank exits 0",
            "no 137",
            ", ".join(str(c) for c in sorted(set(codes[0]))) or "—",
            f"{sum(clean_exits)} of {runs} runs clean",
            all(clean_exits),
        ),
        MissionCriterion(
            "Orphaned sockets",
            "0",
            "—" if orphans[0] is None else str(orphans[0]),
            f"{sum(o or 0 for o in orphans)} in {runs} runs",
            all(o == 0 for o in orphans),
        ),
        MissionCriterion(
            "Restart integrity",
            "max abs diff 0.0",
            "exact" if integrity[0] is True else ("differs" if integrity[0] is False else "—"),
            f"{sum(1 for i in integrity if i is True)} of {runs} runs exact",
            all(i is True for i in integrity),
        ),
        MissionCriterion(
            "Utilization",
            "GPUs kept busy",
            "—" if utilization[0] is None else f"{100.0 * utilization[0]:.0f} %",
            f"mean {100.0 * sum(known_utilization) / len(known_utilization):.0f} %"
            if known_utilization
            else "—",
            None,
        ),
        MissionCriterion(
            "Recovery time",
            MISSION.recovery_text,
            seconds(recovery[0]),
            f"worst {max(known_recovery):.1f} s" if known_recovery else "—",
            all(MISSION.recovery_met(r) for r in known_recovery) if known_recovery else None,
        ),
    ]


# --- simulation reports ----------------------------------------------------------


@dataclass(frozen=True)
class SimulationReport:
    """One stored trace replay of `manage.py simulate` (a SimulationRun row)."""

    run_id: int
    name: str
    modified: datetime
    report: dict[str, Any]

    @property
    def policy(self) -> str:
        return str(self.report.get("run", {}).get("policy", "?"))

    @property
    def allocation(self) -> float | None:
        return _number((self.report.get("allocation") or {}).get("overall"))

    @property
    def completion(self) -> dict[str, Any]:
        return self.report.get("completion_time_seconds") or {}

    @property
    def queueing(self) -> dict[str, Any]:
        return self.report.get("queueing_delay_seconds") or {}


def simulation_reports(limit: int = 20) -> list[SimulationReport]:
    """The newest stored simulation runs whose report has the documented shape."""
    reports = []
    rows = SimulationRun.objects.order_by("-created_at", "-id").values_list(
        "id", "trace", "created_at", "report"
    )[:limit]
    for run_id, trace, created_at, report in rows:
        if not isinstance(report, dict) or "allocation" not in report or "teams" not in report:
            continue
        name = f"#{run_id} {PurePath(trace).name}" if trace else f"#{run_id}"
        reports.append(
            SimulationReport(run_id=run_id, name=name, modified=created_at, report=report)
        )
    return reports
