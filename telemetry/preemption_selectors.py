"""Reads of the preemption figures, scoped to the asking user: signal latencies,
checkpoints against the grace period, exit codes, recovery times, and the
resizes of elastic gangs beside the preemptions. Each reads at most RECENT_ROWS
recent rows, or aggregates in the database; never writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import Case, Count, Q, Value, When

from core.access import Access
from preemption.models import PreemptionEvent, Rank, attempt_ranks
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


# --- resizes of elastic gangs -------------------------------------------------
# A resize stops an elastic gang at an agreed step and relaunches it at once at
# another size: no preemption (`StopQuerySet.resizes()`), so it is counted and
# charted beside them, never among them. A resize whose gang finished its work
# before the stop reached it (outcome `ended-first`) resized nothing, as such a
# stop preempted nothing, and is left out the same way.

SHRINK = "shrink"
GROW = "grow"


def resize_direction() -> Case:
    """For a query of resize events: "shrink" when the gang was relaunched with
    fewer ranks than the attempt it stopped ran, else "grow"."""
    return Case(
        When(Q(resize_ranks__lt=attempt_ranks("victim_attempt__")), then=Value(SHRINK)),
        default=Value(GROW),
    )


def counted_resizes() -> Q:
    """The resizes counted and charted, decided or done: every one but a resize
    whose gang ended first."""
    return Q(reason=PreemptionEvent.Reason.RESIZE) & ~Q(outcome=PreemptionEvent.Outcome.ENDED_FIRST)


@dataclass(frozen=True)
class StopsOfTeam:
    """How often one team's running jobs were stopped: preempted for others'
    work, shrunk, or stopped to grow."""

    team: str
    preemptions: int
    shrinks: int
    grows: int


def stops_by_team(*, access: Access) -> list[StopsOfTeam]:
    """Preemptions, shrinks and grows per team, over the whole history, in two
    aggregate queries; teams with none are left out."""
    preempted = dict(
        PreemptionEvent.objects.preemptions()
        .filter(team_filter(access, "job__team_id"))
        .values("job__team__slug")
        .annotate(n=Count("id"))
        .values_list("job__team__slug", "n")
        .order_by()
    )
    resized: dict[str, dict[str, int]] = {}
    for slug, direction, n in (
        PreemptionEvent.objects.filter(counted_resizes())
        .filter(team_filter(access, "job__team_id"))
        .annotate(direction=resize_direction())
        .values("job__team__slug", "direction")
        .annotate(n=Count("id"))
        .values_list("job__team__slug", "direction", "n")
        .order_by()
    ):
        resized.setdefault(slug, {})[direction] = n
    return [
        StopsOfTeam(
            team=slug,
            preemptions=preempted.get(slug, 0),
            shrinks=resized.get(slug, {}).get(SHRINK, 0),
            grows=resized.get(slug, {}).get(GROW, 0),
        )
        for slug in sorted(preempted.keys() | resized.keys())
    ]


@dataclass(frozen=True)
class ResizeStop:
    """One resize: from how many ranks to how many, and, once every rank of the
    stopped gang has exited, the seconds that took from the decision and the
    work it lost (None while the gang is still stopping)."""

    job_id: int
    attempt: int
    team: str
    decided_at: datetime
    from_ranks: int
    to_ranks: int
    grace_seconds: float
    seconds_to_free: float | None
    lost_gpu_seconds: float | None
    cause: str

    @property
    def direction(self) -> str:
        return SHRINK if self.to_ranks < self.from_ranks else GROW


def resize_stops(*, access: Access) -> list[ResizeStop]:
    """The most recent resizes, oldest first."""
    rows = (
        PreemptionEvent.objects.filter(counted_resizes())
        .filter(team_filter(access, "job__team_id"))
        .annotate(from_ranks=attempt_ranks("victim_attempt__"))
        .order_by("-decided_at", "-id")
        .values_list(
            "job_id",
            "victim_attempt__number",
            "job__team__slug",
            "decided_at",
            "from_ranks",
            "resize_ranks",
            "grace_seconds",
            "all_exited_at",
            "lost_gpu_seconds",
            "cause",
        )[:RECENT_ROWS]
    )
    return [
        ResizeStop(
            job_id=job_id,
            attempt=attempt,
            team=team,
            decided_at=decided,
            from_ranks=from_ranks,
            # A resize always names its size; a row without one relaunched at the same.
            to_ranks=to_ranks if to_ranks is not None else from_ranks,
            grace_seconds=grace,
            seconds_to_free=(exited - decided).total_seconds() if exited is not None else None,
            lost_gpu_seconds=lost,
            cause=cause,
        )
        for job_id, attempt, team, decided, from_ranks, to_ranks, grace, exited, lost, cause in (
            reversed(rows)
        )
    ]
