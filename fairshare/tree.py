"""The queue tree and the validation of a snapshot.

Decides whether a snapshot can be planned at all (every reference resolves, every
placement matches its node, the tree has no cycle; otherwise ``ScenarioError`` names the
field) and turns the queue tree into index arrays that every flavor's plan shares,
including which queues lie between two queues and their lowest common ancestor, where
R6 checks guarantee lines and R8 compares shares.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise

from .model import (
    PENDING,
    PREEMPTION_REASONS,
    WORKLOAD_STATES,
    PriorityClass,
    ScenarioError,
    Snapshot,
    Workload,
)

# What ``QueueTree.lca_chains`` answers: the queues on the other queue's path strictly
# below the lowest common ancestor, and the two children of that ancestor (or the two
# top-level queues) on which the asking queue and the other queue lie.
LcaChain = tuple[tuple[int, ...], int, int]


@dataclass(slots=True)
class QueueTree:
    """The queue tree as index arrays, shared by every flavor of one plan."""

    names: list[str]
    index: dict[str, int]
    parent: list[int]
    children: list[list[int]]
    weight: list[float]
    # Per queue: the queue itself, then its ancestors up to the top.
    path: list[tuple[int, ...]]
    top: list[int]
    # Every queue, deepest first: children come before their parents.
    bottom_up: list[int]
    # The queues with children, parents before their children.
    inner_top_down: list[int]
    # Per asking queue: its memo of ``lca_chains`` indexed by the other queue.
    lca_memo: dict[int, list[LcaChain | None]]
    # Per queue: each queue on its path (itself first) -> position on that path.
    depth_on_path: list[dict[int, int]]

    def lca_row(self, queue: int) -> list[LcaChain | None]:
        """The memo of ``lca_chains(queue, other)`` for every ``other``; None until asked.

        The victim scans look up one entry per queue for every preemption attempt, so a
        plain list per preemptor's queue keeps the lookup cheap.
        """
        row = self.lca_memo.get(queue)
        if row is None:
            row = [None] * len(self.names)
            self.lca_memo[queue] = row
        return row

    def lca_chains(self, queue: int, other: int) -> LcaChain:
        """Queues on ``other``'s path strictly below the lowest common ancestor with ``queue``.

        Also returns the two children of that ancestor (or the two top-level queues) on
        which ``queue`` and ``other`` lie, where R8 compares shares.
        """
        row = self.lca_row(queue)
        found = row[other]
        if found is None:
            found = self._find_lca_chains(queue, other)
            row[other] = found
        return found

    def _find_lca_chains(self, queue: int, other: int) -> LcaChain:
        queue_path = self.path[queue]
        on_queue_path = self.depth_on_path[queue]
        other_path = self.path[other]
        for depth, ancestor in enumerate(other_path):
            position = on_queue_path.get(ancestor)
            if position is not None:
                return other_path[:depth], queue_path[position - 1], other_path[depth - 1]
        return other_path, queue_path[-1], other_path[-1]


def build_tree(snapshot: Snapshot) -> QueueTree:
    """The index arrays of ``snapshot``'s queue tree; raises ``ScenarioError`` for a bad tree."""
    names: list[str] = []
    index: dict[str, int] = {}
    for i, queue in enumerate(snapshot.queues):
        if queue.name in index:
            raise ScenarioError(f"queues[{i}].name: duplicate queue {queue.name!r}")
        index[queue.name] = i
        names.append(queue.name)
        if not queue.weight > 0:
            raise ScenarioError(f"queues[{i}].weight: must be positive, got {queue.weight!r}")
    count = len(names)
    parent = [-1] * count
    children: list[list[int]] = [[] for _ in range(count)]
    for i, queue in enumerate(snapshot.queues):
        if queue.parent is not None:
            if queue.parent not in index:
                raise ScenarioError(f"queues[{i}].parent: unknown queue {queue.parent!r}")
            parent[i] = index[queue.parent]
            children[parent[i]].append(i)
    path: list[tuple[int, ...]] = []
    for i in range(count):
        chain = [i]
        while parent[chain[-1]] != -1:
            chain.append(parent[chain[-1]])
            if len(chain) > count:
                raise ScenarioError(f"queues[{i}].parent: the queue tree has a cycle")
        path.append(tuple(chain))
    bottom_up = sorted(range(count), key=lambda i: -len(path[i]))
    return QueueTree(
        names=names,
        index=index,
        parent=parent,
        children=children,
        weight=[queue.weight for queue in snapshot.queues],
        path=path,
        top=[i for i in range(count) if parent[i] == -1],
        bottom_up=bottom_up,
        inner_top_down=[i for i in reversed(bottom_up) if children[i]],
        lca_memo={},
        depth_on_path=[{queue: position for position, queue in enumerate(chain)} for chain in path],
    )


