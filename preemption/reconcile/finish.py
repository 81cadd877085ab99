"""Finish: close the attempts whose every rank has exited (or that were stopped
before they started). The ranks' logs and the ports each gang left behind are
read with no transaction open, the attempts are closed in one short transaction
(those that simply succeeded together), each job's fate is decided (succeeded,
cancelled, requeued from its checkpoint, retried, failed), its preemption's
outcome and lost GPU time recorded, and the gangs are forgotten through the act
step.

Comes after the act step, whose `carry_out` forgets the gangs closed; it never
calls the decide step.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from preemption.logs import save_log_tails
from preemption.models import (
    Attempt,
    Checkpoint,
    Job,
    JobState,
    PreemptionEvent,
    Rank,
    TrapEvent,
    next_attempt_number,
)
from preemption.reasons import disruption_requeue_words, disruption_words, rank_end_words
from preemption.reconcile.act import DONE, carry_out
from preemption.reconcile.logs import ingest_logs
from preemption.reconcile.steps import Step, gang_spec, guarded
from preemption.runtimes.base import (
    GangId,
    Runtime,
    RuntimePermanentError,
    RuntimeTemporaryError,
)
from preemption.wakeup import queue_cycle
from preemption.webhooks import Notice, notify, notify_each

logger = logging.getLogger(__name__)


def finish(steps: list[Step], runtime: Runtime) -> None:
    """Every rank has exited, or the attempt was stopped before it started: read
    the ranks' logs and the ports each gang left behind with no transaction
    open, close the attempts in one short transaction, then forget the gangs."""
    held = _held_ports([step for step in steps if step.attempt.launched_at is not None], runtime)
    recorded = _recorded_ranks([step.attempt for step in steps])
    closing: list[tuple[Step, list[Rank], list[int]]] = []
    for step in steps:
        ranks = recorded.get(step.attempt.pk, [])
        if guarded(step.attempt, functools.partial(_ingest_ends, step, ranks, runtime)):
            closing.append((step, ranks, held.get(step.gang, [])))
    closed: list[tuple[Step, list[Rank]]] = []
    # The attempts of resized jobs, relaunched in the same transaction as their last
    # attempt closes, to be launched by the same act step as the forgets.
    relaunched: list[Attempt] = []
    disrupted = _disruptions([item for item in closing if item[0].event is None], runtime)
    with transaction.atomic():
        # Gangs that ended on their own with every rank exiting 0, the common end,
        # are closed together in a fixed number of queries; the rest one by one.
        succeeded = [
            item
            for item in closing
            if item[0].event is None
            and not _broken(item[1])
            and item[0].attempt.pk not in disrupted
        ]
        together = _close_succeeded_together(succeeded, timezone.now())
        batched: set[int] = set()
        if together is not None:
            # A stop decided since this pass read the attempts leaves them to the
            # one-by-one close, which judges whether it reached them.
            batched = {step.attempt.pk for step, _, _ in succeeded} - together.stopped
        for step, ranks, orphaned in closing:
            attempt = step.attempt
            if attempt.pk in batched:
                assert together is not None
                if attempt.pk in together.closed:
                    attempt.action, attempt.action_tries = Attempt.Action.FORGET, 0
                    closed.append((Step(Attempt.Action.FORGET, attempt), ranks))
                continue
            close = functools.partial(
                _finish_attempt,
                attempt.job,
                attempt,
                ranks,
                step.event,
                orphaned,
                timezone.now(),
                disruption=disrupted.get(attempt.pk, ""),
                relaunched=relaunched,
            )
            if guarded(attempt, close, savepoint=True):
                attempt.action, attempt.action_tries = Attempt.Action.FORGET, 0
                closed.append((Step(Attempt.Action.FORGET, attempt), ranks))
    # Runtimes whose logs go away with the gang (Kubernetes) keep each rank's
    # last lines first: log reads are runtime calls, so no transaction is open.
    for step, ranks in closed:
        guarded(step.attempt, functools.partial(save_log_tails, step.attempt, ranks, runtime))
    carry_out([step for step, _ in closed] + _launches(relaunched), runtime)


def _launches(attempts: list[Attempt]) -> list[Step]:
    """The launch of each attempt a resize relaunched, with what it needs loaded."""
    if not attempts:
        return []
    return [
        Step(
            Attempt.Action.LAUNCH,
            attempt,
            spec=gang_spec(attempt.job, attempt, attempt.rank_set.all()),
        )
        for attempt in Attempt.objects.filter(
            pk__in=[attempt.pk for attempt in attempts],
            ended_at__isnull=True,
            launched_at__isnull=True,
            action=Attempt.Action.LAUNCH,
        )
        .select_related("job", "job__team", "job__priority_class", "job__flavor")
        .prefetch_related("rank_set")
    ]


def _disruptions(
    closing: list[tuple[Step, list[Rank], list[int]]], runtime: Runtime
) -> dict[int, str]:
    """The ended attempts, of those with no stop on record, that something outside
    the control plane stopped, with why in words (`disruption_words`): a rank the
    runtime saw taken away (a drain's eviction, which carries no mark of ours), or a
    rank whose trap reported a signal that the control plane never sent (a host's
    shutdown, a person's kill). Such a gang may end with every rank exiting 0, its
    trap having checkpointed on that signal, but its work is not done. One query,
    read after the ranks' trap events were ingested, plus what the runtime's gang
    guard kept from its last observation."""
    if not closing:
        return {}
    received: dict[int, list[int]] = defaultdict(list)
    for attempt_id, index in Rank.objects.filter(
        attempt_id__in=[step.attempt.pk for step, _, _ in closing],
        signal_received_at__isnull=False,
        signal_sent_at__isnull=True,
    ).values_list("attempt_id", "index"):
        received[attempt_id].append(index)
    guard = runtime.gang_guard
    words: dict[int, str] = {}
    for step, ranks, _ in closing:
        taken: dict[int, str] = {}
        if guard is not None and step.attempt.launched_at is not None:
            taken = guard.taken_ranks(step.gang)
        # A rank the control plane signalled was stopped by it; one evicted past a
        # limit of its own (its memory, its disk) ended by its own doing.
        excused = {
            rank.index for rank in ranks if rank.signal_sent_at is not None or rank.end_reason
        }
        taken = {index: why for index, why in taken.items() if index not in excused}
        if taken or received.get(step.attempt.pk):
            words[step.attempt.pk] = disruption_words(
                nodes={rank.index: rank.node for rank in ranks},
                taken=taken,
                received=received.get(step.attempt.pk, []),
            )
    return words


def _held_ports(steps: list[Step], runtime: Runtime) -> dict[GangId, list[int]]:
    """The ports each launched gang still holds, asked of the runtime in one call
    (none known when the runtime cannot tell)."""
    if not steps:
        return {}
    try:
        return runtime.released_ports([step.gang for step in steps])
    except (RuntimeTemporaryError, RuntimePermanentError):
        logger.warning("reading the ports of ended gangs failed", exc_info=True)
        return {}


def _recorded_ranks(attempts: list[Attempt]) -> dict[int, list[Rank]]:
    """Each attempt's ranks as last recorded, in the order of their indexes, in one query."""
    ranks: dict[int, list[Rank]] = defaultdict(list)
    for rank in Rank.objects.filter(attempt__in=attempts).order_by("attempt_id", "index"):
        ranks[rank.attempt_id].append(rank)
    return ranks


def _ingest_ends(step: Step, ranks: list[Rank], runtime: Runtime) -> bool:
    """Ingest the trap events in the ended ranks' logs; True once done."""
    ingest_logs(step.attempt.job, step.attempt, ranks, runtime)
    return True


def _broken(ranks: list[Rank]) -> bool:
    """Whether a rank was lost or exited non-zero."""
    return any(rank.state == "lost" or rank.exit_code not in (0, None) for rank in ranks)


@dataclass(frozen=True)
class ClosedTogether:
    """What `_close_succeeded_together` did: the attempts it closed, and those it
    left alone because a stop of theirs was decided after the pass read them."""

    closed: set[int]
    stopped: set[int]


def _close_succeeded_together(
    items: list[tuple[Step, list[Rank], list[int]]], now: datetime
) -> ClosedTogether | None:
    """Close attempts whose every rank exited 0 with no stop asked, as
    `_finish_attempt` closes each, in a fixed number of queries however many:
    the attempts this pass closed (not those another worker closed first).
    None when that failed: nothing of it is kept, and the caller closes them one
    by one, so one attempt's trouble stays its own."""
    if not items:
        return ClosedTogether(set(), set())
    try:
        with transaction.atomic():
            return _close_succeeded(items, now)
    except SoftTimeLimitExceeded:
        raise
    except Exception:
        if transaction.get_connection().needs_rollback:
            raise
        logger.exception("closing %d ended attempts together failed; one by one", len(items))
        return None


def _close_succeeded(
    items: list[tuple[Step, list[Rank], list[int]]], now: datetime
) -> ClosedTogether:
    by_attempt = {step.attempt.pk: (step, ranks, orphaned) for step, ranks, orphaned in items}
    job_ids = sorted({step.attempt.job_id for step, _, _ in items})
    # The jobs' rows first, in the order of their ids, as the decide step and the
    # scheduling cycle lock them; then the attempts still open. A job another
    # transaction holds is left to it and to the next pass, as in `_lock_rows`.
    resume_steps = dict(
        Job.objects.select_for_update(no_key=True, skip_locked=True)
        .filter(pk__in=job_ids)
        .order_by("pk")
        .values_list("pk", "resume_step")
    )
    still_open = list(
        Attempt.objects.select_for_update(no_key=True)
        .filter(pk__in=by_attempt, job_id__in=list(resume_steps), ended_at__isnull=True)
        .order_by("job_id", "pk")
        .values_list("pk", flat=True)
    )
    # The scheduling cycle records a stop with its job's row locked: with the rows
    # held, every stop decided since the pass read these attempts is seen here.
    stopped = set(
        PreemptionEvent.objects.filter(victim_attempt_id__in=still_open).values_list(
            "victim_attempt_id", flat=True
        )
    )
    still_open = [pk for pk in still_open if pk not in stopped]
    if not still_open:
        return ClosedTogether(set(), stopped)
    last_steps = dict(
        Checkpoint.objects.filter(job_id__in=job_ids)
        .order_by()
        .values("job_id")
        .annotate(step=Max("step"))
        .values_list("job_id", "step")
    )
    by_orphaned: dict[tuple[int, ...], list[int]] = defaultdict(list)
    by_resume_step: dict[int | None, list[int]] = defaultdict(list)
    notices = []
    for pk in still_open:
        step, ranks, orphaned = by_attempt[pk]
        job_id = step.attempt.job_id
        by_orphaned[tuple(orphaned)].append(pk)
        last = last_steps.get(job_id)
        by_resume_step[last + 1 if last is not None else resume_steps.get(job_id)].append(job_id)
        codes = [rank.exit_code for rank in ranks]
        notices.append(
            Notice(
                job_id=job_id, event="finished", payload={"state": "succeeded", "exit_codes": codes}
            )
        )
    for orphaned, pks in by_orphaned.items():
        Attempt.objects.filter(pk__in=pks).update(
            **{**DONE, "action": Attempt.Action.FORGET},
            ended_at=now,
            end_reason=Attempt.EndReason.SUCCEEDED,
            orphaned_ports=list(orphaned),
        )
    for resume_step, jobs in by_resume_step.items():
        Job.objects.filter(pk__in=jobs).update(
            resume_step=resume_step, state=JobState.SUCCEEDED, finished_at=now
        )
    notify_each(notices)
    queue_cycle()
    return ClosedTogether(set(still_open), stopped)


def _finish_attempt(
    job: Job,
    attempt: Attempt,
    ranks: list[Rank],
    event: PreemptionEvent | None,
    orphaned: list[int],
    now: datetime,
    *,
    disruption: str = "",
    relaunched: list[Attempt] | None = None,
) -> bool:
    """Free the GPUs and decide what becomes of the job; the gang is to be
    forgotten next. False when another worker closed the attempt first.

    `disruption` says why, where something outside the control plane stopped the
    gang (`_disruptions`): with no stop of the control plane's own, the job is then
    requeued from its checkpoint as preempted by the cluster, whatever its ranks'
    exit codes, and no retry of its own is counted."""
    codes = [rank.exit_code for rank in ranks]
    exited_at = max((rank.exited_at for rank in ranks if rank.exited_at), default=now)
    failed = _broken(ranks)
    # The job's row first, as the scheduling cycle locks it to record a stop: a stop
    # decided since this pass read the attempt is seen below, and one decided later
    # finds the job ended.
    job.refresh_from_db(from_queryset=Job.objects.select_for_update(no_key=True))
    last_step = Checkpoint.objects.filter(job=job).aggregate(step=Max("step"))["step"]
    resume_step = (last_step + 1) if last_step is not None else job.resume_step
    if event is not None:
        event.refresh_from_db()
    else:
        event = PreemptionEvent.objects.filter(victim_attempt=attempt).first()
        if event is not None:
            # Whether that stop was tried since is on the attempt's row.
            attempt.refresh_from_db()
    ended_first = event is not None and _ended_before_the_stop(attempt, ranks, event)

    if event is not None and not ended_first:
        reason = event.reason
        end_reason = {
            "manual": Attempt.EndReason.CANCELLED,
            "gang-guard": Attempt.EndReason.GANG_GUARD,
            "resize": Attempt.EndReason.RESIZED,
        }.get(reason, Attempt.EndReason.PREEMPTED)
        if job.cancel_requested_at is not None:
            end_reason = Attempt.EndReason.CANCELLED
    elif disruption:
        end_reason = (
            Attempt.EndReason.CANCELLED
            if job.cancel_requested_at is not None
            else Attempt.EndReason.PREEMPTED
        )
    elif failed:
        end_reason = Attempt.EndReason.FAILED
    else:
        end_reason = Attempt.EndReason.SUCCEEDED

    claimed = Attempt.objects.filter(pk=attempt.pk, ended_at__isnull=True).update(
        ended_at=now,
        end_reason=end_reason,
        orphaned_ports=orphaned,
        action=Attempt.Action.FORGET,
        action_claimed_at=None,
        action_tries=0,
        action_error="",
        action_not_before=None,
    )
    if claimed != 1:
        return False
    if event is not None:
        _close_event(event, attempt, job, exited_at, resume_step, ended_first=ended_first)

    update: dict[str, Any] = {"resume_step": resume_step}
    if end_reason == Attempt.EndReason.SUCCEEDED:
        update.update(state=JobState.SUCCEEDED, finished_at=now)
        notice = ("finished", {"state": "succeeded", "exit_codes": codes})
    elif end_reason == Attempt.EndReason.CANCELLED:
        update.update(state=JobState.CANCELLED, finished_at=now)
        notice = ("finished", {"state": "cancelled", "exit_codes": codes})
    elif end_reason == Attempt.EndReason.RESIZED:
        assert event is not None
        relaunch = _relaunch(job, attempt, event, now)
        if relaunched is not None:
            relaunched.append(relaunch)
        update.update(state=JobState.ADMITTED, admitted_at=now, waiting_reason="")
        notice = (
            "resized",
            {
                "stage": "relaunched",
                "from_ranks": attempt.world_size,
                "to_ranks": relaunch.ranks,
                "cause": event.cause,
                "attempt": relaunch.number,
                "resume_step": resume_step,
            },
        )
    elif end_reason == Attempt.EndReason.PREEMPTED and event is None:
        # Stopped by the cluster, not by the control plane: requeued as a preemption.
        update.update(
            state=JobState.REQUEUED,
            requeued_at=now,
            waiting_reason=disruption_requeue_words(
                disruption, checkpoint_step=last_step, resume_step=resume_step
            )[:300],
        )
        notice = (
            "requeued",
            {"resume_step": resume_step, "reason": "disrupted", "cause": disruption},
        )
    elif end_reason == Attempt.EndReason.PREEMPTED:
        update.update(
            state=JobState.REQUEUED,
            requeued_at=now,
            waiting_reason=(
                shutdown_requeue_words(checkpoint_step=last_step, resume_step=resume_step)
                if event is not None and event.reason == PreemptionEvent.Reason.SHUTDOWN
                else "requeued after preemption; waiting for GPUs"
            ),
        )
        notice = ("requeued", {"resume_step": resume_step, "reason": event.reason if event else ""})
    else:
        # A failed rank. A failure of the job's own (a rank exited non-zero
        # although nobody stopped it) is retried only as often as its submitter
        # asked; a lost rank is the cluster's doing and is retried with backoff
        # until the attempts run out.
        attempts = Attempt.objects.filter(job=job).count()
        broken = next((r for r in ranks if r.state == "lost" or r.exit_code not in (0, None)), None)
        why = (event.cause if event is not None else "") or (
            rank_end_words(broken) if broken else "a rank failed"
        )
        own = _failed_on_its_own(ranks)
        if own and job.retries_used >= job.retries:
            given_up = (
                f"gave up after {job.retries} retr{'y' if job.retries == 1 else 'ies'}"
                if job.retries
                else "not retried: the job asked for no retries"
            )
            update.update(
                state=JobState.FAILED, finished_at=now, failure_reason=f"{why}; {given_up}"[:300]
            )
            notice = ("failed", {"reason": update["failure_reason"], "exit_codes": codes})
        elif attempts >= job.max_attempts:
            update.update(
                state=JobState.FAILED,
                finished_at=now,
                failure_reason=f"{why}; gave up after {attempts} attempts"[:300],
            )
            notice = ("failed", {"reason": update["failure_reason"], "exit_codes": codes})
        else:
            backoff = settings.QM_RETRY_BACKOFF_SECONDS * (2 ** (attempts - 1))
            counted = (
                f"retry {job.retries_used + 1} of {job.retries}"
                if own
                else f"attempt {attempts + 1} of {job.max_attempts}"
            )
            if own:
                update["retries_used"] = job.retries_used + 1
            update.update(
                state=JobState.REQUEUED,
                requeued_at=now,
                not_before=now + timedelta(seconds=backoff),
                waiting_reason=f"{why}; retrying in {backoff:.0f} s ({counted})"[:300],
            )
            notice = ("requeued", {"reason": why, "resume_step": resume_step})
    Job.objects.filter(pk=job.pk).update(**update)
    notify(job_id=job.pk, event=notice[0], payload=notice[1])
    queue_cycle()
    return True


def _relaunch(job: Job, attempt: Attempt, event: PreemptionEvent, now: datetime) -> Attempt:
    """The job's next attempt at the size and on the placement its resize decided,
    admitted now and to be launched at once: a resize keeps the job's place, so it
    never waits in the queue behind other work. The GPUs were the job's all along
    (`preemption.snapshot`), and are still, since this commits with the close of the
    attempt that ran before."""
    assert event.resize_ranks is not None
    relaunch = Attempt.objects.create(
        job=job,
        number=next_attempt_number(job.pk),
        admitted_at=now,
        ranks=event.resize_ranks,
        placement=event.resize_placement,
        borrowed_gpus=event.resize_borrowed_gpus,
        action=Attempt.Action.LAUNCH,
    )
    ranks = []
    for entry in event.resize_placement:
        for _ in range(int(entry["ranks"])):
            ranks.append(Rank(attempt=relaunch, index=len(ranks), node=entry["node"]))
    Rank.objects.bulk_create(ranks)
    return relaunch


def shutdown_requeue_words(*, checkpoint_step: int | None, resume_step: int | None) -> str:
    """Why a job stopped by the portal's shutdown waits, and where it resumes."""
    if checkpoint_step is not None:
        where = f"checkpoint at step {checkpoint_step}, resumes at step {resume_step}"
    elif resume_step is not None:
        where = f"resumes at step {resume_step}"
    else:
        where = "no checkpoint, so it starts over"
    return f"stopped when the portal shut down; {where}"


def _failed_on_its_own(ranks: list[Rank]) -> bool:
    """True when a rank exited non-zero before anyone asked it to stop, and no
    rank was lost: the job's own failure, not the cluster's or the portal's.
    A rank the reconciler signalled (a preemption, a cancel, the gang guard
    stopping the rest, the deadline's kill) does not count, whatever its code."""
    if any(rank.state == "lost" for rank in ranks):
        return False
    return any(
        rank.state == "exited" and rank.exit_code not in (0, None) and rank.signal_sent_at is None
        for rank in ranks
    )


def _ended_before_the_stop(attempt: Attempt, ranks: list[Rank], event: PreemptionEvent) -> bool:
    """Whether the gang finished its work before its stop reached it: every rank
    exited 0 and nothing was ever sent, nor tried, to stop them. A signal is
    recorded as sent from the moment its call began; a call that failed may still
    have reached some ranks, whose trap then stops the others at an agreed step, so
    a stop that was tried at all (its action claimed or counted) rules this out. A
    checkpoint notice stops nothing.

    Judged by what was sent, not by exit times: a Kubernetes container's end is
    known to the second, which could place a rank's graceful exit before the signal
    that caused it."""
    stop_tried = attempt.action in (Attempt.Action.SIGNAL, Attempt.Action.KILL) and (
        attempt.action_tries > 0 or attempt.action_claimed_at is not None
    )
    return (
        bool(ranks)
        and not stop_tried
        and event.signal_sent_at is None
        and event.killed_at is None
        and all(rank.state == "exited" and rank.exit_code == 0 for rank in ranks)
    )


def _close_event(
    event: PreemptionEvent,
    attempt: Attempt,
    job: Job,
    exited_at: datetime,
    resume_step: int | None,
    *,
    ended_first: bool = False,
) -> None:
    if ended_first:
        PreemptionEvent.objects.filter(pk=event.pk).update(
            outcome=PreemptionEvent.Outcome.ENDED_FIRST,
            all_exited_at=exited_at,
            lost_gpu_seconds=0.0,
            requeued_at=None,
            resume_step=None,
        )
        return
    skipped = TrapEvent.objects.filter(
        job=job, attempt=attempt.number, event="checkpoint_skipped"
    ).exists()
    if event.outcome == PreemptionEvent.Outcome.FORCED:
        outcome = PreemptionEvent.Outcome.FORCED
    elif event.killed_at is not None:
        outcome = PreemptionEvent.Outcome.KILLED
    elif skipped:
        outcome = PreemptionEvent.Outcome.CHECKPOINT_SKIPPED
    else:
        outcome = PreemptionEvent.Outcome.GRACEFUL
    last = (
        Checkpoint.objects.filter(job=job, attempt=attempt, committed_at__lte=exited_at)
        .order_by("-committed_at")
        .values_list("committed_at", flat=True)
        .first()
    )
    if last is not None and last >= event.decided_at:
        lost = 0.0
    else:
        base = last or attempt.launched_at or attempt.admitted_at
        lost = max(0.0, (exited_at - base).total_seconds()) * attempt.world_size * job.gpus_per_rank
    requeue = (
        # Every stop but a person's own brings the job back: a resize at once, as its
        # next attempt, rather than through the queue.
        event.reason != PreemptionEvent.Reason.MANUAL and job.cancel_requested_at is None
    )
    resized = event.reason == PreemptionEvent.Reason.RESIZE
    PreemptionEvent.objects.filter(pk=event.pk).update(
        outcome=outcome,
        all_exited_at=exited_at,
        lost_gpu_seconds=lost,
        requeued_at=timezone.now() if requeue and not resized else None,
        resume_step=resume_step if requeue else None,
    )
