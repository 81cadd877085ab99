"""The quota editor's form.

It only turns what a manager typed into numbers where it reads as one: an empty
limit means "no limit". Every rule (whole numbers, no negative numbers, children
within the parent, the cluster's capacity, running non-preemptible jobs) is
checked by the quota services, whose refusals name the allowed range
(`quotas.validation`), and their messages are shown unchanged: so `abc`, `2.5`,
-3 and an empty guarantee are refused with the range like 12 is.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.core.exceptions import ValidationError

from core.forms import add_service_errors
from quotas.models import Quota
from quotas.validation import parse_count
from quotas.wording import LEND_ALL, NO_LIMIT


class QuotaCountField(forms.Field):
    """A quota figure as typed: a whole number where it reads as one, else the text
    itself, which the quota services refuse with the field's allowed range."""

    widget = forms.NumberInput

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("required", False)
        super().__init__(**kwargs)

    def to_python(self, value: Any) -> Any:
        return parse_count(value)


class QuotaForm(forms.Form):
    """Guarantee, borrow limit and lend limit of one (team, flavor) quota."""

    guarantee = QuotaCountField(
        help_text="GPUs the team always gets back within a grace window.",
        widget=forms.NumberInput(attrs={"inputmode": "numeric"}),
    )
    borrow_limit = QuotaCountField(
        label="Borrow limit",
        help_text=f"Most GPUs it may borrow beyond its guarantee. Empty: {NO_LIMIT}.",
        widget=forms.NumberInput(attrs={"inputmode": "numeric", "placeholder": NO_LIMIT}),
    )
    lend_limit = QuotaCountField(
        label="Lend limit",
        help_text=f"Most of its idle guarantee others may borrow. Empty: {LEND_ALL}.",
        widget=forms.NumberInput(attrs={"inputmode": "numeric", "placeholder": LEND_ALL}),
    )
    reason = forms.CharField(
        required=False,
        max_length=300,
        label="Reason (optional)",
        help_text="Kept with this change in the quota history.",
        widget=forms.TextInput(attrs={"placeholder": "e.g. nlp's deadline moved to June"}),
    )

    @classmethod
    def for_quota(cls, quota: Quota, data: Any = None) -> QuotaForm:
        return cls(
            data,
            initial={
                "guarantee": quota.guarantee,
                "borrow_limit": quota.borrow_limit,
                "lend_limit": quota.lend_limit,
            },
        )

    def values(self) -> dict[str, Any]:
        """The edited values, as the quota services take them (and refuse)."""
        return {
            "guarantee": self.cleaned_data.get("guarantee"),
            "borrow_limit": self.cleaned_data.get("borrow_limit"),
            "lend_limit": self.cleaned_data.get("lend_limit"),
        }

    def add_service_errors(self, error: ValidationError) -> None:
        """Show a service's ValidationError on the fields it names."""
        add_service_errors(self, error)
