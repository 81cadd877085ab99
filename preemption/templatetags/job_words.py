"""Filters that word a job for people: its state as the pages say it and its
command as it was typed (the model keeps what the scheduler and `sh` need)."""

from __future__ import annotations

from django import template

from preemption.models import Job, Rank
from preemption.reasons import job_state_words, rank_end_words
from preemption.typed_command import command_as_typed

register = template.Library()


@register.filter
def state_words(job: Job, stop_reason: str = "") -> str:
    """`job|state_words` or, where the page knows the stop under way,
    `job|state_words:stop.reason`; worded by `preemption.reasons.job_state_words`."""
    return job_state_words(job, stop_reason=stop_reason or "")


@register.filter
def end_words(rank: Rank) -> str:
    """`rank|end_words`: why the rank ended where the runtime knows (the OOM killer),
    worded by `preemption.reasons.rank_end_words`; empty otherwise."""
    return rank_end_words(rank) if rank.end_reason else ""


@register.filter
def as_typed(command: str) -> str:
    """The command in the quotes its submitter would have typed."""
    return command_as_typed(command)
