"""The scheduling cycle: snapshot → `fairshare.plan` → one transaction that
records every decision → runtime actions after commit.

Two cycles never interleave: each takes a lock first, and one that finds
another cycle already waiting for the lock does nothing, since that one will
see everything committed before. On PostgreSQL it is an advisory lock held by
the cycle's one transaction, which blocks no other writer. On SQLite a transaction holds the database's only write lock from its
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
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

import fairshare
from core.rows import update_rows
from preemption.models import (
    WAITING_STATES,
    Attempt,
    Job,
    JobState,
    PreemptionEvent,
    Rank,
    attempt_ranks,
    next_attempt_numbers,
    running_ranks,
)
from preemption.reasons import Preemptor, preemption_words, release_words
from preemption.reconcile import launch_admitted, reconcile_jobs
from preemption.reconcile.steps import among
from preemption.snapshot import Shown, read_snapshot
from preemption.wakeup import take_cycle_request
from preemption.webhooks import Notice, notify_each

logger = logging.getLogger(__name__)

CYCLE_LOCK_KEY = 0x514D_4359  # "QMCY"
# Waiting reasons shared by at least this many jobs are written by one UPDATE
# each; ids go into each UPDATE by the thousand (SQLite takes 32,766 at most).
SHARED_REASON_JOBS = 8
WRITE_BATCH = 1000


@dataclass
class CycleResult:
    """What one cycle decided, by job id."""

    admitted: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    resized: list[int] = field(default_factory=list)
    waiting: int = 0
    skipped: bool = False


def _lock() -> bool:
    """Take PostgreSQL's cycle lock for this transaction; False, holding nothing, when
    another cycle holds it and a third already waits for it. That one starts after the
    running one ends, so it sees everything committed before this call, and a second
    waiter would only plan the same state again while a worker process sat blocked (in a
    run of Kueue's baseline, a fifth of the time). Two callers that look at once may
    both wait, as every caller did before: the check only spares the common case."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [CYCLE_LOCK_KEY])
        if cursor.fetchone()[0]:
            return True
        # A bigint advisory key is listed as classid (its high half), objid (its low
        # half) and objsubid 1.
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory'"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND classid = %s AND objid = %s AND objsubid = 1 AND NOT granted)",
            [CYCLE_LOCK_KEY >> 32, CYCLE_LOCK_KEY & 0xFFFF_FFFF],
        )
        if cursor.fetchone()[0]:
            return False
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
    # The snapshot's rows and the plan's objects are many and free of reference
    # cycles: see fairshare.collector_paused.
    if connection.vendor == "postgresql":
        with transaction.atomic():
            if not _lock():
                result.skipped = True
                return result
            take_cycle_request()
            now = now or timezone.now()
            with fairshare.collector_paused():
                snapshot, held, shown = read_snapshot(now=now)
                plan = fairshare.plan(snapshot)
                _apply(plan, now=now, result=result, held=held, shown=shown)
    else:
        with _file_lock() as mine:
            if not mine:
                result.skipped = True
                return result
            take_cycle_request()
            now = now or timezone.now()
            with fairshare.collector_paused():
                with _read_transaction():
                    snapshot, held, shown = read_snapshot(now=now)
                plan = fairshare.plan(snapshot)
                with transaction.atomic():
                    _apply(plan, now=now, result=result, held=held, shown=shown)
    if act and result.admitted:
        launch_admitted(result.admitted)
    if act and (result.preempted or result.resized):
        reconcile_jobs(job_ids=[*result.preempted, *result.resized])
    return result


def _apply(
    plan: fairshare.Plan,
    *,
    now: datetime,
    result: CycleResult,
    held: dict[int, str],
    shown: Shown,
) -> None:
    """Record the plan's decisions in a fixed number of queries, however many
    jobs it admits or preempts: on the embedded SQLite the cycle holds the
    database's only write lock meanwhile, and a query each would keep every
    submission waiting behind hundreds of them."""
    _admit(plan, now=now, result=result)
    _preempt(plan, now=now, result=result)
    _resize(plan, now=now, result=result)
    _store_waiting(plan, held, shown, now)
    result.waiting = len(plan.waiting) + len(held)


