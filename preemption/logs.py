"""Per-rank logs, read through the runtime that holds them, or from the tail
saved when the attempt ended where the runtime forgets logs with its pods."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from django.conf import settings
from django.core.exceptions import ValidationError

from preemption.models import Attempt, Job, Rank, RankLogTail
from preemption.runtime import get_runtime
from preemption.runtimes.base import GangId, Runtime, RuntimePermanentError, RuntimeTemporaryError

logger = logging.getLogger(__name__)

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
    # The attempt's own ranks: an elastic job may have run at fewer than it asks for.
    size = record.world_size
    if not 0 <= rank < size:
        raise ValidationError({"rank": [f"Must be between 0 and {size - 1} (got {rank})."]})
    if offset < 0:
        raise ValidationError({"offset": ["Must not be negative."]})
    limit = max(1, min(limit, MAX_CHUNK))
    saved = RankLogTail.objects.filter(attempt=record, rank=rank).first()
    if saved is not None:
        content = bytes(saved.content)
        start = max(offset, saved.first_byte)
        chunk = content[start - saved.first_byte : start - saved.first_byte + limit]
        if offset < saved.first_byte:
            note = f"[the first {saved.first_byte} bytes of this log were not kept]\n".encode()
            return note + chunk, start + len(chunk)
        return chunk, start + len(chunk)
    chunk = get_runtime().read_log(GangId(job.pk, record.number), rank, offset, limit)
    return chunk, offset + len(chunk)


def save_log_tails(attempt: Attempt, ranks: Iterable[Rank], runtime: Runtime) -> int:
    """Keep the last QM_LOG_TAIL_BYTES of each rank's log before the runtime forgets it.

    Only runtimes whose logs vanish with their gangs offer ``read_log_tail``.
    Returns how many tails were saved.
    """
    read_tail = getattr(runtime, "read_log_tail", None)
    if read_tail is None:
        return 0
    gang = GangId(attempt.job_id, attempt.number)
    saved = 0
    for rank in ranks:
        try:
            content, first_byte = read_tail(gang, rank.index, settings.QM_LOG_TAIL_BYTES)
        except (RuntimeTemporaryError, RuntimePermanentError, OSError):
            logger.warning("could not save the log of %s", rank, exc_info=True)
            continue
        RankLogTail.objects.update_or_create(
            attempt=attempt,
            rank=rank.index,
            defaults={"content": content, "first_byte": first_byte},
        )
        saved += 1
    return saved
