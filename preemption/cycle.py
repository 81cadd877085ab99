"""The scheduling cycle: snapshot → `fairshare.plan` → one transaction that
records every decision → runtime actions after commit.

Two cycles never interleave: each takes a lock first. On PostgreSQL it is an
advisory lock held by the cycle's one transaction, which blocks no other
writer. On SQLite a transaction holds the database's only write lock from its
start, so there the lock is a file lock next to the database, the snapshot and
the plan are made outside any write transaction, and only the recording of
the decisions takes the write lock: job submissions no longer wait for a whole
plan. Each write is also conditional on the state the plan saw, so even a
stale plan cannot admit a job twice or pick a second victim for the same
attempt.
"""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

import fairshare
from preemption.models import (
    Attempt,
    Job,
    JobState,
    PreemptionEvent,
    Rank,
    next_attempt_number,
)
from preemption.reasons import Preemptor, preemption_words, release_words
from preemption.reconcile import reconcile_jobs
from preemption.snapshot import build_snapshot, held_jobs
from preemption.wakeup import take_cycle_request
from preemption.webhooks import notify

logger = logging.getLogger(__name__)

CYCLE_LOCK_KEY = 0x514D_4359  # "QMCY"


@dataclass
class CycleResult:
    """What one cycle decided, by job id."""

    admitted: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    waiting: int = 0
    skipped: bool = False


def _lock() -> bool:
    if connection.vendor != "postgresql":
        return True
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [CYCLE_LOCK_KEY])
    return True


