"""The planner: one call turns a snapshot into every decision the cluster needs now.

Flavors never share GPUs, so each flavor is planned on its own by a ``FlavorPlanner``
(``cycle.py``). The work is split by what each part decides:

- ``tree.py``: whether the snapshot can be planned at all, and the queue tree as arrays;
- ``shares.py``: every queue's fair share (R4, R8);
- ``ledger.py``: the quota view, per queue the GPUs its running and newly planned work
  takes (a terminating victim no longer counts), and whether a queue may take more;
- ``nodes.py``: the physical view, per node the GPUs free now and those on their way
  back from terminating victims (R1, R11), and where a gang's ranks go (R10);
- ``work.py``: running work as candidate victims and pending jobs, each in its order
  (R9's order of victims);
- ``candidates.py``: which running work may be taken for reclaim, priority or fair
  share, cheapest first (R3, R6-R9), with what a reclaim scan keeps in
  ``reclaim_scan.py``;
- ``preemption.py``: which candidates one preemptor takes;
- ``consolidation.py``: which small jobs move when free GPUs are scattered;
- ``cycle.py``: the order of the pending workloads and what becomes of each, over
  ``searches.py`` (the preemption searches for one workload) and ``decisions.py`` (the
  planning state, and what is decided: admitted, victims taken, waiting and why);
- ``status.py``: every queue's standing after the plan.

The rules themselves (R1-R11) are the small functions of ``rules.py``.
"""

from __future__ import annotations

from .collector import collector_paused
from .cycle import FlavorPlanner
from .model import (
    Admission,
    FrozenMap,
    Plan,
    Preemption,
    QueueStatus,
    Resize,
    Snapshot,
    Waiting,
    Workload,
)
from .status import queue_statuses
from .tree import prepare


def check_snapshot(snapshot: Snapshot) -> None:
    """Raise ``ScenarioError`` naming the field when ``snapshot`` breaks the model."""
    prepare(snapshot)


def plan(snapshot: Snapshot) -> Plan:
    """Plan every pending workload of ``snapshot``: admissions, preemptions, waiting list, status.

    Raises ``ScenarioError`` for a snapshot that breaks the model (an unknown queue,
    class or node, a workload on a non-leaf queue, a placement that does not match).
    """
    with collector_paused():
        return _plan(snapshot)


def _plan(snapshot: Snapshot) -> Plan:
    tree, classes, node_flavor = prepare(snapshot)

    by_flavor: dict[str, list[Workload]] = {}
    for workload in snapshot.workloads:
        by_flavor.setdefault(workload.flavor, []).append(workload)
    flavors = set(node_flavor.values()) | set(by_flavor)
    for configured in snapshot.queues:
        flavors.update(configured.quotas)

    admit: list[Admission] = []
    preempt: list[Preemption] = []
    waiting: list[Waiting] = []
    resize: list[Resize] = []
    status: dict[str, dict[str, QueueStatus]] = {name: {} for name in tree.names}
    for flavor in sorted(flavors):
        workloads = by_flavor.get(flavor, [])
        planner = FlavorPlanner(snapshot, tree, classes, flavor, workloads)
        planner.run()
        preempt.extend(planner.preempt)
        admit.extend(planner.admissions.values())
        waiting.extend(planner.waits.values())
        resize.extend(planner.resize)
        statuses = queue_statuses(
            planner.ledger, workloads, planner.admitted.values(), planner.resized_usage
        )
        for queue, queue_status in statuses.items():
            status[tree.names[queue]][flavor] = queue_status
    return Plan(
        admit=tuple(admit),
        preempt=tuple(preempt),
        waiting=tuple(waiting),
        queues=FrozenMap({name: FrozenMap(by_flavor_) for name, by_flavor_ in status.items()}),
        resize=tuple(resize),
    )
