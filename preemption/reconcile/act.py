"""Act: carry out the runtime actions the decide step recorded, after its
transaction committed and with none open while the runtime is called. Each action
is claimed first with a conditional update (a second worker with the same
decision does nothing), the calls of one pass go out side by side, and their
outcomes (done, retried with backoff, failed for good) are recorded together in
one short transaction.

Calls the runtime and records what the calls did (a launch that gives up fails
its attempt); it decides no step of its own and never imports the decide step: it
takes the `Step`s as they come. Closing the attempts whose ranks exited is the
finish step's.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from core.rows import row_values, update_rows
from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank
from preemption.reconcile.hold import launches_held
from preemption.reconcile.steps import ACTION_LEASE, Step, among, guarded
from preemption.runtimes.base import (
    GangId,
    Runtime,
    RuntimePermanentError,
    RuntimeTemporaryError,
)
from preemption.webhooks import notify

logger = logging.getLogger(__name__)

# Launches of one pass go out side by side: each local launch waits for a
# launcher process to start, each Kubernetes launch for the API server. A runtime
# whose calls never wait says how many it wants instead (runtimes.base.CallsSideBySide).
PARALLEL_ACTIONS = 8
MAX_RETRY_SECONDS = 60.0


def carry_out(steps: list[Step], runtime: Runtime) -> None:
    if any(step.action == Attempt.Action.LAUNCH for step in steps) and launches_held():
        steps = [step for step in steps if step.action != Attempt.Action.LAUNCH]
    if not steps:
        return
    with transaction.atomic():
        claim, claimed = _claim(steps)
    calls = [functools.partial(_call, step, runtime) for step in claimed]
    side_by_side = min(getattr(runtime, "calls_side_by_side", PARALLEL_ACTIONS), len(calls))
    if side_by_side > 1:
        with ThreadPoolExecutor(max_workers=side_by_side) as pool:
            errors = list(pool.map(lambda call: call(), calls))
    else:
        errors = [call() for call in calls]
    outcomes = list(zip(claimed, errors, strict=True))
    with transaction.atomic():
        # The common outcome, a launch or a forget that went through, is recorded
        # for all of them at once; anything else attempt by attempt.
        plain = _record_plain_outcomes([step for step, error in outcomes if error is None], claim)
        for step, error in outcomes:
            if step.attempt.pk not in plain:
                guarded(
                    step.attempt,
                    functools.partial(_record_outcome, step, claim, error),
                    savepoint=True,
                )


def _claim(steps: list[Step]) -> tuple[datetime, list[Step]]:
    """Claim the steps' actions, one conditional update per kind of action however
    many attempts: the claim time and the steps claimed. An attempt whose action
    changed, or that another worker claimed (and whose lease has not run out), is
    left out. The rows are locked in the order of their jobs' ids first, the order
    in which the decide step and the scheduling cycle take their locks.

    Attempts are locked FOR NO KEY UPDATE here and wherever a pass holds them: a
    trap's checkpoint holds its rank and inserts a checkpoint naming the attempt
    (a key-share lock on its row), and a pass that held the attempt FOR UPDATE
    while it waited for that rank would wait for each other with the trap."""
    now = timezone.now()
    by_action: dict[str, dict[int, Step]] = defaultdict(dict)
    for step in steps:
        by_action[step.action].setdefault(step.attempt.pk, step)
    claimed: list[Step] = []
    for action, group in by_action.items():
        claimable = Attempt.objects.filter(pk__in=among(group), action=action).filter(
            Q(action_claimed_at__isnull=True) | Q(action_claimed_at__lt=now - ACTION_LEASE),
            Q(action_not_before__isnull=True) | Q(action_not_before__lte=now),
        )
        if action == Attempt.Action.LAUNCH:
            claimable = claimable.filter(launched_at__isnull=True, ended_at__isnull=True)
        mine = list(
            claimable.select_for_update(no_key=True)
            .order_by("job_id", "pk")
            .values_list("pk", flat=True)
        )
        if mine:
            Attempt.objects.filter(pk__in=among(mine)).update(action_claimed_at=now)
        claimed += [group[pk] for pk in mine]
    return now, claimed


DONE = {
    "action": Attempt.Action.NONE,
    "action_claimed_at": None,
    "action_tries": 0,
    "action_error": "",
    "action_not_before": None,
}


def _record_plain_outcomes(steps: list[Step], claim: datetime) -> set[int]:
    """Record the calls that went through, a fixed number of statements however
    many; the ids of the attempts recorded (those whose claim is still this pass's).
    What `_record_outcome` records for each: the action done, a launch's time, a
    signal's or a notice's on its preemption (and a signal's on the ranks it was
    sent to), a kill's. A cycle that preempts two thousand jobs has as many signals
    to record at the next pass.

    Each launch keeps the moment its own call returned. Those times are written in
    one statement (core.rows.update_rows): as a CASE with a WHEN per attempt, Django
    spent about 1 ms per launch building it, a third of a launch batch's time on
    the benchmark against Kueue, and a short job that ended meanwhile could not be
    closed before its launch was recorded (`_plain`)."""
    now = timezone.now()
    recorded: set[int] = set()
    for action in PLAIN_OUTCOMES:
        group = {step.attempt.pk: step for step in steps if step.action == action}
        if not group:
            continue
        mine = Attempt.objects.filter(pk__in=among(group), action_claimed_at=claim)
        locked = list(
            mine.select_for_update(no_key=True)
            .order_by("job_id", "pk")
            .values_list("pk", flat=True)
        )
        if not locked:
            continue
        if action == Attempt.Action.LAUNCH:
            # A launch is claimed only while none is recorded (`_claim`), and only its
            # claim's holder records one: these rows, held since the line above, have
            # none yet.
            attempts = []
            for pk in locked:
                attempt = group[pk].attempt
                for name, value in DONE.items():
                    setattr(attempt, name, value)
                attempt.launched_at = group[pk].returned_at or now
                attempts.append(attempt)
            update_rows(attempts, [*DONE, "launched_at"])
        else:
            Attempt.objects.filter(pk__in=among(locked)).update(**DONE)
            done = [group[pk] for pk in locked]
            if action == Attempt.Action.SIGNAL:
                _signals_sent(done, now)
            elif action == Attempt.Action.NOTICE:
                _sent_at_once(done, "notice_sent_at", now)
            elif action == Attempt.Action.KILL:
                _kills_done(done, now)
        recorded.update(locked)
    return recorded


PLAIN_OUTCOMES = (
    Attempt.Action.LAUNCH,
    Attempt.Action.NOTICE,
    Attempt.Action.SIGNAL,
    Attempt.Action.KILL,
    Attempt.Action.FORGET,
)


def _stops(steps: list[Step]) -> dict[int, Step]:
    """The steps by the id of the preemption they carry out."""
    by_event: dict[int, Step] = {}
    for step in steps:
        assert step.event is not None
        by_event[step.event.pk] = step
    return by_event


def _sent_at_once(steps: list[Step], name: str, now: datetime) -> None:
    """Write on each step's preemption, where it has none yet, the moment its call
    began (`name`: signal_sent_at or notice_sent_at), one statement for them all."""
    by_event = _stops(steps)
    unsent = (
        PreemptionEvent.objects.select_for_update()
        .filter(pk__in=among(by_event), **{f"{name}__isnull": True})
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    update_rows(
        [row_values(PreemptionEvent, pk, **{name: by_event[pk].called_at or now}) for pk in unsent],
        [name],
    )


def _signals_sent(steps: list[Step], now: datetime) -> None:
    """`_signal_sent` for every step at once: on the ranks it was sent to and on its
    preemption, where none was recorded before. Ranks first, as the trap's events
    take them (`preemption.ingest`: the rank's row, then its preemption): in the
    other order a pass and a rank's report could each hold what the other waits for."""
    by_attempt = {step.attempt.pk: step for step in steps}
    alive = {pk: set(step.alive) for pk, step in by_attempt.items()}
    unsent = (
        Rank.objects.select_for_update()
        .filter(attempt_id__in=among(by_attempt), signal_sent_at__isnull=True)
        .order_by("attempt_id", "index")
        .values_list("pk", "attempt_id", "index")
    )
    update_rows(
        [
            row_values(Rank, pk, signal_sent_at=by_attempt[attempt_id].called_at or now)
            for pk, attempt_id, index in unsent
            if index in alive[attempt_id]
        ],
        ["signal_sent_at"],
    )
    _sent_at_once(steps, "signal_sent_at", now)


def _kills_done(steps: list[Step], now: datetime) -> None:
    """Record each step's kill on its preemption, where none was recorded before,
    and that a disruption budget was overridden where it was (`Step.forced`)."""
    by_event = _stops(steps)
    for forced in (False, True):
        events = [pk for pk, step in by_event.items() if step.forced == forced]
        if not events:
            continue
        killed: dict[str, Any] = {"killed_at": now}
        if forced:
            killed["outcome"] = PreemptionEvent.Outcome.FORCED
        PreemptionEvent.objects.filter(pk__in=among(events), killed_at__isnull=True).update(
            **killed
        )


def _call(step: Step, runtime: Runtime) -> Exception | None:
    """Make the runtime call; returns its error, translated, or None.

    Runs in a pool thread: it touches the runtime only, never the database."""
    step.called_at = timezone.now()
    try:
        if step.action == Attempt.Action.LAUNCH:
            assert step.spec is not None
            runtime.launch(step.spec)
            step.returned_at = timezone.now()
        elif step.action == Attempt.Action.NOTICE:
            deliver = getattr(runtime, "notice", None)
            if deliver is not None:
                deliver(step.gang, step.notice_signal)
        elif step.action == Attempt.Action.SIGNAL:
            assert step.event is not None
            remaining = max(0.0, (step.event.deadline - timezone.now()).total_seconds())
            runtime.signal(step.gang, remaining)
        elif step.action == Attempt.Action.KILL:
            if step.event is not None and step.event.signal_sent_at is None:
                step.forced = _eviction_refused(runtime, step.gang)
            runtime.kill(step.gang)
        elif step.action == Attempt.Action.FORGET:
            runtime.forget(step.gang)
    except (RuntimeTemporaryError, RuntimePermanentError) as error:
        return error
    except Exception as error:
        # A runtime that let a library's exception through: treat it as one that
        # may pass, so it is retried and counted rather than lost.
        logger.exception("%s of %s raised an untranslated error", step.action, step.gang)
        return RuntimeTemporaryError(f"{type(error).__name__}: {error}")
    return None


def _record_outcome(step: Step, claim: datetime, error: Exception | None) -> None:
    """Record what the runtime call did, in one short transaction."""
    mine = Attempt.objects.filter(pk=step.attempt.pk, action_claimed_at=claim)
    done = DONE
    now = timezone.now()
    with transaction.atomic():
        if isinstance(error, RuntimeTemporaryError):
            tries = step.attempt.action_tries + 1
            message = str(error)[:300]
            if step.action == Attempt.Action.LAUNCH and tries >= settings.QM_RUNTIME_TRIES:
                if mine.update(**done) == 1:
                    _fail_launch(
                        step.attempt.job,
                        step.attempt,
                        f"launch gave up after {tries} tries: {message}",
                        now,
                    )
                return
            if step.action == Attempt.Action.FORGET and tries >= settings.QM_RUNTIME_TRIES:
                # The attempt has ended; only the runtime's bookkeeping stays behind.
                mine.update(**{**done, "action_error": f"forget gave up: {message}"[:300]})
                return
            backoff = min(settings.QM_RUNTIME_RETRY_SECONDS * 2 ** (tries - 1), MAX_RETRY_SECONDS)
            logger.warning(
                "%s of %s failed (try %d), retrying in %.0f s: %s",
                step.action,
                step.gang,
                tries,
                backoff,
                message,
            )
            mine.update(
                action_claimed_at=None,
                action_tries=tries,
                action_error=message,
                action_not_before=now + timedelta(seconds=backoff),
            )
            return
        if isinstance(error, RuntimePermanentError):
            _permanent(step, mine, done, str(error), now)
            return
        if mine.update(**done) != 1:
            return
        if step.action == Attempt.Action.LAUNCH:
            Attempt.objects.filter(pk=step.attempt.pk, launched_at__isnull=True).update(
                launched_at=step.returned_at or now
            )
        elif step.action == Attempt.Action.NOTICE:
            assert step.event is not None
            PreemptionEvent.objects.filter(pk=step.event.pk, notice_sent_at__isnull=True).update(
                notice_sent_at=step.called_at or now
            )
        elif step.action == Attempt.Action.SIGNAL:
            assert step.event is not None
            _signal_sent(step, step.called_at or now)
        elif step.action == Attempt.Action.KILL:
            assert step.event is not None
            killed: dict[str, Any] = {"killed_at": now}
            if step.forced:
                killed["outcome"] = PreemptionEvent.Outcome.FORCED
            PreemptionEvent.objects.filter(pk=step.event.pk, killed_at__isnull=True).update(
                **killed
            )


def _signal_sent(step: Step, sent: datetime) -> None:
    """The signal's time on the ranks it was sent to, then on its preemption (the
    order of `_signals_sent`)."""
    assert step.event is not None
    Rank.objects.filter(
        attempt=step.attempt, signal_sent_at__isnull=True, index__in=step.alive
    ).update(signal_sent_at=sent)
    PreemptionEvent.objects.filter(pk=step.event.pk, signal_sent_at__isnull=True).update(
        signal_sent_at=sent
    )


def _permanent(
    step: Step, mine: QuerySet[Attempt], done: dict[str, Any], message: str, now: datetime
) -> None:
    """A call that can never succeed as asked fails that attempt with its reason,
    except a signal, which the deadline's kill follows as for a rank that ignores
    it, and a forget, whose gang has already ended."""
    logger.warning("%s of %s failed for good: %s", step.action, step.gang, message)
    if step.action == Attempt.Action.SIGNAL:
        if mine.update(**{**done, "action_error": f"signal failed: {message}"[:300]}) == 1:
            _signal_sent(step, step.called_at or now)
        return
    if step.action == Attempt.Action.FORGET:
        mine.update(**{**done, "action_error": f"forget failed: {message}"[:300]})
        return
    if step.action == Attempt.Action.NOTICE:
        # A courtesy that cannot be delivered: the eviction follows at once.
        if mine.update(**{**done, "action_error": f"notice failed: {message}"[:300]}) == 1:
            assert step.event is not None
            PreemptionEvent.objects.filter(pk=step.event.pk, notice_sent_at__isnull=True).update(
                notice_deadline=now
            )
        return
    if mine.update(**done) != 1:
        return
    if step.action != Attempt.Action.LAUNCH:
        message = f"stopping the gang failed: {message}"
    _fail_launch(step.attempt.job, step.attempt, message, now)


def _eviction_refused(runtime: Runtime, gang: GangId) -> bool:
    """Whether a disruption budget still refuses the gang's evictions at its
    deadline. The signal may have been tried by another worker process, whose
    runtime alone remembers the refusal, so a runtime that can be refused and
    remembers nothing is asked once more, with no grace left."""
    blocked = getattr(runtime, "eviction_blocked", None)
    if blocked is None:
        return False
    if blocked(gang):
        return True
    try:
        runtime.signal(gang, 0.0)
    except RuntimeTemporaryError:
        return bool(blocked(gang))
    except RuntimePermanentError:
        return False
    return False


def _fail_launch(job: Job, attempt: Attempt, message: str, now: datetime) -> None:
    Attempt.objects.filter(pk=attempt.pk, ended_at__isnull=True).update(
        ended_at=now, end_reason=Attempt.EndReason.FAILED
    )
    Job.objects.filter(pk=job.pk).update(
        state=JobState.FAILED, finished_at=now, failure_reason=message[:300]
    )
    notify(job_id=job.pk, event="failed", payload={"reason": message[:300]})
