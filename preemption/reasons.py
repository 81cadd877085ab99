"""Why a job was (or would be) preempted, in words a researcher understands.

The one place that words a preemption's reason, and why a job waits. The scheduling cycle stores
these words as the event's `cause` when it decides; the job page, the
dashboard, the API's `why` field (which `qm show` prints) and the quota
preview all word the same facts through `preemption_words`, so a page never
shows two wordings or two numbers for one preemption.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from django.utils import timezone

import fairshare
from preemption.models import WAITING_STATES, Job, JobState, PreemptionEvent, Rank
from preemption.runtimes.sandbox import format_size

Reason = PreemptionEvent.Reason


@dataclass(frozen=True)
class Preemptor:
    """The facts about the job that needed the GPUs which the words use."""

    id: int
    team: str
    priority_class: str
    gpus: int

    @classmethod
    def of(cls, job: Job) -> Preemptor:
        return cls(
            id=job.pk, team=job.team.slug, priority_class=job.priority_class.name, gpus=job.gpus
        )


def preemption_words(
    *, reason: str, preemptor: Preemptor | None, victim_gpus: int, cause: str = ""
) -> str:
    """The reason in words, lower case and without a full stop (pages add both).

    `cause` is what the stop recorded: the rank that died for the gang guard,
    the person who cancelled, or these very words when the preemptor has since
    been deleted.
    """
    if reason == Reason.RECLAIM:
        if preemptor is not None:
            return f"reclaimed by {preemptor.team}, {preemptor.gpus} GPUs under its guarantee"
        return cause or "reclaimed by its lender"
    if reason == Reason.PRIORITY:
        if preemptor is not None:
            return (
                f"preempted by job {preemptor.id} of {preemptor.team} "
                f"({preemptor.priority_class}, a higher priority), {preemptor.gpus} GPUs"
            )
        return cause or "preempted by a higher-priority job"
    if reason == Reason.FAIR_SHARE:
        if preemptor is not None:
            return (
                f"gave {victim_gpus} GPUs back to {preemptor.team}, "
                "which was below its fair share of the surplus"
            )
        return cause or "gave its GPUs back to a team below its fair share of the surplus"
    if reason == Reason.CONSOLIDATE:
        if preemptor is not None:
            return (
                f"moved so that job {preemptor.id} of {preemptor.team} ({preemptor.gpus} GPUs) "
                "fits on one node inside its guarantee; it restarts at once on GPUs free elsewhere"
            )
        return (
            cause or "moved to GPUs free elsewhere, so that a larger job fits inside its guarantee"
        )
    if reason == Reason.GANG_GUARD:
        return cause or "a rank of the gang died, so the others were stopped gracefully"
    if reason == Reason.MANUAL:
        return cause or "stopped by a person"
    if reason == Reason.RESIZE:
        # The engine's own words, which name the sizes and why.
        return cause or "resized"
    return cause or reason


# Stops that are no preemption: the job is not giving GPUs back to anyone.
_STOPPING_WORDS = {
    Reason.MANUAL: "Cancelling",
    Reason.GANG_GUARD: "Stopping",
    Reason.SHUTDOWN: "Stopping",
    # Stopped at an agreed step to be relaunched at once at another size.
    Reason.RESIZE: "Resizing",
}


def job_state_words(job: Job, *, stop_reason: str = "") -> str:
    """The job's state as pages show it. The model keeps one state, `preempting`, for
    every graceful stop; a person reads "Cancelling" when the job stops because it was
    cancelled (whatever stop was already under way: a cancelled job is never requeued),
    and "Stopping" for a stop that takes its GPUs for nobody (the gang guard, the
    portal's shutdown). `stop_reason` is the stop's reason where the page knows it."""
    if job.state != JobState.PREEMPTING:
        return job.get_state_display()
    if job.cancel_requested_at is not None:
        return _STOPPING_WORDS[Reason.MANUAL]
    return _STOPPING_WORDS.get(stop_reason, job.get_state_display())


def _victim_gpus(event: PreemptionEvent) -> int:
    """The GPUs the preempted attempt held. Only an elastic job's attempt may hold
    fewer than the job asks for, so only its attempt is read."""
    job = event.job
    if job.ranks_min is None or not event.victim_attempt_id:
        return job.gpus
    return event.victim_attempt.world_size * job.gpus_per_rank


def describe_preemption(event: PreemptionEvent) -> str:
    """Why this preemption happened, from the event's own facts."""
    preemptor = event.preemptor
    return preemption_words(
        reason=event.reason,
        preemptor=Preemptor.of(preemptor) if preemptor is not None else None,
        victim_gpus=_victim_gpus(event) if event.job_id else 0,
        cause=event.cause,
    )


def rank_end_words(rank: Rank) -> str:
    """How a failed rank ended, as the job's failure, the gang guard's cause, the job
    page, the API and `qm show` say it, lower case and without a full stop: "rank 1 was
    killed: it used more than its memory limit of 2 GiB" where the runtime saw the
    kernel's OOM killer end it, "rank 0 was evicted by its node: ..." where a kubelet
    evicted it for its disk; else its exit code."""
    if rank.end_reason == Rank.EndReason.OUT_OF_MEMORY and rank.memory_limit:
        return (
            f"rank {rank.index} was killed: it used more than its memory limit of "
            f"{format_size(rank.memory_limit)}"
        )
    if rank.end_reason == Rank.EndReason.DISK_LIMIT:
        return (
            f"rank {rank.index} was evicted by its node: it wrote more than its "
            "ephemeral-storage limit"
        )
    return f"rank {rank.index} exited with code {rank.exit_code}"


# What took a rank away, by the reason of its pod's DisruptionTarget condition, said
# of the rank's node (one node, several): an eviction through the API is what
# `kubectl drain` makes.
_DISRUPTED_NODE_WORDS = {
    "EvictionByEvictionAPI": ("was drained", "were drained"),
    "PreemptionByScheduler": (
        "gave a rank's GPUs to a higher-priority pod",
        "gave ranks' GPUs to higher-priority pods",
    ),
    "DeletionByTaintManager": ("was lost", "were lost"),
    "TerminationByKubelet": ("stopped its pods", "stopped their pods"),
}


def _nodes(names: list[str]) -> str:
    if len(names) == 1:
        return f"node {names[0]}"
    return f"nodes {', '.join(names[:-1])} and {names[-1]}"


def disruption_words(*, nodes: dict[int, str], taken: dict[int, str], received: list[int]) -> str:
    """Why a gang that ended on a stop nobody in the control plane ordered is requeued
    rather than done, lower case: "disrupted: node h100-node-2 was drained".

    `nodes` is each rank's node; `taken` the ranks the runtime saw taken away, with
    the reason it saw (a DisruptionTarget condition's, or "Evicted: <message>" from a
    kubelet); `received` the ranks whose trap reported a signal that was never sent."""
    by_reason: dict[str, list[str]] = {}
    said: list[str] = []
    for rank in sorted(taken):
        node = nodes.get(rank, "") or "?"
        reason = taken[rank]
        if reason in _DISRUPTED_NODE_WORDS:
            named = by_reason.setdefault(reason, [])
            if node not in named:
                named.append(node)
        elif reason.startswith("Evicted:"):
            message = reason.removeprefix("Evicted:").strip()
            said.append(f"node {node} evicted rank {rank}" + (f": {message}" if message else ""))
        else:
            said.append(f"rank {rank} on node {node} was taken away ({reason})")
    for reason, named in by_reason.items():
        one, several = _DISRUPTED_NODE_WORDS[reason]
        said.insert(0, f"{_nodes(sorted(named))} {one if len(named) == 1 else several}")
    if not said:
        ranks = sorted(received)
        where = sorted({nodes.get(rank, "") or "?" for rank in ranks})
        said.append(
            f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} on "
            f"{_nodes(where)} got a stop signal that Quartermaster did not send"
        )
    return "disrupted: " + "; ".join(said)


