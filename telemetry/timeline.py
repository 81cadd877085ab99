"""The story of one preemption, from its decision to the resumed attempt.

A job may be preempted many times, and its attempts also report trap events
that belong to no preemption (a regular checkpoint every N steps). A timeline
therefore takes only what happened from its own decision on: the victim
attempt's trap events at or after `decided_at`, the resume step the
preemption recorded when it requeued the job (never the job's current one),
and the resume reported by the next attempt. Offsets are seconds after the
decision, so none is negative.

A resize of an elastic gang is told the same way, from "Resize decided" to the
attempt it was relaunched as at its new size, with no requeue between.

A person's cancel of a running job goes through the same graceful stop, and is
told with the same steps but as what it is: "Cancel requested", the exit codes
without a preemption outcome (a workload without the trap exits 143 on
SIGTERM, which is the expected end of a cancel), and never a requeue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from preemption.models import Attempt, PreemptionEvent, Rank, TrapEvent


@dataclass
class TimelineStep:
    """One moment of a preemption, with its offset from the decision."""

    at: datetime | None
    title: str
    detail: str = ""
    kind: str = "info"  # info | good | warn | bad
    offset: float | None = None


@dataclass
class RankStory:
    """What one rank did during a preemption."""

    index: int
    node: str
    signal_sent: float | None
    signal_received: float | None
    exited: float | None
    exit_code: int | None
    # Another rank's signal, passed on by the gang's relay before this rank's own came.
    heard: float | None = None
    heard_from: int | None = None


@dataclass
class Timeline:
    """A preemption told from the decision to the resume."""

    event: PreemptionEvent
    words: str
    steps: list[TimelineStep] = field(default_factory=list)
    ranks: list[RankStory] = field(default_factory=list)


def _seconds_after(moment: datetime | None, origin: datetime) -> float | None:
    return None if moment is None else (moment - origin).total_seconds()


def _moment(unix: float) -> datetime:
    return datetime.fromtimestamp(unix, tz=UTC)


def _since(moment: datetime | None, origin: datetime) -> datetime | None:
    """`moment` when it is at or after `origin`; earlier ones belong to another story."""
    return moment if moment is not None and moment >= origin else None


def _signal_sent_at(event: PreemptionEvent, ranks: list[Rank]) -> datetime | None:
    """The first moment the signal went out: the preemption's own record or a
    rank's, whichever is earlier (a runtime may stamp each rank as it signals)."""
    moments = [event.signal_sent_at] + [rank.signal_sent_at for rank in ranks]
    known = [moment for moment in moments if moment is not None]
    return min(known) if known else None


def _saved(payload: dict[str, object], step: int | None) -> str:
    """ "step 41, 50.0 MB in 2.00 s" from a commit's payload."""
    detail = f"step {step}"
    size = payload.get("bytes")
    if isinstance(size, int | float) and size:
        detail += f", {size / 1e6:.1f} MB"
    seconds = payload.get("seconds")
    if isinstance(seconds, int | float):
        detail += f" in {seconds:.2f} s"
    return detail


def _notice_steps(
    timeline: Timeline,
    event: PreemptionEvent,
    origin: datetime,
    ranks: list[Rank],
    answers: list[TrapEvent],
) -> None:
    """The checkpoint notice, when one was sent: sent, then answered by the ranks'
    commit (the first rank's report: they commit together), or the window ran out."""
    sent = _since(event.notice_sent_at, origin)
    if sent is None:
        return
    window = (
        f"; the eviction follows their commit, at the latest at {event.notice_deadline:%H:%M:%S}"
        if event.notice_deadline is not None
        else ""
    )
    timeline.steps.append(
        TimelineStep(
            sent,
            f"Checkpoint notice sent to all {len(ranks)} ranks",
            f"they checkpoint while training goes on{window}",
        )
    )
    if answers:
        first = min(answers, key=lambda e: e.at)
        detail = _saved(first.payload or {}, first.step)
        if (first.payload or {}).get("background"):
            detail += ", written in the background"
        timeline.steps.append(
            TimelineStep(_moment(first.at), "The notice's checkpoint committed", detail, "good")
        )
    elif event.notice_deadline is not None and event.signal_sent_at is not None:
        timeline.steps.append(
            TimelineStep(
                event.notice_deadline,
                "Notice window over: no rank had committed a checkpoint",
                "the eviction went ahead as without a notice",
                "warn",
            )
        )


