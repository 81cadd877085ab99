"""The Celery app, wired to Django's settings (CELERY_* names)."""

from __future__ import annotations

import os

from celery import Celery

import portal.broker  # noqa: F401 - registers the embedded default's disk broker

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

app = Celery("quartermaster")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.on_after_finalize.connect
def _schedule(sender: Celery, **_: object) -> None:
    from django.conf import settings

    sender.add_periodic_task(
        settings.QM_CYCLE_SECONDS,
        sender.signature("preemption.tasks.schedule_cycle"),
        name="schedule cycle",
    )
    sender.add_periodic_task(
        settings.QM_RECONCILE_SECONDS,
        sender.signature("preemption.tasks.reconcile"),
        name="reconcile",
    )
    sender.add_periodic_task(
        settings.QM_SAMPLE_SECONDS,
        sender.signature("telemetry.tasks.sample_utilization"),
        name="sample utilization",
    )
    sender.add_periodic_task(
        5.0, sender.signature("preemption.tasks.deliver_webhooks"), name="deliver webhooks"
    )
    # Topology labels change rarely (a node moved to another rack): once a minute is soon.
    sender.add_periodic_task(
        60.0,
        sender.signature("preemption.tasks.sync_node_topology"),
        name="sync node topology",
    )
    # The running jobs' cadence hints (preemption.cadence).
    sender.add_periodic_task(
        settings.QM_RISK_SECONDS,
        sender.signature("preemption.tasks.refresh_preemption_risk"),
        name="refresh preemption risk",
    )
    # Undo edits to the cluster's PriorityClasses (Kubernetes runtime only).
    sender.add_periodic_task(
        60.0,
        sender.signature("preemption.tasks.sync_priority_classes"),
        name="sync priority classes",
    )
