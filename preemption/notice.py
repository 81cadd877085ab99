"""The checkpoint notice: a victim's ranks are told to checkpoint before they are evicted.

When the cycle picks a victim whose trap announced the notice protocol (`trap_ready`
with a `notice_signal`, or `notice_poll` where the runtime answers polls) and whose
priority class has a notice window, the reconciler first records a notice (its
deadline, then the time it was sent), delivers it to every rank, and sends the
eviction once a rank has reported `checkpoint_committed` for a checkpoint that
answered the notice (see `notice_committed_at`), or when the window has passed.
Everything else is evicted as before. The window is part of the grace budget: the
notice deadline is never later than the kill deadline, so the GPUs are free by the
same time either way.

Delivery depends on the runtime (its `notice_delivery`):

* ``"signal"`` (local): the notice signal the ranks announced goes to every rank's
  process group. Only SIGUSR2, the protocol's default, is sent: the rank's shell
  wrapper survives it (launcher.SHELL_PREFIX), and another signal could end it; ranks
  that chose another are evicted as before.
* ``"poll"`` (Kubernetes, whose pods cannot be signalled but by their eviction): the
  runtime sets QM_NOTICE_POLL_SECONDS, and the trap asks the events endpoint with
  its attempt's token whether a notice was sent. `notice_answer` gives that answer.

The answer to a poll is cheap: the expensive part, matching the token against the
job's attempts (an HMAC each), is kept per process, since a token's attempt never
changes; the notice itself is read by primary key on every poll, so a notice is
seen at once and an attempt that ended is refused at once, with no cache to
invalidate across the web server's processes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import datetime, timedelta

from preemption.event_tokens import attempt_for_token
from preemption.models import Attempt, Job, PreemptionEvent, TrapEvent

# Stops that get a notice: preemptions, and resizes, whose gang also restarts from
# the checkpoint it commits. A person's cancel, the gang guard and the portal's own
# shutdown stop as before.
NOTICE_REASONS = frozenset(
    {
        PreemptionEvent.Reason.RECLAIM,
        PreemptionEvent.Reason.PRIORITY,
        PreemptionEvent.Reason.FAIR_SHARE,
        PreemptionEvent.Reason.CONSOLIDATE,
        PreemptionEvent.Reason.RESIZE,
    }
)

# Signals the local runtime sends as a notice (see the module docstring).
SENDABLE_SIGNALS = frozenset({"SIGUSR2"})

# Tokens whose attempt is remembered per process.
TOKEN_CACHE_SIZE = 4096


@dataclass(frozen=True)
class NoticePlan:
    """How an attempt's ranks are to get the notice: the signal's name (signal
    delivery) or "" (poll delivery), and the notice deadline."""

    signal: str
    deadline: datetime


def announced_notice(attempt: Attempt, delivery: str | None) -> str | None:
    """How the attempt's ranks can be sent a notice by a runtime that delivers it
    by `delivery`: the signal's name, "" for a poll, or None when some rank did not
    announce what the runtime needs (or has not announced yet)."""
    if delivery not in ("signal", "poll"):
        return None
    ready: dict[int, dict[str, object]] = {}
    rows = TrapEvent.objects.filter(
        job_id=attempt.job_id, attempt=attempt.number, event="trap_ready"
    ).order_by("at")
    for rank, payload in rows.values_list("rank", "payload"):
        ready[rank] = payload
    if len(ready) < attempt.world_size:
        return None
    if delivery == "poll":
        return "" if all(p.get("notice_poll") is True for p in ready.values()) else None
    names = {p.get("notice_signal") for p in ready.values()}
    if len(names) != 1:
        return None
    name = names.pop()
    return name if isinstance(name, str) and name in SENDABLE_SIGNALS else None


def notice_plan(
    *, event: PreemptionEvent, attempt: Attempt, delivery: str | None, now: datetime
) -> NoticePlan | None:
    """The notice a victim is to get before its eviction, or None: evict as before."""
    if event.reason not in NOTICE_REASONS or attempt.launched_at is None:
        return None
    window = attempt.job.priority_class.notice_seconds
    if window <= 0:
        return None
    signal = announced_notice(attempt, delivery)
    if signal is None:
        return None
    return NoticePlan(signal, min(now + timedelta(seconds=window), event.deadline))


def notice_committed_at(attempt: Attempt, sent_at: datetime) -> datetime | None:
    """When the first rank reported a committed checkpoint that answered the notice
    sent at `sent_at`, or None while none has.

    One rank's report is the gang's: the ranks of a process group commit a save
    together (each reports only after every rank's files are durable), so waiting
    for the other ranks' reports would wait for their requests, not their data. A
    rank that saves on its own and is still writing when the eviction arrives
    finishes its write first, within the grace window, as the trap does for any
    eviction during a background save.
    """
    first = (
        TrapEvent.objects.filter(
            job_id=attempt.job_id,
            attempt=attempt.number,
            event="checkpoint_committed",
            at__gte=sent_at.timestamp(),
            payload__notice=True,
        )
        .order_by("at")
        .values_list("at", flat=True)
        .first()
    )
    return None if first is None else datetime.fromtimestamp(first, tz=sent_at.tzinfo)


def record_notice_commit(event: PreemptionEvent, attempt: Attempt) -> bool | None:
    """Store on `event` when the notice's checkpoint committed (see
    `notice_committed_at`), once: None while no rank has committed one, True for
    the caller that stored it, False when another caller (the events endpoint or a
    reconcile pass) had stored it first."""
    assert event.notice_sent_at is not None
    committed = notice_committed_at(attempt, event.notice_sent_at)
    if committed is None:
        return None
    return bool(
        PreemptionEvent.objects.filter(pk=event.pk, notice_committed_at__isnull=True).update(
            notice_committed_at=committed
        )
    )


# --- the answer to the trap's poll ---------------------------------------------------


@dataclass(frozen=True)
class NoticeAnswer:
    """What a rank polling with its attempt's token is told."""

    attempt: int
    notice: bool
    sent_at: datetime | None
    deadline: datetime | None


@functools.lru_cache(maxsize=TOKEN_CACHE_SIZE)
def _token_attempt(job_id: int, token: str) -> tuple[int, int] | None:
    """(attempt id, number) of the job's attempt this token belongs to, or None.
    Which attempt a token belongs to never changes, so the answer is kept."""
    job = Job.objects.filter(pk=job_id).first()
    if job is None:
        return None
    attempt = attempt_for_token(job, token)
    return None if attempt is None else (attempt.pk, attempt.number)


def notice_answer(*, job_id: int, token: str) -> NoticeAnswer | None:
    """Whether a notice was sent to the open attempt of `job_id` that `token`
    belongs to; None for a token of no attempt of this job, or of one that ended."""
    found = _token_attempt(job_id, token)
    if found is None:
        return None
    attempt_id, number = found
    row = (
        Attempt.objects.filter(pk=attempt_id, ended_at__isnull=True)
        .values_list("preemption__notice_sent_at", "preemption__notice_deadline")
        .first()
    )
    if row is None:
        return None
    sent_at, deadline = row
    return NoticeAnswer(
        attempt=number,
        notice=sent_at is not None,
        sent_at=sent_at,
        deadline=deadline if sent_at is not None else None,
    )
