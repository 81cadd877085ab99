"""Per-rank logs, read through the runtime that holds them."""

from __future__ import annotations

from django.core.exceptions import ValidationError

from preemption.models import Attempt, Job
from preemption.runtime import get_runtime
from preemption.runtimes.base import GangId

MAX_CHUNK = 1 << 20


def read_rank_log(
    *, job: Job, attempt: int | None, rank: int, offset: int = 0, limit: int = 65536
) -> tuple[bytes, int]:
    """A chunk of one rank's log from `offset`, and the offset to read on from."""
    attempts = Attempt.objects.filter(job=job)
    record = (
        attempts.filter(number=attempt).first()
        if attempt is not None
        else attempts.order_by("-number").first()
    )
    if record is None:
        raise ValidationError(
            {
                "attempt": [
                    f"Job {job.pk} has no attempt {attempt}."
                    if attempt
                    else f"Job {job.pk} has not started yet."
                ]
            }
        )
    if not 0 <= rank < job.ranks:
        raise ValidationError({"rank": [f"Must be between 0 and {job.ranks - 1} (got {rank})."]})
    if offset < 0:
        raise ValidationError({"offset": ["Must not be negative."]})
    limit = max(1, min(limit, MAX_CHUNK))
    chunk = get_runtime().read_log(GangId(job.pk, record.number), rank, offset, limit)
    return chunk, offset + len(chunk)
