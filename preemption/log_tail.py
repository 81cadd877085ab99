"""The end of a rank's log, read from its end, and the last lines of the rank whose
failure ended a job, which its page shows as `qm show` prints them.

A log may be gigabytes by the time its rank fails, and the lines that say why
are its last ones: reading it forward to keep the tail costs the whole file on
every page view. The saved tail (runtimes whose logs go with their pods) is
already the end; the local runtime seeks to its end (`read_log_end`); the
Kubernetes runtime streams the pod log once (`read_log_tail`, the pod log API has
no offset). Only a runtime with neither is read forward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from django.core.exceptions import ValidationError

from preemption.models import Attempt, Job, Rank, RankLogTail
from preemption.runtime import get_runtime
from preemption.runtimes.base import GangId, RuntimePermanentError, RuntimeTemporaryError

# What the page and `qm show` read of a failed rank's log: enough bytes for its
# last lines, however long the lines of a traceback.
FAILED_LOG_TAIL_BYTES = 8192
FAILED_LOG_LINES = 20
FORWARD_CHUNK = 1 << 20


def read_rank_log_tail(*, job: Job, attempt: int, rank: int, max_bytes: int) -> tuple[bytes, int]:
    """The last `max_bytes` of one rank's log and the offset in the whole log where
    they start. A job without that attempt or rank is a ValidationError; the
    runtime's own errors pass through."""
    record = Attempt.objects.filter(job=job, number=attempt).first()
    if record is None:
        raise ValidationError({"attempt": [f"Job {job.pk} has no attempt {attempt}."]})
    # The attempt's own ranks: an elastic job may have run at fewer than it asks for.
    size = record.world_size
    if not 0 <= rank < size:
        raise ValidationError({"rank": [f"Must be between 0 and {size - 1} (got {rank})."]})
    max_bytes = max(0, max_bytes)
    saved = RankLogTail.objects.filter(attempt=record, rank=rank).first()
    if saved is not None:
        content = bytes(saved.content)
        kept = content[len(content) - max_bytes :] if max_bytes else b""
        return kept, saved.first_byte + len(content) - len(kept)
    runtime = get_runtime()
    gang = GangId(job.pk, attempt)
    for name in ("read_log_end", "read_log_tail"):
        reader = getattr(runtime, name, None)
        if reader is not None:
            content, first_byte = reader(gang, rank, max_bytes)
            return bytes(content), int(first_byte)
    offset, kept = 0, b""
    while True:
        chunk = runtime.read_log(gang, rank, offset, FORWARD_CHUNK)
        offset += len(chunk)
        kept = (kept + chunk)[len(kept) + len(chunk) - max_bytes :] if max_bytes else b""
        if len(chunk) < FORWARD_CHUNK:
            return kept, offset - len(kept)


def failing_rank(ranks: list[Rank]) -> Rank | None:
    """The rank whose failure ended the attempt: the first to exit non-zero (by exit
    time, then index), else a lost one; None when no rank failed."""
    failed = [rank for rank in ranks if rank.exit_code not in (None, 0)]
    if failed:
        return min(
            failed,
            key=lambda rank: (rank.exited_at is None, rank.exited_at or 0, rank.index),
        )
    return next((rank for rank in ranks if rank.state == Rank.State.LOST), None)


@dataclass(frozen=True)
class FailedRankLog:
    """The last lines of the rank whose failure ended a job, or why they cannot be read."""

    attempt: int
    rank: int
    exit_code: int | None
    lines: list[str]
    unavailable: str = ""


def failed_rank_log(
    job: Job, attempt: Attempt, *, lines: int = FAILED_LOG_LINES
) -> FailedRankLog | None:
    """The last `lines` whole lines of the failing rank of `attempt` (ranks
    prefetched), or None when none of its ranks failed."""
    rank = failing_rank(list(attempt.rank_set.all()))
    if rank is None:
        return None
    found = FailedRankLog(
        attempt=attempt.number, rank=rank.index, exit_code=rank.exit_code, lines=[]
    )
    try:
        content, first_byte = read_rank_log_tail(
            job=job, attempt=attempt.number, rank=rank.index, max_bytes=FAILED_LOG_TAIL_BYTES
        )
    except (OSError, ValidationError, RuntimePermanentError, RuntimeTemporaryError) as problem:
        # The page is still worth reading when the log is gone.
        reason = "; ".join(problem.messages) if isinstance(problem, ValidationError) else problem
        return replace(found, unavailable=str(reason))
    text = content.decode("utf-8", errors="replace").splitlines()
    if first_byte > 0 and text:
        text = text[1:]  # the tail began inside a line: whole lines only
    return replace(found, lines=text[-lines:] if lines else [])
