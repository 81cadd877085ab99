"""Small builders for fair-share scenarios, so that each test case reads as one line.

cluster(nodes("n", 2, 8), queues=[team("a", guarantee=8), team("b", guarantee=8)],
        workloads=[workload("x").queue("b").gpus(8).running("n0")])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from fairshare import (
    FlavorQuota,
    Node,
    Plan,
    PriorityClass,
    Queue,
    Snapshot,
    Workload,
    plan,
)

NOW = 10_000.0
FLAVOR = "h100"

# The classes every scenario can use, from most to least important.
CLASSES = (
    PriorityClass("critical", 1000, "PreemptLowerPriority", False, 60.0),
    PriorityClass("high", 100, "PreemptLowerPriority", True, 30.0),
    PriorityClass("normal", 0, "PreemptLowerPriority", True, 30.0),
    PriorityClass("polite", 0, "Never", True, 30.0),
    PriorityClass("low", -1, "PreemptLowerPriority", True, 10.0),
    PriorityClass("fresh", -1, "PreemptLowerPriority", True, 10.0, min_runtime_seconds=600.0),
    # Protected from reclaim (and so from fair share) for its first 15 minutes.
    PriorityClass(
        "steady", -1, "PreemptLowerPriority", True, 10.0, min_runtime_by_reason={"reclaim": 900.0}
    ),
    # Asks to give way to fair share at once, which the plan's anti-flap margin refuses.
    PriorityClass(
        "nimble", -1, "PreemptLowerPriority", True, 10.0, min_runtime_by_reason={"fair-share": 0.0}
    ),
    PriorityClass("pinned", -5, "PreemptLowerPriority", False, 60.0),
)
# Classes whose elastic work may be shrunk rather than evicted, and grown back; every
# scenario can use them, and the properties that resize running gangs draw from them.
RESIZING_CLASSES = (
    PriorityClass("elastic", 0, "PreemptLowerPriority", True, 30.0, shrink_elastic=True),
    PriorityClass("elastic-low", -1, "PreemptLowerPriority", True, 10.0, shrink_elastic=True),
    PriorityClass(
        "elastic-fresh", -1, "PreemptLowerPriority", True, 10.0, 600.0, shrink_elastic=True
    ),
)
_CLASS_BY_VALUE = {-5: "pinned", -1: "low", 0: "normal", 100: "high", 1000: "critical"}


def nodes(prefix: str, count: int, gpus: int, flavor: str = FLAVOR) -> list[Node]:
    """``count`` nodes named prefix0, prefix1, ... with ``gpus`` GPUs each."""
    return [Node(f"{prefix}{i}", flavor, gpus) for i in range(count)]


def racks(count: int, nodes_per_rack: int, gpus: int, flavor: str = FLAVOR) -> list[Node]:
    """``count`` racks r0, r1, ... of ``nodes_per_rack`` nodes each, named n0, n1, ..."""
    return [
        Node(f"n{i}", flavor, gpus, {"rack": f"r{i // nodes_per_rack}"})
        for i in range(count * nodes_per_rack)
    ]


def team(
    name: str,
    parent: str | None = None,
    *,
    guarantee: int = 0,
    borrow_limit: int | None = None,
    lend_limit: int | None = None,
    weight: float = 1.0,
    flavor: str = FLAVOR,
    recent: float = 0.0,
) -> Queue:
    """A queue with one flavor's quota and ``recent`` decayed GPU-seconds of it used."""
    return Queue(
        name,
        parent,
        weight,
        {flavor: FlavorQuota(guarantee, borrow_limit, lend_limit)},
        {flavor: recent} if recent else {},
    )


