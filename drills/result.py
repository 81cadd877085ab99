"""What a drill measured, typed, and whether it met the mission's targets.

`DrillResult.to_json()` is the document `manage.py drill --json` writes and
`DrillRun.result` stores (schema version 1, the same keys as before the result
was typed), which the telemetry page's mission matrix reads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from telemetry.mission import MISSION, MissionTargets

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class RoundFigures:
    """One round: a borrower's gang is preempted by a critical job and resumes."""

    borrower_job: int
    critical_job: int
    borrower_state: str
    # Decision -> the slowest rank's `signal_received`; None when no rank reported.
    signal_propagation_seconds: float | None
    signal_latency_seconds: list[float | None]
    signals_received: int
    checkpoint_seconds: float | None
    checkpoint_step: int | None
    checkpoint_committed: bool
    outcome: str
    exit_codes: list[int | None]
    orphaned_ports: int
    # Final parameters, optimizer moments, RNG states and loss equal to an
    # uninterrupted reference run, and the borrower succeeded.
    restart_integrity: bool
    restart_max_abs_diff: float | None
    # The critical job's last rank exit -> the borrower's `resumed`.
    recovery_seconds: float | None
    # GPU-seconds used by both jobs over the capacity and time of the round.
    utilization: float
    # Whether the borrower's class sent a checkpoint notice before the eviction.
    # With it, `signal_propagation_seconds` is the decision -> the slowest rank's
    # `notice_received`, the first word that reaches the ranks.
    notice: bool = False
    notice_committed: bool = False
    # GPU-seconds of work done since the last committed checkpoint when the ranks
    # stopped training (the work the eviction's own save has to rescue).
    lost_gpu_seconds: float | None = None
    # The decision -> the victim's last rank exited.
    time_to_free_seconds: float | None = None
    # Mean training stall per checkpoint of the round, synchronous and background saves.
    stall_sync_seconds: float | None = None
    stall_async_seconds: float | None = None
    # Ranks that learned of the stop after the decision: by their own signal (or the
    # notice), or by the gang's agreement on the step to stop at (that step's
    # checkpoint), which is how a rank whose node signals it late still stops with its
    # gang. None in documents from before it was counted (signals_received stood for it).
    ranks_told: int | None = None
    # The decision -> the runtime's call that signals the ranks (on Kubernetes, the
    # evictions issued): the control plane's share of the signal propagation; the
    # rest is the nodes' (the kubelets, or the local launcher) and the relay's.
    signal_sent_seconds: float | None = None

    def missed(
        self, *, ranks: int, grace_seconds: float, targets: MissionTargets = MISSION
    ) -> list[str]:
        """The criteria this round did not meet, worded for a person; empty when it passed."""
        missed = []
        if self.signal_propagation_seconds is None or not targets.signal_met(
            self.signal_propagation_seconds
        ):
            missed.append(f"signal propagation {targets.signal_text}")
        told = self.signals_received if self.ranks_told is None else self.ranks_told
        if told != ranks:
            missed.append(
                f"the stop reached {told} of {ranks} ranks "
                f"(their own signal: {self.signals_received})"
            )
        if not self.checkpoint_committed:
            missed.append("no checkpoint committed")
        elif self.checkpoint_seconds is not None and not targets.checkpoint_met(
            self.checkpoint_seconds, grace_seconds
        ):
            missed.append(f"checkpoint of {self.checkpoint_seconds:g} s: {targets.checkpoint_text}")
        if not all(code == 0 for code in self.exit_codes):
            missed.append(f"exit codes {self.exit_codes}")
        if self.orphaned_ports:
            missed.append(f"{self.orphaned_ports} orphaned ports")
        if not self.restart_integrity:
            missed.append("restart integrity")
        if self.recovery_seconds is None or not targets.recovery_met(self.recovery_seconds):
            missed.append(f"recovery {targets.recovery_text}")
        return missed


