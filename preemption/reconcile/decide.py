"""Decide, in one short transaction per pass: lock the attempts' jobs and ranks,
record what the runtime observed, move each job's state on, and record on the
attempt the runtime action it needs next (a `Step`: launch, notice, signal, kill,
or finish once every rank has exited). `request_stop` records a stop of a running
job for the next pass to carry out.

Decides, never calls the runtime: the act step makes the calls after this commits.
Reads and writes through the observe step's helpers and hands the steps on.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from celery.exceptions import SoftTimeLimitExceeded
from django.db import transaction
from django.utils import timezone

from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank
from preemption.notice import announced_notice, notice_plan, record_notice_commit
from preemption.reasons import rank_end_words
from preemption.reconcile.observe import ObservedRanks, record_observations, stuck_at_start
from preemption.reconcile.steps import (
    ACTION_LEASE,
    FINISH,
    TERMINAL_PHASES,
    Step,
    among,
    gang_spec,
    guarded,
    loaded,
)
from preemption.runtimes.base import RankObservation
from preemption.webhooks import notify

logger = logging.getLogger(__name__)


def request_stop(
    *, job: Job, reason: str, cause: str, grace_seconds: float | None = None
) -> PreemptionEvent | None:
    """Record that a running job must stop gracefully (cancel, gang guard).
    The reconciler then signals every rank and enforces the deadline."""
    attempt = Attempt.objects.filter(job=job, ended_at__isnull=True).first()
    if attempt is None or PreemptionEvent.objects.filter(victim_attempt=attempt).exists():
        return None
    now = timezone.now()
    grace = float(job.priority_class.grace_seconds if grace_seconds is None else grace_seconds)
    Job.objects.filter(pk=job.pk, state__in=[JobState.ADMITTED, JobState.RUNNING]).update(
        state=JobState.PREEMPTING, preempting_at=now
    )
    return PreemptionEvent.objects.create(
        victim_attempt=attempt,
        job=job,
        reason=reason,
        cause=cause[:300],
        decided_at=now,
        grace_seconds=grace,
        deadline=now + timedelta(seconds=grace),
    )


def decide_pending(
    pending: list[tuple[Attempt, list[RankObservation], bool]], delivery: str | None
) -> list[Step]:
    """Decide for every attempt the pass looks at (each with what the runtime showed
    of it and whether its gang guard named it taken) in the pass's one decide
    transaction: the steps to act on. A lock conflict the database broke by undoing
    the transaction is raised for the pass to give up on (OperationalError)."""
    # One short transaction decides for every attempt, each in a savepoint of its
    # own: on SQLite each transaction waits its turn for the write lock.
    steps: list[Step] = []
    launched = {attempt.pk: attempt.launched_at for attempt, _, _ in pending}
    with transaction.atomic():
        locked = [attempt for attempt, _, _ in pending]
        rows = _lock_rows(locked)
        kept = {attempt.pk for attempt in locked}
        plain = [
            (attempt, observations)
            for attempt, observations, was_taken in pending
            if attempt.pk in kept and _plain(attempt, observations, rows, was_taken)
        ]
        plain_steps = _decide_plain(plain, rows)
        if plain_steps is not None:
            steps += plain_steps
            kept -= {attempt.pk for attempt, _ in plain}
        stopping = [
            (attempt, observations)
            for attempt, observations, _ in pending
            if attempt.pk in kept and _stopping(attempt, observations, rows)
        ]
        stopped = _decide_stops(stopping, rows, delivery)
        if stopped is not None:
            steps += stopped.steps
            kept -= stopped.decided
        for attempt, observations, was_taken in pending:
            if attempt.pk not in kept:
                continue
            step = guarded(
                attempt,
                functools.partial(
                    _decide,
                    attempt,
                    observations,
                    launched_at=launched[attempt.pk],
                    taken=was_taken,
                    delivery=delivery,
                    rows=rows,
                ),
                # A launch already recorded writes nothing: a savepoint would
                # only cost two statements per admitted job.
                savepoint=not _launch_recorded(attempt, rows),
            )
            if step is not None:
                steps.append(step)
    return steps


@dataclass
class _Rows:
    """What the decide step reads of the attempts it decides for, read for all of
    them at once under the pass's locks: each attempt's ranks by index, and its stop."""

    ranks: dict[int, dict[int, Rank]]
    events: dict[int, PreemptionEvent]


ATTEMPT_FIELDS = ("launched_at", "ended_at", "action", "action_claimed_at", "action_tries")
JOB_FIELDS = ("state", "cancel_requested_at", "env")


def _lock_rows(attempts: list[Attempt]) -> _Rows:
    """Lock the attempts' jobs and ranks and read them afresh, in a fixed number of
    queries however many attempts: the job rows first, in the order of their ids,
    as the scheduling cycle locks them before anything of theirs, then the ranks.
    FOR NO KEY UPDATE on the jobs still lets trap events that refer to a job be
    written (their foreign key takes a KEY SHARE lock), which a full row lock would
    block while ingestion holds the ranks this pass waits for.

    A job another transaction holds is skipped, not waited for (SKIP LOCKED): its
    holder is moving it on right now (another pass closing it, the cycle recording
    its stop, ingestion storing its checkpoint), and the next pass decides it on what
    that one wrote. Waiting would only hold this pass's own jobs meanwhile; in a busy
    cluster the exits listener and the worker's periodic pass met on every job that
    had just ended. Only the attempts whose jobs were locked are kept in `attempts`.

    The attempts and their jobs are refreshed in place; the ranks and stops are
    returned."""
    if not attempts:
        return _Rows({}, {})
    jobs = {
        row["pk"]: row
        for row in Job.objects.select_for_update(no_key=True, skip_locked=True)
        .filter(pk__in=among({attempt.job_id for attempt in attempts}))
        .order_by("pk")
        .values("pk", *JOB_FIELDS)
    }
    attempts[:] = [attempt for attempt in attempts if attempt.job_id in jobs]
    if not attempts:
        return _Rows({}, {})
    # Filtered by the ids, not the objects: Django normalizes each object of an
    # `__in` list through its related lookup, thousands of calls in a large pass.
    ids = [attempt.pk for attempt in attempts]
    ranks: dict[int, dict[int, Rank]] = defaultdict(dict)
    for rank in loaded(
        Rank.objects.select_for_update()
        .filter(attempt_id__in=among(ids))
        .order_by("attempt_id", "index")
    ):
        ranks[rank.attempt_id][rank.index] = rank
    fresh = {
        row["pk"]: row
        for row in Attempt.objects.filter(pk__in=among(ids)).values("pk", *ATTEMPT_FIELDS)
    }
    for attempt in attempts:
        for name in ATTEMPT_FIELDS:
            setattr(attempt, name, fresh[attempt.pk][name])
        for name in JOB_FIELDS:
            setattr(attempt.job, name, jobs[attempt.job_id][name])
    events = {
        event.victim_attempt_id: event
        for event in loaded(PreemptionEvent.objects.filter(victim_attempt_id__in=among(ids)))
    }
    return _Rows(ranks, events)


def _plain(
    attempt: Attempt,
    observations: list[RankObservation],
    rows: _Rows,
    taken: bool,
) -> bool:
    """Whether the attempt moved on the common way, on its own: its launch recorded,
    every one of its ranks seen, running or exited 0, nothing asked of it (no stop,
    no action under way), its job admitted or running. For such an attempt `_decide`
    records what the ranks did, marks the job running, and finishes the attempt
    once every rank has exited; `_decide_plain` does it for all of them at once.

    The launch may have been recorded only after this pass observed the runtime:
    ranks seen running or exited ran, so the launch came before the observation. A
    short job in a large batch of launches often ends before the batch is recorded."""
    ranks = rows.ranks.get(attempt.pk, {})
    return (
        not taken
        and attempt.ended_at is None
        and attempt.launched_at is not None
        and not attempt.action
        and attempt.action_claimed_at is None
        and attempt.pk not in rows.events
        and attempt.job.state in (JobState.ADMITTED, JobState.RUNNING)
        and bool(ranks)
        and sorted(obs.rank for obs in observations) == sorted(ranks)
        and all(
            obs.phase == "running" or (obs.phase == "exited" and obs.exit_code == 0)
            for obs in observations
        )
    )


def _decide_plain(
    plain: list[tuple[Attempt, list[RankObservation]]], rows: _Rows
) -> list[Step] | None:
    """Decide for the attempts that moved on the common way (`_plain`) as `_decide`
    does for each, in a fixed number of queries however many: one write of their
    ranks, one of their jobs still marked admitted, and a finish step for each whose
    ranks all exited. In a busy cluster a pass sees hundreds of gangs that have just
    started or ended; a savepoint and a write each held their jobs' rows for as long,
    and the exits listener, which skips a row another pass holds, closed their ends
    only at a later pass. None when that failed: nothing of it is kept, and the
    caller decides for them one by one, so one attempt's trouble stays its own."""
    if not plain:
        return []
    now = timezone.now()
    written = ObservedRanks()
    for attempt, observations in plain:
        written.add(rows.ranks[attempt.pk], observations)
    admitted = [attempt.job_id for attempt, _ in plain if attempt.job.state == JobState.ADMITTED]
    try:
        with transaction.atomic():
            written.write()
            if admitted:
                Job.objects.filter(pk__in=among(admitted), state=JobState.ADMITTED).update(
                    state=JobState.RUNNING, running_at=now
                )
    except SoftTimeLimitExceeded:
        raise
    except Exception:
        if transaction.get_connection().needs_rollback:
            raise
        logger.exception("recording %d plain changes together failed; one by one", len(plain))
        return None
    return [
        Step(FINISH, attempt)
        for attempt, observations in plain
        if all(obs.phase == "exited" for obs in observations)
    ]