def build_timeline(
    *,
    event: PreemptionEvent,
    attempt: Attempt,
    next_attempt: Attempt | None,
    events: list[TrapEvent],
    words: str,
) -> Timeline:
    """Order everything known about one preemption (or cancel) into steps:
    decision → signal → checkpoint → exit → requeue → resume. `events` may
    hold every trap event of the job; `words` says why it was stopped."""
    origin = event.decided_at
    cancel = event.is_cancel
    resize = event.reason == PreemptionEvent.Reason.RESIZE
    timeline = Timeline(event=event, words=words)
    steps = timeline.steps
    steps.append(
        TimelineStep(
            origin,
            "Cancel requested" if cancel else "Resize decided" if resize else "Preemption decided",
            f"{words}. Grace window {event.grace_seconds:g} s, deadline {event.deadline:%H:%M:%S}.",
            "info" if cancel else "warn",
        )
    )
    ranks = list(attempt.rank_set.all())
    sent = _since(_signal_sent_at(event, ranks), origin)
    if sent is not None:
        steps.append(TimelineStep(sent, f"Signal sent to all {len(ranks)} ranks"))
    mine = [
        e
        for e in events
        if e.attempt == attempt.number and e.job_id == event.job_id and _moment(e.at) >= origin
    ]
    received_by_rank: dict[int, datetime] = {}
    for rank in ranks:
        moment = _since(rank.signal_received_at, origin)
        if moment is not None:
            received_by_rank[rank.index] = moment
    heard_by_rank: dict[int, tuple[datetime, int | None]] = {}
    for trap in mine:
        if trap.event == "signal_received":
            received_by_rank.setdefault(trap.rank, _moment(trap.at))
        elif trap.event == "stop_heard":
            sender = (trap.payload or {}).get("from_rank")
            heard_by_rank.setdefault(
                trap.rank, (_moment(trap.at), sender if isinstance(sender, int) else None)
            )
    if received_by_rank:
        first, last = min(received_by_rank.values()), max(received_by_rank.values())
        heard = len(received_by_rank)
        steps.append(
            TimelineStep(
                last,
                f"Every rank received the signal ({heard} of {len(ranks)})"
                if heard == len(ranks)
                else f"{heard} of {len(ranks)} ranks received the signal",
                f"first after {(first - origin).total_seconds():.2f} s, "
                f"spread {(last - first).total_seconds():.2f} s",
                "good" if heard == len(ranks) else "warn",
            )
        )
    _relayed_step(steps, origin, received_by_rank, heard_by_rank, len(ranks))
    # The eviction's own save starts once the signal reached the ranks. A save that
    # started before (the notice's, taken while training went on, or a regular one
    # in flight at the decision) is not it; the notice's commits say so, and their
    # steps name the saves that started for them.
    answers = [
        e for e in mine if e.event == "checkpoint_committed" and (e.payload or {}).get("notice")
    ]
    notice_steps = {e.step for e in answers}
    _notice_steps(timeline, event, origin, ranks, answers)
    signalled = _signal_sent_at(event, ranks)
    reached = min(received_by_rank.values()) if received_by_rank else signalled
    earlier = {
        e.step
        for e in events
        if e.attempt == attempt.number
        and e.job_id == event.job_id
        and e.event == "checkpoint_started"
        and reached is not None
        and e.at < reached.timestamp()
    }
    mine = [
        e
        for e in mine
        if not (
            e.event in ("checkpoint_started", "checkpoint_committed")
            and (e.step in notice_steps or e.step in earlier)
        )
    ]
    started = [e for e in mine if e.event == "checkpoint_started"]
    if started:
        steps.append(
            TimelineStep(
                _moment(min(e.at for e in started)),
                "Checkpoint started",
                f"step {started[0].step}" if started[0].step is not None else "",
            )
        )
    committed = [e for e in mine if e.event == "checkpoint_committed"]
    if committed:
        detail = _saved(committed[-1].payload or {}, committed[-1].step)
        steps.append(
            TimelineStep(
                _moment(max(e.at for e in committed)), "Checkpoint committed", detail, "good"
            )
        )
    elif event.checkpoint_step is not None and event.checkpoint_step not in notice_steps:
        # Known from the preemption's record only (the events are gone or came late);
        # a notice's checkpoint has its own line above.
        detail = f"step {event.checkpoint_step}"
        if event.checkpoint_seconds is not None:
            detail += f" in {event.checkpoint_seconds:.2f} s"
        steps.append(TimelineStep(None, "Checkpoint committed", detail, "good"))
    skipped = [e for e in mine if e.event == "checkpoint_skipped"]
    if skipped:
        reason = (skipped[0].payload or {}).get("reason", "not enough time left in the grace")
        steps.append(
            TimelineStep(_moment(skipped[0].at), "Checkpoint skipped", str(reason), "warn")
        )
    exits = [r.exited_at for r in ranks if r.exited_at is not None]
    all_exited = event.all_exited_at or (max(exits) if exits else None)
    # The kill is stamped once the runtime's call returned, after the exits it caused
    # (a killed rank's exit is recorded by its keeper as it happens). Some rank was
    # still alive when the kill went out, so the kill came no later than the last
    # exit: told at that moment at the latest, and before it, it reads as the cause.
    killed = (
        min(event.killed_at, all_exited)
        if event.killed_at and all_exited is not None
        else event.killed_at
    )
    if killed and event.outcome == "forced-past-budget":
        steps.append(
            TimelineStep(
                killed,
                "Deadline passed: forced past a disruption budget",
                "a PodDisruptionBudget still refused the eviction, so every rank was deleted",
                "bad",
            )
        )
    elif killed:
        steps.append(TimelineStep(killed, "Deadline passed: remaining ranks killed", "", "bad"))
    if all_exited is not None:
        codes = sorted({r.exit_code for r in ranks if r.exit_code is not None})
        detail = f"exit codes {', '.join(str(c) for c in codes) or 'unknown'}"
        if cancel:
            kind = "warn" if event.killed_at else "info"
        else:
            if event.outcome:
                detail += f"; outcome {event.get_outcome_display().lower()}"
            kind = (
                "good"
                if codes == [0] and event.outcome not in ("killed", "forced-past-budget")
                else "bad"
            )
        steps.append(TimelineStep(all_exited, "Every rank exited", detail, kind))
    if event.requeued_at and not cancel:
        steps.append(
            TimelineStep(
                event.requeued_at,
                "Requeued",
                f"resumes from step {event.resume_step}"
                if event.resume_step is not None
                else "no checkpoint: starts over",
            )
        )
    if resize and next_attempt is not None:
        # A resize never waits in the queue: the job is relaunched as the ranks exit.
        steps.append(
            TimelineStep(
                next_attempt.admitted_at,
                f"Relaunched at {next_attempt.world_size} ranks",
                f"attempt {next_attempt.number}"
                + (f", resumes from step {event.resume_step}" if event.resume_step else ""),
            )
        )
    if not cancel and (event.resumed_at or next_attempt is not None):
        resumed = [
            e
            for e in events
            if next_attempt is not None
            and e.attempt == next_attempt.number
            and e.job_id == event.job_id
            and e.event == "resumed"
        ]
        detail = f"attempt {next_attempt.number}" if next_attempt is not None else ""
        if resumed and resumed[0].step is not None:
            detail += f", from step {resumed[0].step}"
        at = event.resumed_at or (next_attempt.admitted_at if next_attempt is not None else None)
        steps.append(TimelineStep(at, "Resumed", detail, "good"))
    for step in steps:
        step.offset = _seconds_after(step.at, origin)
    # Stable: steps at the same moment keep the order they were told in, cause first.
    steps.sort(key=lambda step: (step.offset is None, step.offset or 0.0))
    for rank in ranks:
        timeline.ranks.append(
            RankStory(
                index=rank.index,
                node=rank.node,
                signal_sent=_seconds_after(_since(rank.signal_sent_at, origin), origin),
                signal_received=_seconds_after(received_by_rank.get(rank.index), origin),
                exited=_seconds_after(_since(rank.exited_at, origin), origin),
                exit_code=rank.exit_code,
                heard=_seconds_after(heard_by_rank[rank.index][0], origin)
                if rank.index in heard_by_rank
                else None,
                heard_from=heard_by_rank[rank.index][1] if rank.index in heard_by_rank else None,
            )
        )
    return timeline


def _relayed_step(
    steps: list[TimelineStep],
    origin: datetime,
    received: dict[int, datetime],
    heard: dict[int, tuple[datetime, int | None]],
    world_size: int,
) -> None:
    """The moment every rank knew of the stop, where the gang's relay told some ranks
    of another's signal before their own came (gracetrap's `stop_heard`)."""
    if not heard:
        return
    told = dict(received)
    for rank, (moment, _) in heard.items():
        told[rank] = min(moment, told.get(rank, moment))
    last = max(told.values())
    senders = sorted({sender for _, sender in heard.values() if sender is not None})
    source = f"rank {senders[0]}'s signal" if len(senders) == 1 else "another rank's signal"
    knew = len(told)
    steps.append(
        TimelineStep(
            last,
            f"Every rank knew of the stop ({knew} of {world_size})"
            if knew == world_size
            else f"{knew} of {world_size} ranks knew of the stop",
            f"{len(heard)} heard of {source} through the gang's relay; "
            f"the last knew after {(last - origin).total_seconds():.2f} s",
            "good" if knew == world_size else "warn",
        )
    )
