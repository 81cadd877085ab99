from django.apps import AppConfig


class PreemptionConfig(AppConfig):
    name = "preemption"
    verbose_name = "Jobs and preemption"

    def ready(self) -> None:
        # Models may be imported only once the app registry is ready, so here.
        from preemption.job_ledger import DatabaseJobLedger
        from quotas.job_ledger import register_job_ledger

        register_job_ledger(DatabaseJobLedger())
