"""Every read of jobs and their history, scoped to the asking user."""

from __future__ import annotations

from django.db.models import QuerySet

from core.access import User
from preemption.models import Attempt, Checkpoint, Job, PreemptionEvent, Rank, Webhook
from quotas.selectors import access_for


def _readable(user: User) -> set[int] | None:
    """Team ids whose jobs the user may read, or None for everything."""
    access = access_for(user)
    if access.is_admin:
        return None
    return access.readable_teams


def job_list(
    *,
    user: User,
    team_id: int | None = None,
    state: str | None = None,
    submitter_id: int | None = None,
) -> QuerySet[Job]:
    queryset = Job.objects.select_related("team", "submitter", "priority_class", "flavor")
    teams = _readable(user)
    if teams is not None:
        queryset = queryset.filter(team_id__in=teams)
    if team_id is not None:
        queryset = queryset.filter(team_id=team_id)
    if state:
        queryset = queryset.filter(state=state)
    if submitter_id is not None:
        queryset = queryset.filter(submitter_id=submitter_id)
    return queryset


def attempt_list(*, user: User) -> QuerySet[Attempt]:
    queryset = Attempt.objects.select_related("job")
    teams = _readable(user)
    return queryset if teams is None else queryset.filter(job__team_id__in=teams)


def rank_list(*, user: User) -> QuerySet[Rank]:
    queryset = Rank.objects.select_related("attempt")
    teams = _readable(user)
    return queryset if teams is None else queryset.filter(attempt__job__team_id__in=teams)


def preemption_event_list(*, user: User) -> QuerySet[PreemptionEvent]:
    """Preemptions the user may read; a person's cancel is not one of them."""
    queryset = PreemptionEvent.objects.preemptions().select_related(
        "job",
        "job__team",
        "preemptor",
        "preemptor__team",
        "preemptor__priority_class",
        "victim_attempt",
    )
    teams = _readable(user)
    return queryset if teams is None else queryset.filter(job__team_id__in=teams)


def checkpoint_list(*, user: User) -> QuerySet[Checkpoint]:
    queryset = Checkpoint.objects.select_related("job", "attempt")
    teams = _readable(user)
    return queryset if teams is None else queryset.filter(job__team_id__in=teams)


def webhook_list(*, user: User) -> QuerySet[Webhook]:
    access = access_for(user)
    queryset = Webhook.objects.select_related("team")
    if access.is_admin:
        return queryset
    return queryset.filter(team_id__in=access.tree.subtree(access.managed))
