"""Observe: what a reconcile pass reads before it decides, and how what the
runtime observed is recorded on the ranks.

The open attempts are read as plain rows (`read_open_attempts`) and those the decide
step would not change are left alone (`steady`); `record_observations` and
`ObservedRanks` write what changed of each rank, one by one or together, and
`stuck_at_start` says why a rank that cannot start must fail. Used by the pass
and the decide step; it decides nothing itself and calls no runtime.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db.models import Q

from core.rows import update_rows
from preemption.models import ACTIVE_STATES, Attempt, JobState, Rank
from preemption.reconcile.steps import TERMINAL_PHASES
from preemption.runtimes.base import STUCK_REASONS, RankObservation

RANK_STATES = frozenset(Rank.State.values)
# Django builds a choices enum's `values` as a new list at each read: a pass compares
# every rank it observes against them.
END_REASONS = frozenset(Rank.EndReason.values)


def _when(at: float | None) -> datetime | None:
    return datetime.fromtimestamp(at, tz=UTC) if at is not None else None


def stuck_at_start(attempt: Attempt, observations: list[RankObservation], now: datetime) -> str:
    """Why the attempt must fail: a rank waiting on something that will not come
    (an image it cannot pull, a node that cannot take it) past the start timeout."""
    if attempt.launched_at is None:
        return ""
    waited = (now - attempt.launched_at).total_seconds()
    if waited < settings.QM_START_TIMEOUT_SECONDS:
        return ""
    for obs in sorted(observations, key=lambda o: o.rank):
        if obs.phase == "starting" and obs.waiting_reason in STUCK_REASONS:
            return (
                f"rank {obs.rank} could not start: {obs.waiting_reason} for over "
                f"{settings.QM_START_TIMEOUT_SECONDS:g} s"
            )
    return ""


def record_observations(ranks: dict[int, Rank], observations: list[RankObservation]) -> None:
    """Write what changed, and only that."""
    for obs in observations:
        rank = ranks.get(obs.rank)
        if rank is None:
            continue
        changes = _rank_changes(rank, obs)
        if changes:
            for name, value in changes.items():
                setattr(rank, name, value)
            rank.save(update_fields=list(changes))


def _rank_changes(rank: Rank | RankRow, obs: RankObservation) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    state = obs.phase if obs.phase in RANK_STATES else "lost"
    if rank.state != state and rank.state not in TERMINAL_PHASES:
        changes["state"] = state
    if obs.exit_code is not None and rank.exit_code != obs.exit_code:
        changes["exit_code"] = obs.exit_code
    if obs.handle:
        if obs.handle.isdigit():
            if rank.pid != int(obs.handle):
                changes["pid"] = int(obs.handle)
        elif rank.pod_name != obs.handle:
            changes["pod_name"] = obs.handle
    if obs.started_at is not None and rank.started_at is None:
        changes["started_at"] = _when(obs.started_at)
    if obs.exited_at is not None and rank.exited_at is None:
        changes["exited_at"] = _when(obs.exited_at)
    if obs.signal_sent_at is not None and rank.signal_sent_at is None:
        changes["signal_sent_at"] = _when(obs.signal_sent_at)
    if obs.end_reason in END_REASONS and rank.end_reason != obs.end_reason:
        changes["end_reason"] = obs.end_reason
        changes["memory_limit"] = obs.memory_limit
    return changes


@dataclass(frozen=True, slots=True)
class RankRow:
    """What a pass compares of a rank with the runtime's observation of it."""

    state: str
    exit_code: int | None
    pid: int | None
    pod_name: str
    started_at: datetime | None
    exited_at: datetime | None
    signal_sent_at: datetime | None
    end_reason: str
    memory_limit: int | None


@dataclass(slots=True)
class OpenAttempt:
    """What a pass needs of an open attempt to tell whether it is steady."""

    pk: int
    job_id: int
    number: int
    launched: bool
    action: str
    job_state: str
    stopping: bool
    ranks: dict[int, RankRow] = field(default_factory=dict)


def read_open_attempts(job_ids: list[int] | None) -> list[OpenAttempt]:
    """The open attempts of active jobs (of `job_ids` only, if given), read as
    plain rows: most are steady on most passes, and a pass four times a second
    over a few hundred running jobs spent most of its time building their
    attempts, jobs, teams and ranks as model objects. Those it must decide on
    are read again, whole, after this read (`_reconcile`)."""
    attempts = Attempt.objects.filter(ended_at__isnull=True, job__state__in=ACTIVE_STATES)
    if job_ids is not None:
        attempts = attempts.filter(job_id__in=job_ids)
    rows = {
        pk: OpenAttempt(pk, job_id, number, launched, action, job_state, stopping)
        for pk, job_id, number, launched, action, job_state, stopping in attempts.values_list(
            "pk",
            "job_id",
            "number",
            Q(launched_at__isnull=False),
            "action",
            "job__state",
            Q(preemption__isnull=False),
        )
    }
    if not rows:
        return []
    ranks = Rank.objects.filter(attempt__in=attempts).values_list(
        "attempt_id", "index", *(f.name for f in dataclasses.fields(RankRow))
    )
    for attempt_id, index, *fields in ranks:
        row = rows.get(attempt_id)
        if row is not None:
            row.ranks[index] = RankRow(*fields)
    return sorted(rows.values(), key=lambda row: (row.job_id, row.pk))


def steady(row: OpenAttempt, observations: list[RankObservation], taken: bool) -> bool:
    """True when the decide step would change nothing: a launched gang of a
    running job, no stop asked, every rank running as last recorded. Most open
    attempts are so on most passes, and on SQLite each decide transaction
    takes the database's write lock, so these skip it."""
    if taken or not row.launched or row.action or row.job_state != JobState.RUNNING or row.stopping:
        return False
    ranks = row.ranks
    return len(observations) == len(ranks) and all(
        obs.phase == "running" and obs.rank in ranks and not _rank_changes(ranks[obs.rank], obs)
        for obs in observations
    )


class ObservedRanks:
    """The ranks whose recorded state an observation changed, as copies with the
    changes applied, written together in one statement (`write`). The copies leave
    the ranks read under lock as the database has them, so that the one-by-one
    decisions after a failed batch still see them so."""

    def __init__(self) -> None:
        self.ranks: list[Rank] = []
        self.fields: set[str] = set()

    def add(self, ranks: dict[int, Rank], observations: list[RankObservation]) -> dict[int, str]:
        """Take the changes `observations` make to `ranks`; each rank's state after them."""
        states = {index: rank.state for index, rank in ranks.items()}
        for obs in observations:
            changes = _rank_changes(ranks[obs.rank], obs)
            if changes:
                rank = _copied(ranks[obs.rank])
                for name, value in changes.items():
                    setattr(rank, name, value)
                self.ranks.append(rank)
                self.fields.update(changes)
                states[obs.rank] = rank.state
        return states

    def extend(self, other: ObservedRanks) -> None:
        self.ranks += other.ranks
        self.fields |= other.fields

    def write(self) -> None:
        if self.ranks:
            update_rows(self.ranks, sorted(self.fields))


def _copied(rank: Rank) -> Rank:
    """A copy of the rank, as `copy.copy` makes it (its fields, and its state with a
    cache of its own), without the pickling protocol `copy.copy` goes through for a
    model object, which cost a pass that saw two thousand gangs start 50 ms."""
    copied = Rank.__new__(Rank)
    copied.__dict__.update(rank.__dict__)
    state = copied._state = copy.copy(rank._state)
    state.fields_cache = dict(rank._state.fields_cache)
    return copied
