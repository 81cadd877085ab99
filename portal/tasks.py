"""Celery tasks: thin wrappers that call services. Each acknowledges late and
has a time limit, so a worker that dies mid-task leaves the work to another.

The names are explicit and keep the module paths the tasks first had, so the
beat schedule (`portal.celery`) and messages already queued keep working.
"""

from __future__ import annotations

import time

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from preemption.cadence import preemption_risk_refresh
from preemption.cycle import schedule_cycle as run_cycle
from preemption.k8s_sync import priority_classes_sync
from preemption.reconcile import reconcile_jobs
from preemption.runtime import get_runtime, sync_node_topology
from preemption.wakeup import SCHEDULE_CYCLE_TASK, cycle_started_since, cycle_waiting
from preemption.webhooks import deliver_due
from telemetry.services import utilization_sample

COMMON = {"acks_late": True, "soft_time_limit": 30, "time_limit": 60, "ignore_result": True}


@shared_task(name=SCHEDULE_CYCLE_TASK, expires=5, **COMMON)
def schedule_cycle(requested_at: float | None = None) -> dict[str, int]:
    """A cycle: every period from the beat, and on request (``requested_at``, when it
    was asked for) unless a cycle that started since then already served it.

    The beat's cycle is for what no request announces (a minimum runtime or a
    backoff running out): one that started less than half a period ago saw almost
    the same state, so the beat's is skipped then. In a busy cluster, where jobs end
    and ask for cycles many times a second, it would plan again what was just
    planned, and find nothing new about as often as not."""
    if requested_at is None:
        requested_at = time.time() - settings.QM_CYCLE_SECONDS / 2
    if cycle_started_since(requested_at):
        return {"admitted": 0, "preempted": 0, "waiting": 0}
    result = run_cycle()
    return {
        "admitted": len(result.admitted),
        "preempted": len(result.preempted),
        "waiting": result.waiting,
    }


@shared_task(name="preemption.tasks.reconcile", expires=5, **COMMON)
def reconcile(job_ids: list[int] | None = None) -> int:
    """A reconcile pass, of every job or only of `job_ids`; when it ended jobs and so
    asked for a cycle, the cycle runs here at once, so that their GPUs go to
    waiting jobs without another hop through the broker (the request it sent finds
    the cycle done and does nothing)."""
    looked = reconcile_jobs(job_ids=job_ids)
    if cycle_waiting():
        run_cycle()
    return looked


@shared_task(name="preemption.tasks.refresh_preemption_risk", expires=30, **COMMON)
def refresh_preemption_risk() -> int:
    """Estimate every running job's preemption risk and hand it to its ranks."""
    return preemption_risk_refresh().changed


@shared_task(name="preemption.tasks.deliver_webhooks", expires=30, **COMMON)
def deliver_webhooks() -> int:
    return deliver_due()


@shared_task(name="preemption.tasks.sync_priority_classes", expires=60, **COMMON)
def sync_priority_classes() -> int:
    """Reconcile the cluster's PriorityClasses; 0 off Kubernetes."""
    if settings.QM_RUNTIME != "kubernetes":
        return 0
    return priority_classes_sync(api_client=get_runtime().api_client)  # type: ignore[attr-defined]


@shared_task(name="preemption.tasks.sync_node_topology", expires=60, **COMMON)
def sync_node_topology_task() -> int:
    """Read the nodes' topology from the runtime into the database; how many changed."""
    return len(sync_node_topology())


@shared_task(name="telemetry.tasks.sample_utilization", expires=30, **COMMON)
def sample_utilization() -> int:
    return utilization_sample(now=timezone.now())
