"""Filters that word a job for people: its state as the pages say it and its
command as it was typed (the model keeps what the scheduler and `sh` need)."""

from __future__ import annotations

from django import template

from preemption.models import Job
from preemption.reasons import job_state_words
from preemption.typed_command import command_as_typed

register = template.Library()


@register.filter
def state_words(job: Job, stop_reason: str = "") -> str:
    """`job|state_words` or, where the page knows the stop under way,
    `job|state_words:stop.reason`; worded by `preemption.reasons.job_state_words`."""
    return job_state_words(job, stop_reason=stop_reason or "")


@register.filter
def as_typed(command: str) -> str:
    """The command in the quotes its submitter would have typed."""
    return command_as_typed(command)
