"""The nodes as the Nodes page shows them: each node with its flavor, GPUs, the
GPUs open attempts hold on it now, whether the engine may place on it
(schedulable) or it is drained, and its topology.

Cluster-wide figures without team or job names, the same that `/api/v1/nodes/`
gives every signed-in user, plus the GPUs in use: a drained node may still run
the jobs it had until they end or are moved."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from preemption.models import ACTIVE_STATES, Attempt
from quotas.models import Node
from quotas.selectors import node_topology


@dataclass(frozen=True)
class NodeRow:
    """One node now."""

    node_id: int
    name: str
    flavor: str
    gpus: int
    used: int
    schedulable: bool
    topology: dict[str, str]

    @property
    def free(self) -> int:
        """GPUs the engine may still place on: none on a drained node."""
        return max(self.gpus - self.used, 0) if self.schedulable else 0


def gpus_held_by_node() -> dict[str, int]:
    """GPUs held on each node by the open attempts of active jobs (a victim in its
    grace window included), from the attempts' placements."""
    held: dict[str, int] = defaultdict(int)
    attempts = Attempt.objects.filter(
        ended_at__isnull=True, job__state__in=ACTIVE_STATES
    ).values_list("placement", "job__gpus_per_rank")
    for placement, gpus_per_rank in attempts:
        for entry in placement or []:
            held[str(entry["node"])] += int(entry["ranks"]) * gpus_per_rank
    return dict(held)


def node_rows() -> list[NodeRow]:
    """Every node by name, with the GPUs in use on it; two queries."""
    held = gpus_held_by_node()
    return [
        NodeRow(
            node_id=node.pk,
            name=node.name,
            flavor=node.flavor.name,
            gpus=node.gpus,
            used=held.get(node.name, 0),
            schedulable=node.schedulable,
            topology=node_topology(node),
        )
        for node in Node.objects.select_related("flavor").order_by("name")
    ]
