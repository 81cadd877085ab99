"""Which runtime this installation drives, built from settings."""

from __future__ import annotations

from django.conf import settings

from preemption.runtimes.base import NodeInventory, Runtime


def inventory() -> list[NodeInventory]:
    """The nodes the runtime offers: QM_LOCAL_NODES when set, else the database's."""
    if settings.QM_LOCAL_NODES:
        from preemption.runtimes import parse_inventory

        return list(parse_inventory(settings.QM_LOCAL_NODES))
    from quotas.models import Node

    return [
        NodeInventory(name=name, flavor=flavor, gpus=gpus)
        for name, flavor, gpus in Node.objects.values_list("name", "flavor__name", "gpus")
    ]


_override: Runtime | None = None


def use_runtime(runtime: Runtime | None) -> None:
    """Point this process at a specific runtime (the drill and tests do)."""
    global _override
    _override = runtime


def get_runtime() -> Runtime:
    if _override is not None:
        return _override
    if settings.QM_RUNTIME == "kubernetes":
        from preemption.runtimes.kubernetes import runtime_from_settings

        return runtime_from_settings()
    from preemption.runtimes.local import LocalRuntime

    return LocalRuntime(root=settings.QM_RUNS_DIR, inventory=inventory())
