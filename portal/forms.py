"""Forms of the portal's pages: job filters, API tokens, telemetry periods.

Forms only parse what a person typed; every rule about the data lives in the
services, whose messages the pages show unchanged.
"""

from __future__ import annotations

from datetime import datetime, time
from typing import Any

from django import forms
from django.conf import settings
from django.db.models import QuerySet
from django.utils import timezone

from preemption.models import Job, JobState
from quotas.models import Team
from quotas.selectors import Access

PERIODS = (
    ("1h", "last hour"),
    ("24h", "last 24 hours"),
    ("7d", "last 7 days"),
    ("30d", "last 30 days"),
)


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

    def __init__(self, *args: Any, access: Access, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
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


class ApiTokenForm(forms.Form):
    """A new API token: its name, how many days it lasts, and whether it may only read."""

    name = forms.CharField(
        max_length=100,
        widget=forms.TextInput(attrs={"placeholder": "e.g. laptop qm", "autocomplete": "off"}),
    )
    # Left empty, the portal's default lifetime applies (the service fills it in).
    days = forms.IntegerField(min_value=1, required=False, label="Lasts (days)")
    read_only = forms.BooleanField(required=False, label="Read only (GET requests only)")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["days"].initial = settings.QM_TOKEN_DEFAULT_DAYS
        self.fields["days"].max_value = settings.QM_TOKEN_MAX_DAYS
        self.fields["days"].widget.attrs["max"] = settings.QM_TOKEN_MAX_DAYS


class PeriodForm(forms.Form):
    """The period the telemetry page charts and totals."""

    period = forms.ChoiceField(choices=PERIODS, required=False, initial="24h")
    flavor = forms.ChoiceField(required=False)
    team = forms.ChoiceField(required=False)

    def __init__(
        self, *args: Any, flavors: list[str], teams: list[str] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.fields["flavor"].choices = [(name, name) for name in flavors]
        # Only the reader's own teams are offered, and only they validate.
        self.fields["team"].choices = [("", "my teams")] + [(slug, slug) for slug in teams or []]

    def chosen_team(self) -> str:
        """The chosen team's slug, or "" for the default of the reader's teams."""
        return str(self.cleaned_data.get("team") or "") if self.is_valid() else ""

    def chosen(self, flavors: list[str]) -> tuple[str, str]:
        """The chosen (period, flavor), with defaults for anything missing or invalid."""
        period, flavor = "24h", flavors[0] if flavors else ""
        if self.is_valid():
            period = self.cleaned_data.get("period") or period
            flavor = self.cleaned_data.get("flavor") or flavor
        return period, flavor
