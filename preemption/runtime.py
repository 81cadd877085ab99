"""Which runtime this installation drives, built from settings."""

from __future__ import annotations

from django.conf import settings

from preemption.k8s_sync import priority_classes_sync
from preemption.runtimes import parse_inventory
from preemption.runtimes.base import NodeInventory, Runtime
from preemption.runtimes.kubernetes import KubernetesRuntime, KubernetesRuntimeConfig
from preemption.runtimes.local import LocalRuntime
from quotas.models import Node


def inventory() -> list[NodeInventory]:
    """The nodes the runtime offers: QM_LOCAL_NODES when set, else the database's."""
    if settings.QM_LOCAL_NODES:
        return list(parse_inventory(settings.QM_LOCAL_NODES))
    return [
        NodeInventory(name=name, flavor=flavor, gpus=gpus)
        for name, flavor, gpus in Node.objects.values_list("name", "flavor__name", "gpus")
    ]


_override: Runtime | None = None
_kubernetes: Runtime | None = None


def use_runtime(runtime: Runtime | None) -> None:
    """Point this process at a specific runtime (the drill and tests do)."""
    global _override
    _override = runtime


def get_runtime() -> Runtime:
    if _override is not None:
        return _override
    if settings.QM_RUNTIME == "kubernetes":
        return _kubernetes_runtime()
    return LocalRuntime(root=settings.QM_RUNS_DIR, inventory=inventory())


def _kubernetes_runtime() -> Runtime:
    """One Kubernetes runtime per process: it holds a connection pool and the
    threads that send a gang's evictions at once."""
    global _kubernetes
    if _kubernetes is None:
        _kubernetes = KubernetesRuntime.from_kubeconfig(
            settings.QM_K8S_KUBECONFIG or None,
            KubernetesRuntimeConfig(
                namespace=settings.QM_K8S_NAMESPACE,
                namespace_per_team=settings.QM_K8S_NAMESPACE_PER_TEAM,
            ),
        )
        # Pods name their priority class: make sure the classes exist before
        # the first launch rather than waiting for the periodic sync.
        try:
            priority_classes_sync(api_client=_kubernetes.api_client)  # type: ignore[attr-defined]
        except Exception:
            import logging

            logging.getLogger(__name__).warning("first PriorityClass sync failed", exc_info=True)
    return _kubernetes