def _launch_recorded(attempt: Attempt, rows: _Rows) -> bool:
    """Whether the attempt only waits for the launch its admission recorded: `_decide`
    then writes nothing, and hands the launch on to the act step."""
    return (
        attempt.ended_at is None
        and attempt.launched_at is None
        and attempt.action == Attempt.Action.LAUNCH
        and attempt.pk not in rows.events
    )


def _stopping(attempt: Attempt, observations: list[RankObservation], rows: _Rows) -> bool:
    """Whether the attempt is being stopped the common way: a launched gang with a
    stop recorded (a preemption, a cancel), every one of its ranks seen, and no
    action of it claimed by a worker. For such an attempt `_decide` records what the
    ranks did and moves the stop on (signal, kill at the deadline, finish once every
    rank exited); `_decide_stops` does it for all of them at once. A cycle that
    preempts two thousand jobs leaves as many such attempts to the next pass."""
    ranks = rows.ranks.get(attempt.pk, {})
    return (
        attempt.ended_at is None
        and attempt.launched_at is not None
        and attempt.action_claimed_at is None
        and attempt.pk in rows.events
        and bool(ranks)
        and sorted(obs.rank for obs in observations) == sorted(ranks)
    )


@dataclass
class _Decided:
    """What deciding a group of attempts together gave: the steps to act on, and the
    attempts it decided (the rest are decided one by one)."""

    steps: list[Step]
    decided: set[int]


