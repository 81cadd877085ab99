"""Reads of the preemption figures, scoped to the asking user: signal latencies,
checkpoints against the grace period, exit codes and recovery times. Each reads
at most RECENT_ROWS recent rows; never writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count

from core.access import Access
from preemption.models import PreemptionEvent, Rank
from telemetry.selectors import RECENT_ROWS, team_filter


def signal_latencies(*, access: Access) -> list[float]:
    """Seconds from each preemption decision to each rank's signal_received,
    for the most recent ranks that were signalled."""
    rows = (
        Rank.objects.filter(signal_received_at__isnull=False, attempt__preemption__isnull=False)
        .exclude(attempt__preemption__reason=PreemptionEvent.Reason.MANUAL)
        .filter(team_filter(access, "attempt__job__team_id"))
        .order_by("-signal_received_at")
        .values_list("signal_received_at", "attempt__preemption__decided_at")[:RECENT_ROWS]
    )
    return [(received - decided).total_seconds() for received, decided in rows]


@dataclass(frozen=True)
class CheckpointAgainstGrace:
    """What one preemption's checkpoint took next to the grace window it had."""

    job_id: int
    decided_at: datetime
    grace_seconds: float
    checkpoint_seconds: float
    outcome: str


def checkpoints_against_grace(*, access: Access) -> list[CheckpointAgainstGrace]:
    rows = (
        PreemptionEvent.objects.preemptions()
        .filter(checkpoint_seconds__isnull=False)
        .filter(team_filter(access, "job__team_id"))
        .order_by("-decided_at")
        .values_list("job_id", "decided_at", "grace_seconds", "checkpoint_seconds", "outcome")[
            :RECENT_ROWS
        ]
    )
    return [CheckpointAgainstGrace(*row) for row in reversed(rows)]


def exit_codes(*, access: Access) -> list[tuple[int, str, int]]:
    """(exit code, how the attempt ended, number of ranks) over every ended rank."""
    rows = (
        Rank.objects.filter(exit_code__isnull=False)
        .filter(team_filter(access, "attempt__job__team_id"))
        .values("exit_code", "attempt__end_reason")
        .annotate(ranks=Count("id"))
        .order_by("exit_code", "attempt__end_reason")
    )
    return [
        (row["exit_code"], row["attempt__end_reason"] or "running", row["ranks"]) for row in rows
    ]


def recovery_seconds(*, access: Access) -> list[tuple[int, float]]:
    """(job id, seconds from the preemption decision to the resumed attempt)."""
    rows = (
        PreemptionEvent.objects.preemptions()
        .filter(resumed_at__isnull=False)
        .filter(team_filter(access, "job__team_id"))
        .order_by("-decided_at")
        .values_list("job_id", "decided_at", "resumed_at")[:RECENT_ROWS]
    )
    return [(job_id, (resumed - decided).total_seconds()) for job_id, decided, resumed in rows]
