"""Celery tasks of telemetry."""

from __future__ import annotations

from celery import shared_task


@shared_task(
    name="telemetry.tasks.sample_utilization",
    acks_late=True,
    soft_time_limit=30,
    time_limit=60,
    ignore_result=True,
    expires=30,
)
def sample_utilization() -> int:
    from django.utils import timezone

    from telemetry.services import utilization_sample

    return utilization_sample(now=timezone.now())