@dataclass(frozen=True)
class ChaosRound:
    """One round of `--chaos`: the disturbance and the independent checks after it."""

    round: int
    disturbance: str
    corrupt_checkpoints: int
    orphaned_ranks: int
    double_preemptions: int
    lost_events: int
    restart_max_abs_diff: float | None
    exit_codes: list[int | None]
    outcome: str
    notice: bool = False
    lost_gpu_seconds: float | None = None
    time_to_free_seconds: float | None = None

    @property
    def failures(self) -> int:
        return (
            self.corrupt_checkpoints
            + self.orphaned_ranks
            + self.double_preemptions
            + self.lost_events
        )


CHAOS_COUNTS = ("corrupt_checkpoints", "orphaned_ranks", "double_preemptions", "lost_events")


@dataclass(frozen=True)
class DrillResult:
    """A whole drill: its settings and either one measured round or a chaos series."""

    runtime: str
    ranks: int
    grace_seconds: float
    figures: RoundFigures | None = None
    chaos: list[ChaosRound] = field(default_factory=list)
    # The same round without the checkpoint notice, when the drill ran both.
    without_notice: RoundFigures | None = None

    @property
    def passed(self) -> bool:
        return not self.missed()

    def notice_figures(self, targets: MissionTargets = MISSION) -> dict[str, Any] | None:
        """The notice against none: lost work and time to free of both rounds."""
        on, off = self.figures, self.without_notice
        if on is None or off is None:
            return None
        lost_share = None
        if on.lost_gpu_seconds is not None and off.lost_gpu_seconds:
            lost_share = round(on.lost_gpu_seconds / off.lost_gpu_seconds, 4)
        lost_met = (
            on.lost_gpu_seconds is not None
            and off.lost_gpu_seconds is not None
            and targets.notice_lost_work_met(on.lost_gpu_seconds, off.lost_gpu_seconds)
        )
        free_met = (
            on.time_to_free_seconds is not None
            and off.time_to_free_seconds is not None
            and targets.notice_time_to_free_met(on.time_to_free_seconds, off.time_to_free_seconds)
        )
        return {
            "lost_gpu_seconds": {"with": on.lost_gpu_seconds, "without": off.lost_gpu_seconds},
            "lost_work_share": lost_share,
            "lost_work_met": lost_met,
            "time_to_free_seconds": {
                "with": on.time_to_free_seconds,
                "without": off.time_to_free_seconds,
            },
            "time_to_free_met": free_met,
            "stall_sync_seconds": {
                "with": on.stall_sync_seconds,
                "without": off.stall_sync_seconds,
            },
            "stall_async_seconds": {
                "with": on.stall_async_seconds,
                "without": off.stall_async_seconds,
            },
        }

    def missed(self) -> list[str]:
        """The criteria the drill did not meet; empty when it passed."""
        if self.chaos:
            return [
                f"round {r.round} ({r.disturbance}): "
                + ", ".join(
                    f"{getattr(r, name)} {name.replace('_', ' ')}"
                    for name in CHAOS_COUNTS
                    if getattr(r, name)
                )
                for r in self.chaos
                if r.failures
            ]
        if self.figures is None:
            return ["no round was measured"]
        missed = self.figures.missed(ranks=self.ranks, grace_seconds=self.grace_seconds)
        if self.without_notice is not None:
            missed += [
                f"without notice: {m}"
                for m in self.without_notice.missed(
                    ranks=self.ranks, grace_seconds=self.grace_seconds
                )
            ]
            compared = self.notice_figures()
            assert compared is not None
            if not compared["lost_work_met"]:
                missed.append(f"lost work with the notice {MISSION.notice_lost_work_text}")
            if not compared["time_to_free_met"]:
                missed.append(f"time to free with the notice {MISSION.notice_time_to_free_text}")
        return missed

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "runtime": self.runtime,
            "ranks": self.ranks,
            "grace_seconds": self.grace_seconds,
        }
        if self.figures is not None:
            document.update(asdict(self.figures))
        if self.without_notice is not None:
            document["without_notice"] = asdict(self.without_notice)
            document["notice_comparison"] = self.notice_figures()
        if self.chaos:
            document["chaos_rounds"] = len(self.chaos)
            document["rounds"] = [asdict(r) for r in self.chaos]
            for name in CHAOS_COUNTS:
                document[name] = sum(getattr(r, name) for r in self.chaos)
        document["passed"] = self.passed
        return document