def _admit(plan: fairshare.Plan, *, now: datetime, result: CycleResult) -> None:
    """Admit each planned job still waiting: its state, its attempt and ranks.

    The rows are locked first, in the order of their ids (PostgreSQL;
    SQLite's write transaction holds the whole database), so a cancel
    committed since the snapshot wins and the job is left out, as the
    conditional update of one job at a time did."""
    admissions = {int(admission.id): admission for admission in plan.admit}
    if not admissions:
        return
    waiting = set(
        Job.objects.select_for_update(no_key=True)
        .filter(pk__in=among(admissions), state__in=[JobState.PENDING, JobState.REQUEUED])
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    admitted = [job_id for job_id in admissions if job_id in waiting]
    if not admitted:
        return
    # Admitted when written, not when the cycle began: a job committed while the
    # snapshot was read would otherwise be admitted before it was submitted.
    admitted_at = max(now, timezone.now())
    Job.objects.filter(pk__in=among(admitted)).update(
        state=JobState.ADMITTED, admitted_at=admitted_at, waiting_reason="", protected_until=None
    )
    numbers = next_attempt_numbers(admitted)
    attempts = Attempt.objects.bulk_create(
        Attempt(
            job_id=job_id,
            number=numbers[job_id],
            admitted_at=admitted_at,
            borrowed_gpus=admissions[job_id].borrowed,
            # The size the plan admitted it at: its own, or for an elastic job one of its sizes.
            ranks=admissions[job_id].ranks,
            # Recorded with the admission: launch_admitted carries it out right after
            # the commit, and any later pass does if that is cut short.
            action=Attempt.Action.LAUNCH,
            placement=[
                {"node": node, "ranks": count} for node, count in admissions[job_id].placement
            ],
        )
        for job_id in admitted
    )
    ranks = []
    for attempt in attempts:
        index = 0
        for node, count in admissions[attempt.job_id].placement:
            for _ in range(count):
                ranks.append(Rank(attempt=attempt, index=index, node=node))
                index += 1
    Rank.objects.bulk_create(ranks)
    result.admitted.extend(admitted)


def _preempt(plan: fairshare.Plan, *, now: datetime, result: CycleResult) -> None:
    """Start the graceful stop of each planned victim still admitted or running
    whose open attempt has no stop recorded yet: one preemption per attempt."""
    victims = {int(preemption.id): preemption for preemption in plan.preempt}
    if not victims:
        return
    # The open attempts and the jobs' facts as plain rows: the first cycle after a
    # restart preempts two thousand jobs, and building each attempt, victim and
    # preemptor (with its team and class) as model objects took a third of its writing.
    open_attempts: dict[int, int] = {}
    for attempt_id, job_id in (
        Attempt.objects.filter(job_id__in=among(victims), ended_at__isnull=True)
        .order_by("pk")
        .values_list("pk", "job_id")
    ):
        open_attempts.setdefault(job_id, attempt_id)
    stopping = set(
        PreemptionEvent.objects.filter(
            victim_attempt_id__in=among(open_attempts.values())
        ).values_list("victim_attempt_id", flat=True)
    )
    candidates = [
        job_id
        for job_id in victims
        if job_id in open_attempts and open_attempts[job_id] not in stopping
    ]
    running = set(
        Job.objects.select_for_update(no_key=True)
        .filter(pk__in=among(candidates), state__in=[JobState.ADMITTED, JobState.RUNNING])
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    preempted = [job_id for job_id in candidates if job_id in running]
    if not preempted:
        return
    Job.objects.filter(pk__in=among(preempted)).update(state=JobState.PREEMPTING, preempting_at=now)
    preemptor_ids = [
        int(victims[job_id].preemptor)
        for job_id in preempted
        if str(victims[job_id].preemptor).isdigit()
    ]
    # A victim holds its open attempt's ranks; an elastic preemptor preempts for its
    # smallest size (the engine's rule), a fixed one for all its ranks.
    jobs = {
        job_id: Preemptor(
            id=job_id,
            team=team,
            priority_class=class_name,
            gpus=(ranks_min if state in WAITING_STATES and ranks_min else ranks) * per_rank,
        )
        for job_id, team, class_name, ranks, ranks_min, state, per_rank in Job.objects.filter(
            pk__in=among([*preempted, *preemptor_ids])
        ).values_list(
            "pk",
            "team__slug",
            "priority_class__name",
            running_ranks(),
            "ranks_min",
            "state",
            "gpus_per_rank",
        )
    }
    events = []
    for job_id in preempted:
        preemption = victims[job_id]
        victim = jobs.get(job_id)
        preemptor = (
            jobs.get(int(preemption.preemptor)) if str(preemption.preemptor).isdigit() else None
        )
        grace = float(preemption.grace_seconds)
        events.append(
            PreemptionEvent(
                victim_attempt_id=open_attempts[job_id],
                job_id=job_id,
                preemptor_id=preemptor.id if preemptor is not None else None,
                reason=preemption.reason,
                cause=preemption_words(
                    reason=preemption.reason,
                    preemptor=preemptor,
                    victim_gpus=victim.gpus if victim else 0,
                ),
                decided_at=now,
                grace_seconds=grace,
                deadline=now + timedelta(seconds=grace),
            )
        )
    PreemptionEvent.objects.bulk_create(events)
    notify_each(
        [
            Notice(
                job_id=event.job_id,
                event="preempted",
                payload={"reason": event.reason, "cause": event.cause},
            )
            for event in events
        ]
    )
    result.preempted.extend(preempted)


def _resize(plan: fairshare.Plan, *, now: datetime, result: CycleResult) -> None:
    """Start the resize of each planned elastic gang still admitted or running whose
    open attempt has no stop recorded yet: a graceful stop of reason `resize` that
    carries the size and placement the job is relaunched at (see PreemptionEvent).

    It is stopped as a victim is, through the same reconcile steps (notice, signal,
    kill at the deadline), and relaunched by the finish step once every rank has
    exited; `preemptor` is the waiting job a shrink frees GPUs for, which waits for
    them as for a victim's."""
    resizes = {int(resize.workload): resize for resize in plan.resize}
    if not resizes:
        return
    attempts = {
        job_id: (attempt_id, borrowed, ranks)
        for attempt_id, job_id, borrowed, ranks in Attempt.objects.filter(
            job_id__in=among(resizes), ended_at__isnull=True, preemption__isnull=True
        ).values_list("pk", "job_id", "borrowed_gpus", attempt_ranks())
    }
    # Locked first, in the order of their ids, as `_preempt` locks its victims.
    running = list(
        Job.objects.select_for_update(no_key=True)
        .filter(pk__in=among(attempts), state__in=[JobState.ADMITTED, JobState.RUNNING])
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    if not running:
        return
    jobs = {
        job_id: (team, flavor, gpus_per_rank, grace)
        for job_id, team, flavor, gpus_per_rank, grace in Job.objects.filter(
            pk__in=among(running)
        ).values_list(
            "pk", "team__slug", "flavor__name", "gpus_per_rank", "priority_class__grace_seconds"
        )
    }
    Job.objects.filter(pk__in=among(jobs)).update(state=JobState.PREEMPTING, preempting_at=now)
    preemptors = set(
        Job.objects.filter(
            pk__in=[
                int(resize.for_workload)
                for resize in resizes.values()
                if resize.for_workload is not None and resize.for_workload.isdigit()
            ]
        ).values_list("pk", flat=True)
    )
    events = []
    for job_id, (team, flavor, gpus_per_rank, grace) in jobs.items():
        resize = resizes[job_id]
        attempt_id, borrowed, ranks = attempts[job_id]
        for_job = int(resize.for_workload) if resize.for_workload is not None else None
        events.append(
            PreemptionEvent(
                victim_attempt_id=attempt_id,
                job_id=job_id,
                preemptor_id=for_job if for_job in preemptors else None,
                reason=PreemptionEvent.Reason.RESIZE,
                cause=resize.reason[:300],
                decided_at=now,
                grace_seconds=float(grace),
                deadline=now + timedelta(seconds=float(grace)),
                resize_ranks=resize.ranks,
                resize_placement=[
                    {"node": node, "ranks": count} for node, count in resize.placement
                ],
                resize_borrowed_gpus=resized_borrowing(
                    borrowed=borrowed,
                    gpus_before=ranks * gpus_per_rank,
                    gpus_after=resize.ranks * gpus_per_rank,
                    queue_borrowed=_queue_borrowed(plan, team, flavor),
                ),
            )
        )
    PreemptionEvent.objects.bulk_create(events)
    notify_each(
        [
            Notice(
                job_id=event.job_id,
                event="resized",
                payload={
                    "stage": "decided",
                    "from_ranks": attempts[event.job_id][2],
                    "to_ranks": event.resize_ranks,
                    "cause": event.cause,
                },
            )
            for event in events
        ]
    )
    result.resized.extend(jobs)


def _queue_borrowed(plan: fairshare.Plan, team: str, flavor: str) -> int:
    status = plan.queues.get(team, {}).get(flavor)
    return status.borrowed if status is not None else 0


def resized_borrowing(
    *, borrowed: int, gpus_before: int, gpus_after: int, queue_borrowed: int
) -> int:
    """How many of a resized gang's GPUs are borrowed at its new size. A shrink gives
    back borrowed GPUs first (R3: what goes is what straddles the guarantee line); a
    grow borrows no more than it adds, nor more than its team borrows after the plan."""
    if gpus_after <= gpus_before:
        return max(0, borrowed - (gpus_before - gpus_after))
    return min(gpus_after, borrowed + (gpus_after - gpus_before), max(borrowed, queue_borrowed))


def _release_words(now: datetime) -> dict[int, str]:
    """What a job that waits for the victims it preempted to stop is told: when the
    last of them frees its GPUs at the latest, notice window included; by the
    preemptor's id.

    The preemptions still in flight are few (one per victim attempt still open), where
    the waiting jobs may be thousands: read those, not a list of every job. Read with
    only the columns the words need: a cycle after a large preemption has thousands in
    flight, and building each whole took a tenth of the cycle's writing."""
    events = (
        PreemptionEvent.objects.filter(
            victim_attempt__in=Attempt.objects.filter(ended_at__isnull=True).values("pk"),
            preemptor__isnull=False,
        )
        .exclude(reason=PreemptionEvent.Reason.MANUAL)
        .order_by("deadline")
        .only(*RELEASE_FIELDS)
    )
    last: dict[int, PreemptionEvent] = {}
    for event in events:
        assert event.preemptor_id is not None
        last[event.preemptor_id] = event
    return {job_id: release_words(event, now) for job_id, event in last.items()}


# The columns of a preemption `release_words` reads, and those that find it.
RELEASE_FIELDS = ("job_id", "preemptor_id", "deadline", "signal_sent_at", "notice_deadline")
# A waiting job's reason and until when its only victims are protected, as written.
Reason = tuple[str, datetime | None]


def _store_waiting(plan: fairshare.Plan, held: dict[int, str], shown: Shown, now: datetime) -> None:
    """Write each waiting job's reason, and until when its only victims are
    protected, where they differ from what the job showed when the snapshot read it
    (`shown`), and only while the job still waits: a cancel since then keeps its own.

    What the snapshot read stands for what the rows hold now: while a job waits, only
    cycles write its reason (a submission or a requeue writes one as the job starts
    waiting, and such a job is not in this plan), and this cycle holds the cycle
    lock. A job that left the waiting states since is skipped by the writes
    themselves, which test its state as they write."""
    release = _release_words(now)
    changed: dict[int, Reason] = {}
    # One pass over the waiting jobs, which a busy cycle has by the ten thousand.
    for waiting in plan.waiting:
        job_id = int(waiting.id)
        before = shown.get(job_id)
        if before is None:
            continue
        words = waiting.reason
        if job_id in release:
            words = f"{words}; {release[job_id]}"
        until = (
            None
            if waiting.protected_until is None
            else datetime.fromtimestamp(waiting.protected_until, UTC)
        )
        reason = (words[:300], until)
        if before != reason:
            changed[job_id] = reason
    for job_id, words in held.items():
        reason = (words[:300], None)
        if job_id in shown and shown[job_id] != reason:
            changed[job_id] = reason
    if not changed:
        return
    if connection.vendor == "postgresql":
        _write_reasons_at_once(changed)
        return
    _write_reasons_by_reason(changed)


def _write_reasons_at_once(changed: dict[int, Reason]) -> None:
    """Write the reasons in one statement on PostgreSQL, each distinct reason sent
    once: the job ids as one array, and beside each the number of its reason in a
    second array of the distinct reasons. Most waiting jobs share their reason with
    many others ("no node of flavor h100 has 1 free GPUs"): the first cycle after a
    restart writes some 50,000 reasons, of which 2,500 differ. An UPDATE per shared
    reason, its ids a thousand at a time, took 150 statements there, each with its
    thousand ids interpolated into its text by the driver and parsed again by the
    server; this sends the ids as one array literal, built by joining numbers."""
    numbers: dict[Reason, int] = {}
    ids, which = [], []
    for job_id, reason in changed.items():
        ids.append(str(job_id))
        which.append(str(numbers.setdefault(reason, len(numbers) + 1)))
    quote = connection.ops.quote_name
    table = quote(Job._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET {quote('waiting_reason')} = r.reason, "
            f"{quote('protected_until')} = r.until "
            "FROM unnest(%s::bigint[], %s::integer[]) AS v (id, n) "
            "JOIN unnest(%s::varchar[], %s::timestamptz[]) WITH ORDINALITY AS r (reason, until, n)"
            " ON r.n = v.n "
            f"WHERE {table}.{quote('id')} = v.id AND {table}.{quote('state')} = ANY(%s)",
            [
                "{" + ",".join(ids) + "}",
                "{" + ",".join(which) + "}",
                [reason for reason, _ in numbers],
                [until for _, until in numbers],
                [state.value for state in WAITING_STATES],
            ],
        )


def _write_reasons_by_reason(changed: dict[int, Reason]) -> None:
    """Write the reasons on SQLite: one UPDATE per reason shared by many jobs, which
    writes them far faster than a CASE over every row, and the rare ones in bulk."""
    by_reason: dict[Reason, list[int]] = defaultdict(list)
    for job_id, reason in changed.items():
        by_reason[reason].append(job_id)
    rare = []
    for (reason, until), job_ids in by_reason.items():
        if len(job_ids) < SHARED_REASON_JOBS:
            rare += [
                Job(pk=job_id, waiting_reason=reason, protected_until=until) for job_id in job_ids
            ]
            continue
        for start in range(0, len(job_ids), WRITE_BATCH):
            Job.objects.filter(
                pk__in=job_ids[start : start + WRITE_BATCH], state__in=WAITING_STATES
            ).update(waiting_reason=reason, protected_until=until)
    update_rows(rare, ["waiting_reason", "protected_until"], only={"state": WAITING_STATES})
