"""System checks of the preemption app, run by every management command that starts
the portal (`migrate`, `serve_embedded`, `check --deploy`)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, register

from preemption.runtime import runner_lookup


@register()
def local_runtime_runner_check(app_configs: Any, **kwargs: Any) -> list[CheckMessage]:
    """Production with the local runtime needs the runner user (see runtimes/runner.py)."""
    if not settings.PRODUCTION or settings.QM_RUNTIME != "local":
        return []
    lookup = runner_lookup()
    if lookup.account is not None:
        return []
    return [
        Error(
            f"The local runtime cannot run ranks as a separate user: {lookup.reason}.",
            hint=(
                "Run the control plane as root and create the runner user with "
                "bin/runner-user (QM_RUNNER_USER names it), or use QM_RUNTIME=kubernetes."
            ),
            id="preemption.E001",
        )
    ]