def _decide_stops(
    stopping: list[tuple[Attempt, list[RankObservation]]], rows: _Rows, delivery: str | None
) -> _Decided | None:
    """Decide for the attempts being stopped the common way (`_stopping`) as `_decide`
    does for each, in a fixed number of queries however many: one write of their
    ranks, one of their jobs still marked admitted, and one of the actions they now
    need per kind of action. An attempt whose stop waits on a checkpoint notice is
    left out, to `_decide`. None when the writes failed: nothing of them is kept,
    and the caller decides for them one by one, so one attempt's trouble stays its
    own."""
    if not stopping:
        return _Decided([], set())
    now = timezone.now()
    written = ObservedRanks()
    steps: list[Step] = []
    decided: set[int] = set()
    running: list[int] = []
    for attempt, observations in stopping:
        event = rows.events[attempt.pk]
        ranks = rows.ranks[attempt.pk]
        states = ObservedRanks()
        phases = states.add(ranks, observations)
        alive = [i for i, phase in phases.items() if phase not in TERMINAL_PHASES]
        if (
            alive
            and event.signal_sent_at is None
            and not _evicted_without_notice(attempt, event, delivery, now)
        ):
            continue
        decided.add(attempt.pk)
        written.extend(states)
        if attempt.job.state == JobState.ADMITTED and (
            not alive or all(phase != "starting" for phase in phases.values())
        ):
            running.append(attempt.job_id)
        if not alive:
            steps.append(Step(FINISH, attempt, event))
        elif event.signal_sent_at is None:
            action = (
                Attempt.Action.KILL
                if now >= event.deadline
                and attempt.action == Attempt.Action.SIGNAL
                and attempt.action_tries > 0
                else Attempt.Action.SIGNAL
            )
            steps.append(Step(action, attempt, event, alive=alive))
        elif now >= event.deadline:
            steps.append(Step(Attempt.Action.KILL, attempt, event, alive=alive))
    intended: dict[str, list[int]] = defaultdict(list)
    for step in steps:
        if step.action != FINISH and step.attempt.action != step.action:
            intended[step.action].append(step.attempt.pk)
    try:
        with transaction.atomic():
            written.write()
            if running:
                Job.objects.filter(pk__in=among(running), state=JobState.ADMITTED).update(
                    state=JobState.RUNNING, running_at=now
                )
            for action, pks in intended.items():
                Attempt.objects.filter(pk__in=among(pks), ended_at__isnull=True).update(
                    action=action,
                    action_claimed_at=None,
                    action_tries=0,
                    action_error="",
                    action_not_before=None,
                )
    except SoftTimeLimitExceeded:
        raise
    except Exception:
        if transaction.get_connection().needs_rollback:
            raise
        logger.exception("recording %d stops together failed; one by one", len(decided))
        return None
    for step in steps:
        if step.action != FINISH and step.attempt.action != step.action:
            step.attempt.action, step.attempt.action_tries = step.action, 0
    return _Decided(steps, decided)


