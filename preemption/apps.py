from django.apps import AppConfig


class PreemptionConfig(AppConfig):
    name = "preemption"
    verbose_name = "Jobs and preemption"
