"""Events the trap reports, by POST while a rank runs or from its log after it
exits. Each is stored once, then feeds ranks, preemption events and checkpoints.

Whoever holds a rank's token or writes its log controls what arrives here, so
nothing in an event is taken on trust:

* it must belong to the attempt it is ingested for, which must still be open,
  and name a rank of that attempt (0..its ranks-1);
* its time is clamped to the server's clock: never later than now, never
  before the attempt was admitted;
* a committed step is bounded, and may not run further ahead of the job's last
  committed step than the attempt could have trained (QM_TRAP_MAX_STEPS_PER_SECOND);
* a checkpoint's path is the server's own (`<checkpoint_dir>/step_<N>.attempt_<A>`,
  the folder the trap of attempt A saves step N to, gracetrap's `step_dir`); the
  client's path is ignored;
* the duplicate key is (job, attempt, rank, event, step), so the same event
  arriving by POST and from the log is stored once, and changing `at` or any
  free-form field makes no new event;
* each rank of an attempt may store at most QM_TRAP_EVENTS_PER_RANK events;
* only the known fields are stored.

A refused event raises and changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from datetime import UTC, datetime
from functools import partial
from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import OperationalError, connection, transaction
from django.db.models import Max
from django.utils import timezone
from gracetrap_protocol import EVENT_NAMES

from preemption.models import Attempt, Checkpoint, Job, PreemptionEvent, Rank, TrapEvent
from preemption.notice import record_notice_commit
from preemption.runtime import checkpoint_is_durable
from preemption.wakeup import send_reconcile

MAX_EVENT_BYTES = 8192
# Steps are stored in 32-bit columns and resume_step is the step after the last
# checkpoint, so the last step that can be recorded is one below the column's top.
MAX_STEP = 2**31 - 2
MAX_BYTES = 2**53
MAX_REASON_CHARS = 300
SIGNAL_NAME = re.compile(r"SIG[A-Z0-9+]{1,12}")


class EventLimitReached(Exception):
    """A rank of an attempt has reported as many events as it may."""


class IngestBusy(Exception):
    """The events could not be stored now (a lock held too long, a conflict that
    persisted); nothing was stored and the same request may be sent again."""


# PostgreSQL's deadlock and serialization failures: the transaction lost a race and
# may simply run again. A lock wait past lock_timeout (55P03) is not run again: the
# row is busy, and the request is answered at once.
RETRIED_SQLSTATES = {"40P01", "40001"}
BUSY_SQLSTATES = {"55P03"}
INGEST_TRIES = 3


# The events whose `_apply` writes the job's own row.
JOB_WRITING_EVENTS = frozenset({"checkpoint_committed"})

CADENCE_FIELDS = ("mtbp_seconds", "save_cost", "interval_seconds")
# Longer than any hint a scheduler gives (the control plane's longest is 30 days).
MAX_CADENCE_SECONDS = 1e9


def _int(event: dict[str, Any], name: str, *, low: int = 0, high: int = 2**53) -> int:
    value = event.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValidationError(
            {name: [f"Must be a whole number from {low} to {high} (got {value!r})."]}
        )
    return value


def _validate(job: Job, event: Any) -> dict[str, Any]:
    """The event's known fields, checked for shape; everything else is dropped."""
    if not isinstance(event, dict):
        raise ValidationError({"event": ["The body must be a JSON object."]})
    if len(json.dumps(event, default=str)) > MAX_EVENT_BYTES:
        raise ValidationError(
            {"event": [f"An event must be at most {MAX_EVENT_BYTES} bytes of JSON."]}
        )
    name = event.get("event")
    if name not in EVENT_NAMES:
        raise ValidationError(
            {"event": [f"Must be one of {', '.join(sorted(EVENT_NAMES))} (got {name!r})."]}
        )
    if "job_id" in event and str(event["job_id"]) != str(job.pk):
        raise ValidationError({"job_id": [f"This endpoint takes events of job {job.pk} only."]})
    clean: dict[str, Any] = {
        "event": name,
        "job_id": job.pk,
        "attempt": _int(event, "attempt"),
        "rank": _int(event, "rank"),
    }
    at = event.get("at")
    if isinstance(at, bool) or not isinstance(at, int | float) or not 0 < at < 1e11:
        raise ValidationError({"at": [f"Must be a Unix time in seconds (got {at!r})."]})
    clean["at"] = float(at)
    if event.get("step") is not None:
        clean["step"] = _int(event, "step", high=MAX_STEP)
    elif name in ("checkpoint_committed", "checkpoint_started", "resumed"):
        raise ValidationError({"step": [f"A {name} event needs the step."]})
    if event.get("bytes") is not None:
        clean["bytes"] = _int(event, "bytes", high=MAX_BYTES)
    if event.get("code") is not None:
        clean["code"] = _int(event, "code", low=-(2**31), high=2**31 - 1)
    if event.get("seconds") is not None:
        seconds = event["seconds"]
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or not 0 <= seconds < 1e7
        ):
            raise ValidationError(
                {"seconds": [f"Must be a duration in seconds (got {seconds!r})."]}
            )
        clean["seconds"] = float(seconds)
    # The cadence the trap chose (a `cadence` event): kept for the job page.
    for field in CADENCE_FIELDS:
        if event.get(field) is not None:
            value = event[field]
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not 0 <= value < MAX_CADENCE_SECONDS
            ):
                raise ValidationError({field: [f"Must be a duration in seconds (got {value!r})."]})
            clean[field] = float(value)
    if event.get("reason") is not None:
        if not isinstance(event["reason"], str):
            raise ValidationError({"reason": ["Must be text."]})
        clean["reason"] = event["reason"][:MAX_REASON_CHARS]
    if name == "trap_ready":
        # What the trap speaks decides whether its ranks are sent a checkpoint notice.
        notice_signal = event.get("notice_signal")
        if notice_signal is not None:
            if not isinstance(notice_signal, str) or not SIGNAL_NAME.fullmatch(notice_signal):
                raise ValidationError(
                    {"notice_signal": [f"Must be a signal's name or null (got {notice_signal!r})."]}
                )
            clean["notice_signal"] = notice_signal
        clean["notice_poll"] = event.get("notice_poll") is True
    if name == "checkpoint_committed":
        clean["notice"] = event.get("notice") is True
        clean["background"] = event.get("background") is True
        stall = event.get("stall")
        if stall is not None:
            if (
                isinstance(stall, bool)
                or not isinstance(stall, int | float)
                or not 0 <= stall < 1e7
            ):
                raise ValidationError(
                    {"stall": [f"Must be a duration in seconds (got {stall!r})."]}
                )
            clean["stall"] = float(stall)
    return clean


