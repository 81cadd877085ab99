"""The Celery app, wired to Django's settings (CELERY_* names)."""

from __future__ import annotations

import os

from celery import Celery, Task
from celery.signals import task_postrun, task_prerun
from django.db import close_old_connections

import portal.broker  # noqa: F401 - registers the embedded default's disk broker

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

app = Celery("quartermaster")
app.config_from_object("django.conf:settings", namespace="CELERY")


@task_prerun.connect
@task_postrun.connect
def _close_old_connections(sender: Task | None = None, **_: object) -> None:
    """Drop the database connections Django would drop at a request's edges: broken
    ones and those older than CONN_MAX_AGE. Celery's own Django fixup closes every
    connection around every task unless CELERY_DB_REUSE_MAX is set (settings.py sets
    it), and a new PostgreSQL session per task cost the worker a twentieth of its time
    with passes four times a second. A task run eagerly, inside a caller's
    transaction, leaves the caller's connection alone, as the fixup does."""
    if sender is not None and getattr(sender.request, "is_eager", False):
        return
    close_old_connections()


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
