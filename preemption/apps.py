from typing import Any

from django.apps import AppConfig
from django.core import checks


class PreemptionConfig(AppConfig):
    name = "preemption"
    verbose_name = "Jobs and preemption"

    def ready(self) -> None:
        checks.register(runtime_check)


def runtime_check(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """A runtime that would lose checkpoints is an error in production, a warning otherwise."""
    from django.conf import settings

    from preemption.runtime import runtime_problems

    kind = checks.Error if settings.PRODUCTION else checks.Warning
    return [kind(problem, id="preemption.E001") for problem in runtime_problems()]