def fingerprint(event: dict[str, Any]) -> str:
    """The duplicate key of an event: job, attempt, rank, name and step. A rank
    reports each event once per step of an attempt, so nothing else (not the
    float `at`, not a free-form field) can make a second copy count as new."""
    key = [event.get(name) for name in ("job_id", "attempt", "rank", "event", "step")]
    return hashlib.sha256(json.dumps([str(part) for part in key]).encode()).hexdigest()


def _clamp(at: float, attempt: Attempt) -> float:
    """The event's time on the server's clock: a rank's clock may be off, and a
    forged one may say anything, so it is held between the attempt's admission
    and now."""
    return min(max(at, attempt.admitted_at.timestamp()), timezone.now().timestamp())


def _check_step(job: Job, attempt: Attempt, step: int) -> None:
    """A committed step may run ahead of the job's last checkpoint only as far
    as the attempt could have trained since it was admitted."""
    last = Checkpoint.objects.filter(job=job).aggregate(step=Max("step"))["step"]
    base = last if last is not None else max((job.resume_step or 1) - 1, 0)
    elapsed = max(0.0, (timezone.now() - attempt.admitted_at).total_seconds())
    rate = settings.QM_TRAP_MAX_STEPS_PER_SECOND
    allowed = base + int(rate * (elapsed + 1))
    if step > allowed:
        raise ValidationError(
            {
                "step": [
                    f"Step {step} is too far ahead: the job's last checkpoint is at step {base}, "
                    f"and in {elapsed:.0f} s this attempt can reach at most step {allowed} "
                    f"({rate:g} steps a second)."
                ]
            }
        )


def ingest_trap_event(*, attempt: Attempt, event: Any, source: str) -> bool:
    """Store one trap event of `attempt` and apply it. Returns False for a
    duplicate. Raises ValidationError (bad event), PermissionDenied (the
    attempt has ended) or EventLimitReached; then nothing has changed."""
    return _ingest_event(attempt=attempt, event=event, source=source, job_locked=False)


