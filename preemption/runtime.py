"""Which runtime this installation drives, built from settings."""

from __future__ import annotations

import logging

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from preemption.k8s_sync import priority_classes_sync
from preemption.runtimes import parse_inventory
from preemption.runtimes.base import NodeInventory, Runtime
from preemption.runtimes.kubernetes import KubernetesRuntime, KubernetesRuntimeConfig
from preemption.runtimes.local import LocalRuntime
from preemption.runtimes.runner import RunnerAccount, RunnerLookup, find_runner
from quotas.models import Node

logger = logging.getLogger(__name__)


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
_warned_without_runner = False


def runner_lookup() -> RunnerLookup:
    """The account the local runtime runs ranks as, or why there is none."""
    return find_runner(settings.QM_RUNNER_USER, gid_base=settings.QM_RUNNER_GID_BASE)


def local_runner() -> RunnerAccount | None:
    """The runner account for the local runtime.

    Without one, production refuses to run researchers' commands at all; elsewhere they
    run as the control plane's own user, after a warning (once per process) that says why.
    """
    global _warned_without_runner
    lookup = runner_lookup()
    if lookup.account is not None:
        return lookup.account
    if settings.PRODUCTION:
        raise ImproperlyConfigured(
            f"the local runtime will not run ranks as the control plane's user in "
            f"production: {lookup.reason}"
        )
    if not _warned_without_runner:
        _warned_without_runner = True
        logger.warning(
            "ranks of the local runtime run as the control plane's own user and can read "
            "its secret key and database: %s",
            lookup.reason,
        )
    return None


def use_runtime(runtime: Runtime | None) -> None:
    """Point this process at a specific runtime (the drill and tests do)."""
    global _override
    _override = runtime


def get_runtime() -> Runtime:
    if _override is not None:
        return _override
    if settings.QM_RUNTIME == "kubernetes":
        return _kubernetes_runtime()
    return LocalRuntime(root=settings.QM_RUNS_DIR, inventory=inventory(), runner=local_runner())


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
