from django.apps import AppConfig


class PreemptionConfig(AppConfig):
    name = "preemption"
    verbose_name = "Jobs and preemption"

    def ready(self) -> None:
        # Registers the system checks.
        from preemption import checks  # noqa: F401