def _evicted_without_notice(
    attempt: Attempt, event: PreemptionEvent, delivery: str | None, now: datetime
) -> bool:
    """Whether a stop whose signal has not been sent goes ahead with no checkpoint
    notice first, as `_notice_first` judges it: none is planned for this victim, or
    the notice's window has passed, or the deadline has come with the signal tried."""
    if (
        now >= event.deadline
        and attempt.action == Attempt.Action.SIGNAL
        and attempt.action_tries > 0
    ):
        return True
    if event.notice_deadline is not None:
        return now >= event.notice_deadline
    return notice_plan(event=event, attempt=attempt, delivery=delivery, now=now) is None


def _decide(
    attempt: Attempt,
    observations: list[RankObservation],
    *,
    launched_at: datetime | None,
    taken: bool,
    rows: _Rows,
    delivery: str | None = None,
) -> Step | None:
    """Record what the runtime observed, move the job on, and record the runtime
    action the attempt needs next. Runs inside the pass's decide transaction, after
    `_lock_rows` locked and read `rows`.

    `launched_at` is the attempt's as read before the runtime was observed."""
    job = attempt.job
    now = timezone.now()
    ranks = rows.ranks.get(attempt.pk, {})
    if attempt.ended_at is not None:
        return None
    if attempt.action_claimed_at is not None and attempt.action_claimed_at > now - ACTION_LEASE:
        # Another worker is carrying out this attempt's action right now.
        return None
    event = rows.events.get(attempt.pk)

    if attempt.launched_at is None and event is None:
        # Not launched yet, or a launch that failed half-way and left some of its
        # ranks behind for the runtime to show: the next launch completes it.
        spec = gang_spec(job, attempt, ranks.values())
        return _intend(Step(Attempt.Action.LAUNCH, attempt, spec=spec))
    if not observations:
        if attempt.launched_at is None:
            # Stopped before it ever started: nothing to signal.
            return Step(FINISH, attempt, event)
        if attempt.launched_at != launched_at:
            # Launched by another worker after this pass observed the runtime.
            return None
        # The runtime forgot a gang it launched: its ranks are lost.
        observations = [
            RankObservation(
                job.pk,
                attempt.number,
                r.index,
                r.node,
                "lost",
                None,
                "",
                None,
                now.timestamp(),
                None,
            )
            for r in ranks.values()
        ]
    record_observations(ranks, observations)
    phases = {index: rank.state for index, rank in ranks.items()}
    alive = [i for i, phase in phases.items() if phase not in TERMINAL_PHASES]

    if (job.state == JobState.ADMITTED and not alive) or (
        job.state == JobState.ADMITTED and all(p != "starting" for p in phases.values())
    ):
        Job.objects.filter(pk=job.pk, state=JobState.ADMITTED).update(
            state=JobState.RUNNING, running_at=now
        )

    if event is None and alive:
        stuck = stuck_at_start(attempt, observations, now)
        if stuck:
            event = request_stop(job=job, reason="gang-guard", cause=stuck, grace_seconds=0)
            if event is not None:
                notify(
                    job_id=job.pk,
                    event="preempted",
                    payload={"reason": "gang-guard", "cause": event.cause},
                )

    if event is None:
        broken = [
            r
            for r in ranks.values()
            if r.state == "lost" or (r.state == "exited" and r.exit_code not in (0, None))
        ]
        if (broken or taken) and alive:
            first = broken[0] if broken else None
            if first is None:
                cause = "a rank was taken away by the cluster"
            elif first.state == "lost":
                cause = f"rank {first.index} was lost"
            else:
                cause = rank_end_words(first)
            event = request_stop(job=job, reason="gang-guard", cause=f"gang guard: {cause}")
            if event is not None:
                notify(
                    job_id=job.pk,
                    event="preempted",
                    payload={"reason": "gang-guard", "cause": event.cause},
                )

    if event is not None and alive:
        if event.signal_sent_at is None:
            if (
                now >= event.deadline
                and attempt.action == Attempt.Action.SIGNAL
                and attempt.action_tries > 0
            ):
                # The signal has not got through by the deadline (a
                # PodDisruptionBudget refusing the evictions): the deadline wins,
                # as it does for a rank that ignores SIGTERM.
                return _intend(Step(Attempt.Action.KILL, attempt, event, alive=alive))
            held, notice = _notice_first(attempt, event, alive, delivery, now)
            if held:
                return notice
            return _intend(Step(Attempt.Action.SIGNAL, attempt, event, alive=alive))
        if now >= event.deadline:
            return _intend(Step(Attempt.Action.KILL, attempt, event, alive=alive))
        return None
    if not alive:
        return Step(FINISH, attempt, event)
    return None


