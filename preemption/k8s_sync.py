"""Keep the cluster's PriorityClasses in line with the portal's (Kubernetes
runtime only): a class is created, replaced when an immutable field changes,
and deleted when the portal drops it; classes Quartermaster does not own are
never touched."""

from __future__ import annotations

import logging
from typing import Any

from preemption.runtimes.kubernetes import PriorityClassSpec, reconcile_priority_classes
from quotas.models import PriorityClass

logger = logging.getLogger(__name__)


def priority_classes_sync(*, api_client: Any) -> int:
    """Reconcile once through the Kubernetes runtime's API client; returns how
    many classes were written."""
    desired = [
        PriorityClassSpec(
            name=pc.name,
            value=pc.value,
            preemption_policy=pc.preemption_policy,
            description=pc.description,
        )
        for pc in PriorityClass.objects.all()
    ]
    result = reconcile_priority_classes(api_client, desired)
    if result.unowned:
        logger.warning(
            "PriorityClasses owned by someone else were left alone: %s", ", ".join(result.unowned)
        )
    return len(result.created) + len(result.replaced) + len(result.updated) + len(result.deleted)