def _ingest_event(*, attempt: Attempt, event: Any, source: str, job_locked: bool) -> bool:
    """`ingest_trap_event`; `job_locked` when the caller's transaction already
    holds the job's row (a batch locks it once for all its events)."""
    job = attempt.job
    clean = _validate(job, event)
    if clean["attempt"] != attempt.number:
        raise ValidationError(
            {
                "attempt": [
                    f"This token is for attempt {attempt.number} of job {job.pk}, "
                    f"not attempt {clean['attempt']}."
                ]
            }
        )
    # The attempt's own ranks: an elastic job may run at fewer than it asks for.
    size = attempt.world_size
    if clean["rank"] >= size:
        raise ValidationError(
            {"rank": [f"Job {job.pk} has ranks 0 to {size - 1} (got {clean['rank']})."]}
        )
    with transaction.atomic():
        if not job_locked:
            _lock_job_first(job, [clean])
        # The rank's row serialises its events, so the cap and the step checks
        # see every event stored before this one.
        rank = Rank.objects.select_for_update().filter(attempt=attempt, index=clean["rank"]).first()
        if rank is None:
            raise ValidationError(
                {"rank": [f"Attempt {attempt.number} has no rank {clean['rank']}."]}
            )
        if Attempt.objects.filter(pk=attempt.pk, ended_at__isnull=False).exists():
            raise PermissionDenied(
                f"Attempt {attempt.number} of job {job.pk} has ended; it takes no more events."
            )
        key = fingerprint(clean)
        if TrapEvent.objects.filter(fingerprint=key).exists():
            return False
        cap = settings.QM_TRAP_EVENTS_PER_RANK
        stored_so_far = TrapEvent.objects.filter(
            job=job, attempt=attempt.number, rank=clean["rank"]
        ).count()
        if stored_so_far >= cap:
            raise EventLimitReached(
                f"Rank {clean['rank']} of attempt {attempt.number} has already reported "
                f"{stored_so_far} events, the most one rank may (QM_TRAP_EVENTS_PER_RANK)."
            )
        if clean["event"] == "checkpoint_committed":
            _check_step(job, attempt, clean["step"])
        clean["at"] = _clamp(clean["at"], attempt)
        stored = TrapEvent.objects.create(
            job=job,
            attempt=attempt.number,
            rank=clean["rank"],
            event=clean["event"],
            at=clean["at"],
            step=clean.get("step"),
            payload=clean,
            fingerprint=key,
            source=source,
        )
        _apply(job, attempt, stored)
    return True


def ingest_trap_events(*, attempt: Attempt, events: list[Any], source: str) -> tuple[int, int]:
    """Ingest a batch all or nothing: one refused event leaves every other
    unstored too. Returns (accepted, duplicates).

    A deadlock or serialization failure runs the batch again (at most
    INGEST_TRIES times); a row held past QM_TRAP_EVENT_LOCK_TIMEOUT_SECONDS, or a
    conflict that persists, raises IngestBusy with nothing stored.
    """
    for tries in range(1, INGEST_TRIES + 1):
        try:
            return _ingest_once(attempt=attempt, events=events, source=source)
        except OperationalError as error:
            state = sqlstate(error)
            if state in RETRIED_SQLSTATES and tries < INGEST_TRIES and not _in_transaction():
                time.sleep(0.02 * tries)
                continue
            if state in RETRIED_SQLSTATES | BUSY_SQLSTATES or _sqlite_busy(error):
                raise IngestBusy(
                    "The events could not be stored now (the job's rows are busy); "
                    "nothing was stored, send them again."
                ) from error
            raise
    raise AssertionError("unreachable")


def _ingest_once(*, attempt: Attempt, events: list[Any], source: str) -> tuple[int, int]:
    accepted = duplicates = 0
    with transaction.atomic():
        if connection.vendor == "postgresql":
            timeout_ms = max(1, round(settings.QM_TRAP_EVENT_LOCK_TIMEOUT_SECONDS * 1000))
            with connection.cursor() as cursor:
                cursor.execute(f"SET LOCAL lock_timeout = {timeout_ms}")
        _lock_job_first(attempt.job, events)
        for event in events:
            if _ingest_event(attempt=attempt, event=event, source=source, job_locked=True):
                accepted += 1
            else:
                duplicates += 1
    return accepted, duplicates