def _validate_thresholds(snapshot: Snapshot) -> None:
    for name in (
        "fair_share_min_runtime_seconds",
        "consolidation_min_runtime_seconds",
        "priority_min_runtime_seconds",
        "reclaim_min_runtime_seconds",
    ):
        value = getattr(snapshot, name)
        if not value >= 0:
            raise ScenarioError(f"{name}: must not be negative, got {value!r}")
    if not snapshot.usage_strength >= 0:
        raise ScenarioError(
            f"usage_strength: must not be negative, got {snapshot.usage_strength!r}"
        )
    if not snapshot.usage_half_life_seconds > 0:
        raise ScenarioError(
            f"usage_half_life_seconds: must be positive, got {snapshot.usage_half_life_seconds!r}"
        )
    for i, queue in enumerate(snapshot.queues):
        for flavor, value in queue.recent_usage.items():
            if not value >= 0:
                raise ScenarioError(
                    f"queues[{i}].recent_usage.{flavor}: must not be negative, got {value!r}"
                )
    for i, priority_class in enumerate(snapshot.priority_classes):
        for reason, value in priority_class.min_runtime_by_reason.items():
            where = f"priority_classes[{i}].min_runtime_by_reason"
            if reason not in PREEMPTION_REASONS:
                raise ScenarioError(
                    f"{where}: unknown reason {reason!r}, expected one of {list(PREEMPTION_REASONS)}"
                )
            if not value >= 0:
                raise ScenarioError(f"{where}.{reason}: must not be negative, got {value!r}")


def _validate_workloads(
    snapshot: Snapshot,
    tree: QueueTree,
    classes: Mapping[str, PriorityClass],
    node_flavor: Mapping[str, str],
    node_gpus: Mapping[str, int],
) -> None:
    # The place of a fault is spelled out only when there is one: a busy cycle checks
    # tens of thousands of workloads.
    seen: set[str] = set()
    for i, workload in enumerate(snapshot.workloads):
        if workload.id in seen:
            raise ScenarioError(f"workloads[{i}].id: duplicate workload {workload.id!r}")
        seen.add(workload.id)
        queue = tree.index.get(workload.queue)
        if queue is None:
            raise ScenarioError(f"workloads[{i}].queue: unknown queue {workload.queue!r}")
        if tree.children[queue]:
            raise ScenarioError(f"workloads[{i}].queue: {workload.queue!r} is not a leaf queue")
        if workload.priority_class not in classes:
            raise ScenarioError(
                f"workloads[{i}].priority_class: unknown priority class {workload.priority_class!r}"
            )
        if workload.state not in WORKLOAD_STATES:
            raise ScenarioError(
                f"workloads[{i}].state: must be one of {WORKLOAD_STATES}, got {workload.state!r}"
            )
        if workload.ranks < 1:
            raise ScenarioError(f"workloads[{i}].ranks: must be at least 1, got {workload.ranks}")
        if workload.gpus_per_rank < 1:
            raise ScenarioError(
                f"workloads[{i}].gpus_per_rank: must be at least 1, got {workload.gpus_per_rank}"
            )
        if workload.sizes:
            _check_sizes(i, workload)
        if workload.state == PENDING:
            continue
        placed = 0
        for node, ranks in workload.placement:
            if node not in node_flavor:
                raise ScenarioError(f"workloads[{i}].placement: unknown node {node!r}")
            if node_flavor[node] != workload.flavor:
                raise ScenarioError(
                    f"workloads[{i}].placement: node {node!r} is of flavor {node_flavor[node]!r},"
                    f" not {workload.flavor!r}"
                )
            if ranks < 1 or ranks * workload.gpus_per_rank > node_gpus[node]:
                raise ScenarioError(
                    f"workloads[{i}].placement: {ranks} ranks do not fit on {node!r}"
                )
            placed += ranks
        if placed != workload.ranks:
            raise ScenarioError(
                f"workloads[{i}].placement: places {placed} ranks, the workload has {workload.ranks}"
            )


def prepare(snapshot: Snapshot) -> tuple[QueueTree, dict[str, PriorityClass], dict[str, str]]:
    """Validate ``snapshot``; return its queue tree, classes by name and node flavors by name."""
    _validate_thresholds(snapshot)
    tree = build_tree(snapshot)
    classes: dict[str, PriorityClass] = {}
    for i, priority_class in enumerate(snapshot.priority_classes):
        if priority_class.name in classes:
            raise ScenarioError(
                f"priority_classes[{i}].name: duplicate class {priority_class.name!r}"
            )
        classes[priority_class.name] = priority_class
    node_flavor: dict[str, str] = {}
    node_gpus: dict[str, int] = {}
    for i, node in enumerate(snapshot.nodes):
        if node.name in node_flavor:
            raise ScenarioError(f"nodes[{i}].name: duplicate node {node.name!r}")
        if node.gpus < 0:
            raise ScenarioError(f"nodes[{i}].gpus: must not be negative, got {node.gpus}")
        node_flavor[node.name] = node.flavor
        node_gpus[node.name] = node.gpus
    _validate_workloads(snapshot, tree, classes, node_flavor, node_gpus)
    return tree, classes, node_flavor


def _check_sizes(i: int, workload: Workload) -> None:
    """An elastic workload's sizes: ascending whole rank counts, its own among them.

    An elastic gang with a topology is refused: its smaller sizes would need a search
    per domain and size, which the engine does not do yet."""
    sizes = workload.sizes
    if sizes[0] < 1 or any(a >= b for a, b in pairwise(sizes)):
        raise ScenarioError(
            f"workloads[{i}].sizes: must be ascending rank counts of at least 1, got {list(sizes)}"
        )
    if workload.ranks not in sizes:
        raise ScenarioError(
            f"workloads[{i}].sizes: must include the workload's {workload.ranks} ranks,"
            f" got {list(sizes)}"
        )
    if workload.topology_level is not None:
        raise ScenarioError(f"workloads[{i}].sizes: an elastic workload cannot ask for a topology")