@contextmanager
def _file_lock() -> Iterator[bool]:
    """Serialize the cycles of every process using this installation's SQLite database.

    Yields False, holding nothing, when another cycle already waits for the lock:
    that one starts after the running one ends, so it sees everything committed
    before this call, and a second waiter would only plan the same state again.
    Every submission asks for a cycle; in a burst they would otherwise queue up
    behind each other in the worker pool."""
    folder = Path(settings.VAR_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    with (
        open(folder / "cycle.wait.lock", "a") as waiting,
        open(folder / "cycle.lock", "a") as cycle,
    ):
        try:
            fcntl.flock(waiting, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            fcntl.flock(cycle, fcntl.LOCK_EX)
        finally:
            fcntl.flock(waiting, fcntl.LOCK_UN)
        try:
            yield True
        finally:
            fcntl.flock(cycle, fcntl.LOCK_UN)


@contextmanager
def _read_transaction() -> Iterator[None]:
    """One consistent view for the snapshot's queries on SQLite: a deferred
    transaction that only reads takes no write lock, and in WAL mode no writer
    waits for it. Inside a caller's transaction the view is that one's."""
    if connection.in_atomic_block:
        yield
        return
    with connection.cursor() as cursor:
        cursor.execute("BEGIN DEFERRED")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("COMMIT")


def schedule_cycle(*, now: datetime | None = None, act: bool = True) -> CycleResult:
    """Plan every pending job at once and record the decisions."""
    result = CycleResult()
    if connection.vendor == "postgresql":
        with transaction.atomic():
            _lock()
            take_cycle_request()
            now = now or timezone.now()
            held = held_jobs()
            plan = fairshare.plan(build_snapshot(now=now, held=held))
            _apply(plan, now=now, result=result, held=held)
    else:
        with _file_lock() as mine:
            if not mine:
                result.skipped = True
                return result
            take_cycle_request()
            now = now or timezone.now()
            with _read_transaction():
                held = held_jobs()
                snapshot = build_snapshot(now=now, held=held)
            plan = fairshare.plan(snapshot)
            with transaction.atomic():
                _apply(plan, now=now, result=result, held=held)
    if act and (result.admitted or result.preempted):
        reconcile_jobs(job_ids=result.admitted + result.preempted)
    return result


def _apply(
    plan: fairshare.Plan, *, now: datetime, result: CycleResult, held: dict[int, str]
) -> None:
    admit_ids = [int(a.id) for a in plan.admit]
    preempt_ids = [int(p.id) for p in plan.preempt]
    jobs = Job.objects.select_related("team", "priority_class").in_bulk(
        admit_ids
        + preempt_ids
        + [int(p.preemptor) for p in plan.preempt if p.preemptor and str(p.preemptor).isdigit()]
    )
    for admission in plan.admit:
        job_id = int(admission.id)
        claimed = Job.objects.filter(
            pk=job_id, state__in=[JobState.PENDING, JobState.REQUEUED]
        ).update(state=JobState.ADMITTED, admitted_at=now, waiting_reason="")
        if claimed != 1:
            continue
        attempt = Attempt.objects.create(
            job_id=job_id,
            number=next_attempt_number(job_id),
            admitted_at=now,
            borrowed_gpus=admission.borrowed,
            placement=[{"node": node, "ranks": count} for node, count in admission.placement],
        )
        ranks = []
        index = 0
        for node, count in admission.placement:
            for _ in range(count):
                ranks.append(Rank(attempt=attempt, index=index, node=node))
                index += 1
        Rank.objects.bulk_create(ranks)
        result.admitted.append(job_id)
    for preemption in plan.preempt:
        victim_id = int(preemption.id)
        attempt = Attempt.objects.filter(job_id=victim_id, ended_at__isnull=True).first()
        if attempt is None or PreemptionEvent.objects.filter(victim_attempt=attempt).exists():
            continue
        claimed = Job.objects.filter(
            pk=victim_id, state__in=[JobState.ADMITTED, JobState.RUNNING]
        ).update(state=JobState.PREEMPTING, preempting_at=now)
        if claimed != 1:
            continue
        victim = jobs.get(victim_id)
        preemptor = (
            jobs.get(int(preemption.preemptor)) if str(preemption.preemptor).isdigit() else None
        )
        grace = float(preemption.grace_seconds)
        event = PreemptionEvent.objects.create(
            victim_attempt=attempt,
            job_id=victim_id,
            preemptor=preemptor,
            reason=preemption.reason,
            cause=preemption_words(
                reason=preemption.reason,
                preemptor=Preemptor.of(preemptor) if preemptor is not None else None,
                victim_gpus=victim.gpus if victim else 0,
            ),
            decided_at=now,
            grace_seconds=grace,
            deadline=now + timedelta(seconds=grace),
        )
        notify(
            job_id=victim_id,
            event="preempted",
            payload={"reason": event.reason, "cause": event.cause},
        )
        result.preempted.append(victim_id)
    _store_waiting(plan, held, now)
    result.waiting = len(plan.waiting) + len(held)


def _add_release_times(reasons: dict[int, str], now: datetime) -> None:
    """A job that waits for the victims it preempted to stop is told when the
    last of them frees its GPUs at the latest, notice window included."""
    events = (
        PreemptionEvent.objects.filter(
            preemptor_id__in=list(reasons), victim_attempt__ended_at__isnull=True
        )
        .exclude(reason=PreemptionEvent.Reason.MANUAL)
        .order_by("deadline")
    )
    last: dict[int, PreemptionEvent] = {}
    for event in events:
        if event.preemptor_id is not None:
            last[event.preemptor_id] = event
    for job_id, event in last.items():
        reasons[job_id] = f"{reasons[job_id]}; {release_words(event, now)}"


def _store_waiting(plan: fairshare.Plan, held: dict[int, str], now: datetime) -> None:
    """Write each waiting job's reason, only where it changed."""
    reasons = {int(w.id): w.reason for w in plan.waiting}
    _add_release_times(reasons, now)
    reasons = {job_id: reason[:300] for job_id, reason in reasons.items()}
    reasons.update({job_id: reason[:300] for job_id, reason in held.items()})
    if not reasons:
        return
    current = dict(Job.objects.filter(pk__in=reasons).values_list("id", "waiting_reason"))
    changed = [job_id for job_id, reason in reasons.items() if current.get(job_id) != reason]
    if not changed:
        return
    rows = [Job(pk=job_id, waiting_reason=reasons[job_id]) for job_id in changed]
    Job.objects.bulk_update(rows, ["waiting_reason"], batch_size=500)
