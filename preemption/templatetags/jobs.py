"""Filters that write job figures the way the jobs table shows them."""

from __future__ import annotations

from datetime import timedelta

from django import template

from preemption.models import Job
from preemption.reasons import why_waiting as waiting_words

register = template.Library()


@register.filter
def why_waiting(job: Job) -> str:
    """Why a waiting job waits, worded by `preemption.reasons.why_waiting`."""
    return waiting_words(job)


@register.filter
def duration(value: timedelta | None) -> str:
    """A run time in its two largest units: "45 s", "12 min 5 s", "3 h 20 min",
    "2 d 4 h"; an empty value (never admitted) is a dash."""
    if value is None:
        return "—"
    seconds = max(int(value.total_seconds()), 0)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    if minutes:
        return f"{minutes} min {seconds} s"
    return f"{seconds} s"


@register.filter
def seconds(value: float | None) -> str:
    """A number of seconds as `duration` writes it, with a tenth under a minute (a
    checkpoint interval of 7.7 s); a dash for none."""
    if value is None:
        return "—"
    if value < 60:
        return f"{value:.1f} s"
    return duration(timedelta(seconds=value))


@register.filter
def hours(value: timedelta | None) -> str:
    """GPU time in hours with two decimals; a dash when there is none."""
    if value is None:
        return "—"
    return f"{value.total_seconds() / 3600:.2f}"
