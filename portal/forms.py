"""Forms of the portal's own pages: API tokens.

Forms only parse what a person typed; every rule about the data lives in the
services, whose messages the pages show unchanged.
"""

from __future__ import annotations

from django import forms


class ApiTokenForm(forms.Form):
    """A new API token: only its name is chosen by the person."""

    name = forms.CharField(
        max_length=100,
        widget=forms.TextInput(attrs={"placeholder": "e.g. laptop qm", "autocomplete": "off"}),
    )
