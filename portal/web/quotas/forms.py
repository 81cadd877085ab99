"""The quota editor's form.

It only turns what a manager typed into numbers: an empty limit means "no
limit". Every rule (no negative numbers, children within the parent, the
cluster's capacity, running non-preemptible jobs) is checked by the quota
services, and their messages are shown unchanged.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.core.exceptions import ValidationError

from core.forms import add_service_errors
from quotas.models import Quota
from quotas.wording import LEND_ALL, NO_LIMIT


class QuotaForm(forms.Form):
    """Guarantee, borrow limit and lend limit of one (team, flavor) quota."""

    guarantee = forms.IntegerField(
        help_text="GPUs the team always gets back within a grace window.",
        widget=forms.NumberInput(attrs={"inputmode": "numeric"}),
    )
    borrow_limit = forms.IntegerField(
        required=False,
        label="Borrow limit",
        help_text=f"Most GPUs it may borrow beyond its guarantee. Empty: {NO_LIMIT}.",
        widget=forms.NumberInput(attrs={"inputmode": "numeric", "placeholder": NO_LIMIT}),
    )
    lend_limit = forms.IntegerField(
        required=False,
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

    def values(self) -> dict[str, int | None]:
        """The edited values, as the quota services take them."""
        return {
            "guarantee": self.cleaned_data["guarantee"],
            "borrow_limit": self.cleaned_data.get("borrow_limit"),
            "lend_limit": self.cleaned_data.get("lend_limit"),
        }

    def add_service_errors(self, error: ValidationError) -> None:
        """Show a service's ValidationError on the fields it names."""
        add_service_errors(self, error)
