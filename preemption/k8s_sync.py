"""Keep the cluster's PriorityClasses in line with the portal's (Kubernetes
runtime only): a class is created, replaced when an immutable field changes,
and deleted when the portal drops it; classes Quartermaster does not own are
never touched."""

from __future__ import annotations

import logging

from django.conf import settings

from quotas.models import PriorityClass

logger = logging.getLogger(__name__)


def priority_classes_sync() -> int:
    """Reconcile once; returns how many classes were written (0 off Kubernetes)."""
    if settings.QM_RUNTIME != "kubernetes":
        return 0
    from preemption.runtime import get_runtime
    from preemption.runtimes.kubernetes import PriorityClassSpec, reconcile_priority_classes

    runtime = get_runtime()
    desired = [
        PriorityClassSpec(
            name=pc.name,
            value=pc.value,
            preemption_policy=pc.preemption_policy,
            description=pc.description,
        )
        for pc in PriorityClass.objects.all()
    ]
    result = reconcile_priority_classes(runtime.api_client, desired)  # type: ignore[attr-defined]
    if result.unowned:
        logger.warning(
            "PriorityClasses owned by someone else were left alone: %s", ", ".join(result.unowned)
        )
    return len(result.created) + len(result.replaced) + len(result.updated) + len(result.deleted)
