"""Forms of the portal's own pages: API tokens.

Forms only parse what a person typed; every rule about the data lives in the
services, whose messages the pages show unchanged.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.conf import settings


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
