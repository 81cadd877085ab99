"""Events the trap reports, by POST while a rank runs or from its log after it
exits. Each is stored once (a hash of its JSON), then feeds ranks,
preemption events and checkpoints."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Max
from gracetrap_protocol import EVENT_NAMES

from preemption.models import Attempt, Checkpoint, Job, PreemptionEvent, Rank, TrapEvent

MAX_EVENT_BYTES = 8192


def _when(at: float) -> datetime:
    return datetime.fromtimestamp(at, tz=UTC)


def _int(event: dict[str, Any], name: str, *, required: bool = True) -> int | None:
    value = event.get(name)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value > 2**53:
        raise ValidationError({name: [f"Must be a non-negative whole number (got {value!r})."]})
    return value


def _validate(job: Job, event: Any) -> dict[str, Any]:
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
    _int(event, "attempt")
    _int(event, "rank")
    at = event.get("at")
    if isinstance(at, bool) or not isinstance(at, int | float) or not 0 < at < 1e11:
        raise ValidationError({"at": [f"Must be a Unix time in seconds (got {at!r})."]})
    for name in ("step", "bytes", "code"):
        if name in event and event[name] is not None and name != "code":
            _int(event, name)
    if "seconds" in event and event["seconds"] is not None:
        seconds = event["seconds"]
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or not 0 <= seconds < 1e7
        ):
            raise ValidationError(
                {"seconds": [f"Must be a duration in seconds (got {seconds!r})."]}
            )
    return event


def fingerprint(event: dict[str, Any]) -> str:
    return hashlib.sha256(
        json.dumps(event, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def ingest_trap_event(*, job: Job, event: Any, source: str) -> bool:
    """Store one trap event and apply it. Returns False for a duplicate."""
    event = _validate(job, event)
    try:
        with transaction.atomic():
            stored = TrapEvent.objects.create(
                job=job,
                attempt=event["attempt"],
                rank=event["rank"],
                event=event["event"],
                at=float(event["at"]),
                step=event.get("step") if isinstance(event.get("step"), int) else None,
                payload=event,
                fingerprint=fingerprint(event),
                source=source,
            )
            _apply(job, stored)
    except IntegrityError:
        return False
    return True


def _apply(job: Job, stored: TrapEvent) -> None:
    attempt = Attempt.objects.filter(job=job, number=stored.attempt).first()
    at = _when(stored.at)
    payload = stored.payload
    if stored.event == "signal_received" and attempt is not None:
        Rank.objects.filter(
            attempt=attempt, index=stored.rank, signal_received_at__isnull=True
        ).update(signal_received_at=at)
    elif stored.event == "checkpoint_committed" and stored.step is not None:
        Checkpoint.objects.get_or_create(
            job=job,
            attempt=attempt,
            step=stored.step,
            defaults={
                "path": str(payload.get("path") or f"{job.checkpoint_dir}/step_{stored.step}"),
                "bytes": int(payload.get("bytes") or 0),
                "seconds": float(payload.get("seconds") or 0.0),
                "committed_at": at,
            },
        )
        last = Checkpoint.objects.filter(job=job).aggregate(step=Max("step"))["step"]
        Job.objects.filter(pk=job.pk).update(resume_step=(last or 0) + 1)
        if attempt is not None:
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
