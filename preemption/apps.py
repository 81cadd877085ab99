from django.apps import AppConfig


class PreemptionConfig(AppConfig):
    name = "preemption"
    verbose_name = "Jobs and preemption"

    def ready(self) -> None:
        # Models (and the checks that read them) load only once the app registry is ready.
        from preemption import checks  # noqa: F401 - registers the system checks
        from preemption.job_ledger import DatabaseJobLedger
        from quotas.job_ledger import register_job_ledger

        register_job_ledger(DatabaseJobLedger())
