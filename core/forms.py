"""Form helpers the pages share.

Forms only parse what a person typed; every rule about the data lives in the
services, whose messages the pages show unchanged.
"""

from __future__ import annotations

from django import forms
from django.core.exceptions import ValidationError


def add_service_errors(form: forms.Form, error: ValidationError) -> None:
    """Show a service's ValidationError on the fields it names (the rest above the form)."""
    if hasattr(error, "error_dict"):
        for field, messages in error.message_dict.items():
            for message in messages:
                form.add_error(field if field in form.fields else None, message)
    else:
        for message in error.messages:
            form.add_error(None, message)
