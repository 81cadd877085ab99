"""The period (and flavor) the telemetry page charts and totals."""

from __future__ import annotations

from typing import Any

from django import forms

from telemetry.history_selectors import AUTO_PERIOD

PERIODS = (
    (AUTO_PERIOD, "since sampling began (1 to 24 hours)"),
    ("1h", "last hour"),
    ("24h", "last 24 hours"),
    ("7d", "last 7 days"),
    ("30d", "last 30 days"),
)


class PeriodForm(forms.Form):
    """The period the telemetry page charts and totals."""

    period = forms.ChoiceField(choices=PERIODS, required=False, initial=AUTO_PERIOD)
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
        period, flavor = AUTO_PERIOD, flavors[0] if flavors else ""
        if self.is_valid():
            period = self.cleaned_data.get("period") or period
            flavor = self.cleaned_data.get("flavor") or flavor
        return period, flavor