class WorkloadBuilder:
    """Fluent builder: ``workload("low").queue("b").priority(-1).gpus(8).running("n0")``."""

    def __init__(self, workload_id: str) -> None:
        self._w = Workload(
            id=workload_id,
            queue="a",
            priority_class="normal",
            flavor=FLAVOR,
            ranks=1,
            gpus_per_rank=1,
            state="pending",
            submitted_at=NOW - 100.0,
        )

    def _with(self, **changes: object) -> WorkloadBuilder:
        self._w = dataclasses.replace(self._w, **changes)  # type: ignore[arg-type]
        return self

    def queue(self, name: str) -> WorkloadBuilder:
        return self._with(queue=name)

    def priority(self, value: int) -> WorkloadBuilder:
        return self._with(priority_class=_CLASS_BY_VALUE[value])

    def cls(self, name: str) -> WorkloadBuilder:
        return self._with(priority_class=name)

    def gpus(self, count: int) -> WorkloadBuilder:
        return self._with(ranks=1, gpus_per_rank=count)

    def gang(self, ranks: int, gpus_per_rank: int) -> WorkloadBuilder:
        return self._with(ranks=ranks, gpus_per_rank=gpus_per_rank)

    def elastic(self, *sizes: int) -> WorkloadBuilder:
        """An elastic gang of ``sizes`` ranks (ascending), asking for the largest."""
        return self._with(ranks=sizes[-1], sizes=sizes)

    def at(self, ranks: int) -> WorkloadBuilder:
        """Running (or asking) at ``ranks`` ranks, one of its sizes: before ``running``."""
        return self._with(ranks=ranks)

    def submitted(self, seconds_ago: float) -> WorkloadBuilder:
        return self._with(submitted_at=NOW - seconds_ago)

    def within(self, level: str, *, required: bool = True) -> WorkloadBuilder:
        """All ranks in one domain of topology ``level`` (required, or only preferred)."""
        return self._with(topology_level=level, topology_required=required)

    def flavor(self, name: str) -> WorkloadBuilder:
        return self._with(flavor=name)

    def running(
        self, *nodes_: str, since: float = 3600.0, checkpoint: float | None = None
    ) -> WorkloadBuilder:
        """Running on ``nodes_`` (ranks spread evenly), admitted ``since`` seconds ago."""
        ranks = self._w.ranks
        share, extra = divmod(ranks, len(nodes_))
        placement = tuple(
            (node, share + (1 if i < extra else 0))
            for i, node in enumerate(nodes_)
            if share + (1 if i < extra else 0)
        )
        return self._with(
            state="running",
            placement=placement,
            admitted_at=NOW - since,
            submitted_at=min(self._w.submitted_at, NOW - since),
            last_checkpoint_at=None if checkpoint is None else NOW - checkpoint,
        )

    def terminating(self, *nodes_: str, freed_for: str | None = None) -> WorkloadBuilder:
        """A victim in its grace window on ``nodes_``, preempted for ``freed_for``."""
        self.running(*nodes_)
        return self._with(state="terminating", preemptor=freed_for)

    def gave_way_to(self, preemptor: str) -> WorkloadBuilder:
        """Pending again after it was preempted for ``preemptor``, as a requeued victim."""
        return self._with(preemptor=preemptor)

    def build(self) -> Workload:
        return self._w


def workload(workload_id: str) -> WorkloadBuilder:
    """Start building a workload (pending, 1 GPU, class "normal", queue "a")."""
    return WorkloadBuilder(workload_id)


def cluster(
    node_list: Sequence[Node],
    queues: Sequence[Queue],
    workloads: Iterable[WorkloadBuilder | Workload] = (),
    classes: Sequence[PriorityClass] = CLASSES + RESIZING_CLASSES,
) -> Snapshot:
    """A snapshot at ``NOW``."""
    built = tuple(w.build() if isinstance(w, WorkloadBuilder) else w for w in workloads)
    return Snapshot(NOW, tuple(node_list), tuple(queues), tuple(classes), built)


def preempted(p: Plan) -> dict[str, str]:
    """Victim id -> reason."""
    return {e.id: e.reason for e in p.preempt}


def admitted(p: Plan) -> set[str]:
    return {a.id for a in p.admit}


def resized(p: Plan) -> dict[str, int]:
    """Resized workload id -> the ranks it runs at after the plan."""
    return {r.workload: r.ranks for r in p.resize}


def reasons(p: Plan) -> dict[str, str]:
    return {w.id: w.reason for w in p.waiting}


def run_plan(snapshot: Snapshot) -> Plan:
    return plan(snapshot)


def plain(value: object) -> object:
    """A plan as plain data (class names, fields, lists and dicts), so that the plans of
    the compiled engine and of its sources, whose classes differ, can be compared."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return type(value).__name__, fields
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return [plain(item) for item in value]
    return value
