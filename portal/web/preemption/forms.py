"""The job history's filters; the team choices are the user's readable teams."""

from __future__ import annotations

from datetime import datetime, time
from typing import Any

from django import forms
from django.db.models import QuerySet
from django.utils import timezone

from core.access import Access
from preemption.models import Job, JobState
from quotas.models import Team


class JobFilterForm(forms.Form):
    """Filters of the job history; the team choices are the user's readable teams."""

    team = forms.ChoiceField(required=False)
    user = forms.CharField(required=False, max_length=150, label="Submitted by")
    state = forms.ChoiceField(required=False, choices=[("", "any state"), *JobState.choices])
    since = forms.DateField(
        required=False, widget=forms.DateInput(attrs={"type": "date"}), label="Submitted from"
    )
    until = forms.DateField(
        required=False, widget=forms.DateInput(attrs={"type": "date"}), label="to"
    )
    q = forms.CharField(required=False, max_length=200, label="Name or command")
    mine = forms.BooleanField(required=False, label="Only jobs I submitted")

    def __init__(self, *args: Any, access: Access, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.user_id = access.user_id
        teams = Team.objects.order_by("slug")
        if not access.is_admin:
            teams = teams.filter(id__in=access.readable_teams)
        self.fields["team"].choices = [
            ("", "all my teams" if not access.is_admin else "all teams")
        ] + [(slug, slug) for slug in teams.values_list("slug", flat=True)]
        self.fields["user"].widget.attrs["placeholder"] = "username"
        self.fields["q"].widget.attrs.update({"placeholder": "search", "type": "search"})

    def apply(self, jobs: QuerySet[Job]) -> QuerySet[Job]:
        """Narrow an already scoped queryset by the chosen filters."""
        data = self.cleaned_data
        if data.get("team"):
            jobs = jobs.filter(team__slug=data["team"])
        if data.get("mine"):
            jobs = jobs.filter(submitter_id=self.user_id)
        if data.get("user"):
            jobs = jobs.filter(submitter__username=data["user"].strip())
        if data.get("state"):
            jobs = jobs.filter(state=data["state"])
        zone = timezone.get_current_timezone()
        if data.get("since"):
            jobs = jobs.filter(submitted_at__gte=datetime.combine(data["since"], time.min, zone))
        if data.get("until"):
            jobs = jobs.filter(submitted_at__lte=datetime.combine(data["until"], time.max, zone))
        return jobs
