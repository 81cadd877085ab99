"""Why a job was (or would be) preempted, in words a researcher understands.

The one place that words a preemption's reason. The scheduling cycle stores
these words as the event's `cause` when it decides; the job page, the
dashboard, the API's `why` field (which `qm show` prints) and the quota
preview all word the same facts through `preemption_words`, so a page never
shows two wordings or two numbers for one preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

from preemption.models import Job, PreemptionEvent

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
    return cause or reason


def describe_preemption(event: PreemptionEvent) -> str:
    """Why this preemption happened, from the event's own facts."""
    preemptor = event.preemptor
    return preemption_words(
        reason=event.reason,
        preemptor=Preemptor.of(preemptor) if preemptor is not None else None,
        victim_gpus=event.job.gpus if event.job_id else 0,
        cause=event.cause,
    )
