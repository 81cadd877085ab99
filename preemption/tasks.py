"""Celery tasks: thin wrappers that call services. Each acknowledges late and
has a time limit, so a worker that dies mid-task leaves the work to another."""

from __future__ import annotations

from celery import shared_task

COMMON = {"acks_late": True, "soft_time_limit": 30, "time_limit": 60, "ignore_result": True}


@shared_task(name="preemption.tasks.schedule_cycle", expires=5, **COMMON)
def schedule_cycle() -> dict[str, int]:
    from preemption.cycle import schedule_cycle as run_cycle

    result = run_cycle()
    return {
        "admitted": len(result.admitted),
        "preempted": len(result.preempted),
        "waiting": result.waiting,
    }


@shared_task(name="preemption.tasks.reconcile", expires=5, **COMMON)
def reconcile() -> int:
    from preemption.reconcile import reconcile_jobs

    return reconcile_jobs()


@shared_task(name="preemption.tasks.deliver_webhooks", expires=30, **COMMON)
def deliver_webhooks() -> int:
    from preemption.webhooks import deliver_due

    return deliver_due()


@shared_task(name="preemption.tasks.sync_priority_classes", expires=60, **COMMON)
def sync_priority_classes() -> int:
    from preemption.k8s_sync import priority_classes_sync

    return priority_classes_sync()
