"""System checks of the preemption app, run by every management command that starts
the portal (`migrate`, `serve_embedded`, `check --deploy`)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning, register

from preemption.runtime import runner_lookup, runtime_problems


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


@register()
def runtime_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A runtime that would lose checkpoints is an error in production, a warning otherwise."""
    kind = Error if settings.PRODUCTION else Warning
    return [kind(problem, id="preemption.E002") for problem in runtime_problems()]