def _lock_job_first(job: Job, events: list[Any]) -> None:
    """Lock the job's row before any rank's when the events will update it.

    A checkpoint updates the job's `resume_step`. Reconcile's decide step and the
    scheduling cycle lock a job before anything of its own, so a transaction that
    held a rank and then waited for its job could meet a reconcile pass holding the
    job and waiting for that rank: a deadlock the database breaks by undoing one of
    them. Taken here first, the job's row (FOR NO KEY UPDATE, as reconcile takes it)
    makes both wait in the same order. Events that only touch their rank and the
    stops lock no job row, so a gang's ranks still report side by side."""
    if any(
        isinstance(event, dict) and event.get("event") in JOB_WRITING_EVENTS for event in events
    ):
        list(Job.objects.select_for_update(no_key=True).filter(pk=job.pk).values_list("pk"))


def sqlstate(error: BaseException) -> str | None:
    """The SQLSTATE code of a database error Django wrapped, None when it has none."""
    cause = error.__cause__
    state = getattr(cause, "sqlstate", None)
    return state if isinstance(state, str) else None


def _sqlite_busy(error: BaseException) -> bool:
    return connection.vendor == "sqlite" and "locked" in str(error)


def _in_transaction() -> bool:
    """An outer transaction is aborted by the failure: running again inside it fails too."""
    return connection.in_atomic_block


def _evict_once_answered(attempt_id: int) -> None:
    """After a notice's commit is stored: the eviction is due now (one rank's commit
    is the gang's, see `notice_committed_at`), not at the next periodic reconcile
    pass. Asked once the storing transaction has committed, so that the pass it
    wakes sees the commit; of the ranks' concurrent answers, the one that records
    the commit on the preemption asks."""
    event = PreemptionEvent.objects.filter(
        victim_attempt_id=attempt_id,
        notice_sent_at__isnull=False,
        notice_committed_at__isnull=True,
        signal_sent_at__isnull=True,
    ).first()
    if event is None or event.notice_sent_at is None:
        return
    # Recording the commit claims the request: one pass for the gang, not one per rank.
    if record_notice_commit(event, event.victim_attempt):
        send_reconcile(job_ids=[event.job_id])


def _apply(job: Job, attempt: Attempt, stored: TrapEvent) -> None:
    at = datetime.fromtimestamp(stored.at, tz=UTC)
    payload = stored.payload
    if stored.event == "signal_received":
        Rank.objects.filter(
            attempt=attempt, index=stored.rank, signal_received_at__isnull=True
        ).update(signal_received_at=at)
    elif stored.event == "checkpoint_committed" and stored.step is not None:
        if payload.get("notice"):
            transaction.on_commit(partial(_evict_once_answered, attempt.pk))
        # The folder the trap saves this step to; what the client names is
        # never recorded as a checkpoint's path.
        path = (
            f"{job.checkpoint_dir}/step_{stored.step}.attempt_{attempt.number}"
            if job.checkpoint_dir
            else ""
        )
        if not checkpoint_is_durable(path):
            # Written where the next attempt cannot find it (a pod's own
            # filesystem): kept as a trap event, never offered for resume.
            return
        Checkpoint.objects.get_or_create(
            job=job,
            attempt=attempt,
            step=stored.step,
            defaults={
                "path": path,
                "bytes": int(payload.get("bytes") or 0),
                "seconds": float(payload.get("seconds") or 0.0),
                "committed_at": at,
            },
        )
        last = Checkpoint.objects.filter(job=job).aggregate(step=Max("step"))["step"]
        Job.objects.filter(pk=job.pk).update(resume_step=(last or 0) + 1)
        PreemptionEvent.objects.filter(victim_attempt=attempt, decided_at__lte=at).update(
            checkpoint_step=stored.step,
            checkpoint_bytes=int(payload.get("bytes") or 0),
            checkpoint_seconds=float(payload.get("seconds") or 0.0),
        )
    elif stored.event == "resumed":
        # The resume closes the story of the preemption that requeued the job.
        PreemptionEvent.objects.filter(
            job=job, resumed_at__isnull=True, victim_attempt__number__lt=stored.attempt
        ).update(resumed_at=at)