def _notice_first(
    attempt: Attempt,
    event: PreemptionEvent,
    alive: list[int],
    delivery: str | None,
    now: datetime,
) -> tuple[bool, Step | None]:
    """Whether the eviction still waits for the checkpoint notice, and the notice
    to deliver now if any (see preemption.notice). The eviction goes ahead when
    the victim gets no notice, when its ranks committed a checkpoint that
    answered it (the first rank's report, see `notice_committed_at`), or at the
    notice deadline."""
    if event.notice_deadline is None:
        plan = notice_plan(event=event, attempt=attempt, delivery=delivery, now=now)
        if plan is None:
            return False, None
        PreemptionEvent.objects.filter(pk=event.pk, notice_deadline__isnull=True).update(
            notice_deadline=plan.deadline
        )
        event.notice_deadline = plan.deadline
        step = Step(Attempt.Action.NOTICE, attempt, event, alive=alive, notice_signal=plan.signal)
        return True, _intend(step)
    if now >= event.notice_deadline:
        return False, None
    if event.notice_sent_at is None:
        # Not delivered yet: a temporary runtime error is tried again until the deadline.
        signal = announced_notice(attempt, delivery)
        if signal is None:
            return False, None
        step = Step(Attempt.Action.NOTICE, attempt, event, alive=alive, notice_signal=signal)
        return True, _intend(step)
    if event.notice_committed_at is not None:
        return False, None  # recorded by the events endpoint as the commit came in
    if record_notice_commit(event, attempt) is None:
        return True, None
    return False, None


def _intend(step: Step) -> Step:
    """Record the action on the attempt; a new action starts its tries afresh."""
    if step.attempt.action != step.action:
        Attempt.objects.filter(pk=step.attempt.pk, ended_at__isnull=True).update(
            action=step.action,
            action_claimed_at=None,
            action_tries=0,
            action_error="",
            action_not_before=None,
        )
        step.attempt.action, step.attempt.action_tries = step.action, 0
    return step