def disruption_requeue_words(
    disruption: str, *, checkpoint_step: int | None, resume_step: int | None
) -> str:
    """Why a disrupted job waits, and where it resumes (see `disruption_words`)."""
    if checkpoint_step is not None:
        where = f"requeued from its checkpoint at step {checkpoint_step}"
    elif resume_step is not None:
        where = f"requeued; resumes at step {resume_step}"
    else:
        where = "requeued with no checkpoint, so it starts over"
    return f"{disruption}; {where}"


def protection_words(until: datetime) -> str:
    """A waiting job whose only possible victims are protected by their minimum runtime,
    said with the moment the protection ends (hours and minutes, UTC)."""
    return (
        f"until {until.astimezone(UTC):%H:%M} UTC: the only jobs it could preempt are "
        "protected by their minimum runtime until then"
    )


def why_waiting(job: Job, *, now: datetime | None = None) -> str:
    """Why a waiting job waits, as every page and the API say it: the scheduler's reason,
    led by until when it waits where minimum runtimes are all that keep it out. Empty
    for a job that does not wait."""
    if job.state not in WAITING_STATES:
        return ""
    reason = job.waiting_reason or "waiting for the next scheduling cycle"
    now = now or timezone.now()
    if job.protected_until is not None and job.protected_until > now:
        return f"{protection_words(job.protected_until)} ({reason})"
    return reason


def usage_words(
    *, team: str, flavor: str, status: fairshare.QueueStatus, half_life_seconds: float
) -> str:
    """Decayed usage as the reason a team's fair share of one flavor is smaller, from its
    status in a plan; worded by the engine's own sentence, so the quota preview and a
    waiting job's reason read alike."""
    return fairshare.usage_words(
        team=team,
        flavor=flavor,
        ratio=status.usage_ratio,
        fair_share=status.fair_share,
        weight_fair_share=status.weight_fair_share,
        half_life_seconds=half_life_seconds,
    )


def usage_lowers_share(status: fairshare.QueueStatus) -> bool:
    """Whether decayed usage made this queue's fair share smaller than its weight's."""
    return status.usage_ratio > 1 and status.fair_share < status.weight_fair_share - 1e-6


def free_by(event: PreemptionEvent) -> datetime:
    """When the victim's GPUs are free at the latest.

    A victim that is sent a checkpoint notice first waits for its commit at most
    until the notice deadline, then gets what is left of its grace window after the
    eviction. The kill deadline bounds both, so the notice never frees the GPUs
    later than the grace window alone would.
    """
    return event.deadline


def _clock(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%H:%M:%S UTC")


def release_words(event: PreemptionEvent, now: datetime) -> str:
    """How the victim is giving its GPUs back and when they are free at the latest,
    lower case and without a full stop. Absolute times, so that the words stay the
    same from one cycle to the next."""
    free = f"its GPUs are free by {_clock(free_by(event))} at the latest"
    if (
        event.signal_sent_at is None
        and event.notice_deadline is not None
        and event.notice_deadline > now
    ):
        return (
            f"job {event.job_id} is checkpointing on notice until {_clock(event.notice_deadline)} "
            f"at the latest, then stops; {free}"
        )
    return f"job {event.job_id} is stopping; {free}"
