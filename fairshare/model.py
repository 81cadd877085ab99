"""The engine's vocabulary: frozen dataclasses for the snapshot it reads and the plan it returns."""

from __future__ import annotations

import copyreg
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Final, TypeVar

K = TypeVar("K")
V = TypeVar("V")

PREEMPT_LOWER_PRIORITY: Final = "PreemptLowerPriority"
NEVER: Final = "Never"
PREEMPTION_POLICIES: Final = (PREEMPT_LOWER_PRIORITY, NEVER)

PENDING: Final = "pending"
RUNNING: Final = "running"
TERMINATING: Final = "terminating"
WORKLOAD_STATES: Final = (PENDING, RUNNING, TERMINATING)

RECLAIM: Final = "reclaim"
PRIORITY: Final = "priority"
FAIR_SHARE: Final = "fair-share"
CONSOLIDATE: Final = "consolidate"
# The reasons a running workload may be preempted for, each with its own minimum runtime.
PREEMPTION_REASONS: Final = (PRIORITY, FAIR_SHARE, RECLAIM, CONSOLIDATE)


class ScenarioError(ValueError):
    """A snapshot or scenario that cannot be planned; the message names the offending field."""


class FrozenMap(Mapping[K, V]):
    """An immutable, hashable mapping backed by a tuple of items.

    Frozen dataclasses hold it so that a snapshot can be shared between threads and
    compared by value, which a plain ``dict`` would not allow.
    """

    __slots__ = ("_hash", "_items", "_lookup")

    def __init__(self, items: Mapping[K, V] | None = None) -> None:
        pairs = tuple(items.items()) if items is not None else ()
        self._items: tuple[tuple[K, V], ...] = pairs
        self._lookup: dict[K, V] = dict(pairs)
        self._hash: int | None = None

    def __getitem__(self, key: K) -> V:
        return self._lookup[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._lookup)

    def __len__(self) -> int:
        return len(self._lookup)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._lookup.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return dict(self._lookup) == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenMap({self._lookup!r})"

    def __reduce__(self) -> tuple[type[FrozenMap[K, V]], tuple[dict[K, V]]]:
        # Rebuilt from its items by ``copy`` and ``pickle`` (see ``_rebuilt_from_fields``).
        return (type(self), (dict(self._items),))


@dataclass(frozen=True, slots=True)
class Node:
    """A machine with ``gpus`` GPUs of one flavor (for example ``h100``).

    ``topology`` maps a level (for example "block" or "rack") to the domain of that
    level the node sits in; the node itself is the innermost level.
    """

    name: str
    flavor: str
    gpus: int
    topology: Mapping[str, str] = field(default_factory=FrozenMap)

    def __post_init__(self) -> None:
        if not isinstance(self.topology, FrozenMap):
            object.__setattr__(self, "topology", FrozenMap(self.topology))


@dataclass(frozen=True, slots=True)
class FlavorQuota:
    """A queue's quota for one flavor.

    ``guarantee`` GPUs are the queue's own; it may borrow up to ``borrow_limit`` more
    (``None``: no limit) and lend at most ``lend_limit`` of its idle guarantee
    (``None``: all of it).
    """

    guarantee: int = 0
    borrow_limit: int | None = None
    lend_limit: int | None = None


_NO_QUOTA: Final = FlavorQuota()


@dataclass(frozen=True, slots=True)
class Queue:
    """A team in the queue tree. Only leaf queues hold workloads.

    ``weight`` divides the surplus beyond guarantees between siblings; ``quotas`` maps a
    flavor to its quota, and a flavor that is missing has the empty quota.
    ``recent_usage`` maps a flavor to the queue's GPU-seconds used, decayed with the
    snapshot's half-life (a parent without its own figure counts its children's); with
    ``Snapshot.usage_strength`` above 0 it adjusts the weight (see ``shares``).
    """

    name: str
    parent: str | None
    weight: float = 1.0
    quotas: Mapping[str, FlavorQuota] = field(default_factory=FrozenMap)
    recent_usage: Mapping[str, float] = field(default_factory=FrozenMap)

    def __post_init__(self) -> None:
        # Callers may pass a plain dict; store a frozen copy so the queue stays hashable.
        if not isinstance(self.quotas, FrozenMap):
            object.__setattr__(self, "quotas", FrozenMap(self.quotas))
        if not isinstance(self.recent_usage, FrozenMap):
            object.__setattr__(self, "recent_usage", FrozenMap(self.recent_usage))

    def quota(self, flavor: str) -> FlavorQuota:
        """The queue's quota for ``flavor``, the empty quota when none is configured."""
        return self.quotas.get(flavor, _NO_QUOTA)


@dataclass(frozen=True, slots=True)
class PriorityClass:
    """How important a workload is and how it may be preempted.

    ``preemption_policy`` ("PreemptLowerPriority" or "Never") governs only priority
    preemption inside one queue (R7); ``preemptible`` alone decides whether a workload of
    this class may ever be a victim. ``grace_seconds`` is the victim's time to checkpoint,
    ``min_runtime_seconds`` protects a fresh workload from priority, fair-share and
    consolidation preemption (never from reclaim of borrowed GPUs).

    ``min_runtime_by_reason`` maps a preemption reason ("priority", "fair-share",
    "reclaim", "consolidate") to this class's own minimum for it, replacing the default
    (the snapshot's threshold for the reason, raised to ``min_runtime_seconds`` for all
    reasons but reclaim); see ``minimum_runtimes``.

    ``shrink_elastic`` lets a running elastic workload of this class (``Workload.sizes``)
    be resized: shrunk to a smaller size for reclaim, priority or fair share rather than
    evicted whole, and grown back once its team has room. Off, its elastic work runs at
    the size it started at until it ends or is evicted.
    """

    name: str
    value: int
    preemption_policy: str
    preemptible: bool
    grace_seconds: float
    min_runtime_seconds: float = 0.0
    min_runtime_by_reason: Mapping[str, float] = field(default_factory=FrozenMap)
    shrink_elastic: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.min_runtime_by_reason, FrozenMap):
            object.__setattr__(self, "min_runtime_by_reason", FrozenMap(self.min_runtime_by_reason))


@dataclass(frozen=True, slots=True)
class Workload:
    """A gang of ``ranks`` ranks with ``gpus_per_rank`` GPUs each.

    ``state`` is "pending", "running" or "terminating" (a victim in its grace window).
    ``placement`` lists (node name, number of ranks) pairs for running and terminating
    workloads. ``topology_level`` asks for all ranks inside one domain of that level
    of ``Node.topology``. ``preemptor`` is, for a terminating workload, the pending
    workload its GPUs are being freed for: they are kept for that workload while it
    waits, and go to others only once it is planned without them. For a pending
    workload (a victim requeued), it is the workload it gave way to: while that one
    waits too, it is planned first, so that the GPUs the victim freed reach it.

    ``sizes`` makes a gang elastic: every rank count it may run at, ascending, ``ranks``
    among them. A pending elastic gang is admitted at the largest of its sizes up to
    ``ranks`` that fits on free GPUs within its quota; when none does, it is planned as
    a gang of its smallest size, preempting or waiting for that size only. Empty for a
    gang of exactly ``ranks`` ranks. A running elastic gang runs at ``ranks``; when its
    class allows (``PriorityClass.shrink_elastic``) the plan may resize it (``Resize``),
    and its ``admitted_at`` is then the moment of its last start or resize.
    """

    id: str
    queue: str
    priority_class: str
    flavor: str
    ranks: int
    gpus_per_rank: int
    state: str
    submitted_at: float
    admitted_at: float | None = None
    placement: tuple[tuple[str, int], ...] = ()
    last_checkpoint_at: float | None = None
    # All ranks in one domain of this topology level ("rack", say): required, or only
    # preferred when ``topology_required`` is False.
    topology_level: str | None = None
    topology_required: bool = True
    preemptor: str | None = None
    sizes: tuple[int, ...] = ()

    @property
    def gpus(self) -> int:
        """All GPUs of the gang."""
        return self.ranks * self.gpus_per_rank


PRIORITY_MIN_RUNTIME_SECONDS: Final = 0.0
FAIR_SHARE_MIN_RUNTIME_SECONDS: Final = 60.0
RECLAIM_MIN_RUNTIME_SECONDS: Final = 0.0
CONSOLIDATION_MIN_RUNTIME_SECONDS: Final = 600.0
# Slurm's default PriorityDecayHalfLife.
USAGE_HALF_LIFE_SECONDS: Final = 7 * 86_400.0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the engine reads: the cluster at one instant ``now`` (Unix seconds).

    One minimum runtime per preemption reason comes with the snapshot; a running
    workload that started less than that long ago is never taken for that reason:

    ``priority_min_runtime_seconds`` (default 0) and ``reclaim_min_runtime_seconds``
    (default 0): no protection, so that a queue gets its guarantee back at once and
    urgent work goes first. Raising the reclaim minimum delays guarantees by that long.

    ``fair_share_min_runtime_seconds`` (default 60): a fair-share move (R8) never takes
    a job that started less than this long ago. GPUs that came back are handed out by
    queue order; taking them back at once would turn one cycle's admission into the
    next cycle's preemption (the anti-flap margin).

    ``consolidation_min_runtime_seconds`` (default 600): consolidation only moves a
    job that has run at least this long, so that no job is moved twice in quick
    succession.

    A victim's own class minimum (``PriorityClass.min_runtime_seconds``) applies as
    well, for every reason but reclaim: the larger of the two protects it. A class's
    ``min_runtime_by_reason`` replaces both for the reasons it names.

    Decayed usage: ``usage_strength`` (default 0: the surplus goes by weight alone) is
    how strongly each queue's ``recent_usage`` beyond its guarantee, decayed with
    ``usage_half_life_seconds`` (default 7 days), lowers its weight for the surplus
    and its place among the queues below their fair share. Guarantees never change.
    """

    now: float
    nodes: tuple[Node, ...]
    queues: tuple[Queue, ...]
    priority_classes: tuple[PriorityClass, ...]
    workloads: tuple[Workload, ...]
    fair_share_min_runtime_seconds: float = FAIR_SHARE_MIN_RUNTIME_SECONDS
    consolidation_min_runtime_seconds: float = CONSOLIDATION_MIN_RUNTIME_SECONDS
    priority_min_runtime_seconds: float = PRIORITY_MIN_RUNTIME_SECONDS
    reclaim_min_runtime_seconds: float = RECLAIM_MIN_RUNTIME_SECONDS
    usage_strength: float = 0.0
    usage_half_life_seconds: float = USAGE_HALF_LIFE_SECONDS

    def min_runtime_defaults(self) -> dict[str, float]:
        """The snapshot's minimum runtime per preemption reason."""
        return {
            PRIORITY: self.priority_min_runtime_seconds,
            FAIR_SHARE: self.fair_share_min_runtime_seconds,
            RECLAIM: self.reclaim_min_runtime_seconds,
            CONSOLIDATE: self.consolidation_min_runtime_seconds,
        }


def minimum_runtimes(snapshot: Snapshot, priority_class: PriorityClass) -> dict[str, float]:
    """How long a workload of ``priority_class`` runs before it may be taken, per reason.

    The class's ``min_runtime_by_reason`` decides for the reasons it names; otherwise
    the snapshot's threshold applies, raised to the class's ``min_runtime_seconds`` for
    every reason but reclaim (reclaim takes back borrowed GPUs, which a class alone
    may not keep from their owner). The fair-share minimum is never below the reclaim
    minimum nor the snapshot's own (the anti-flap margin).
    """
    minimums = snapshot.min_runtime_defaults()
    floor = priority_class.min_runtime_seconds
    for reason in (PRIORITY, FAIR_SHARE, CONSOLIDATE):
        minimums[reason] = max(minimums[reason], floor)
    minimums.update(priority_class.min_runtime_by_reason)
    # Fair share and reclaim both take work across queues, and fair share only evens
    # out the surplus where reclaim restores a guarantee: a job protected from reclaim
    # is protected from fair share as well, or the weaker reason would take it first.
    # The plan's fair-share minimum is its anti-flap margin, which a class may raise but
    # not lower: below it, GPUs handed out in one cycle would be taken back in the next.
    minimums[FAIR_SHARE] = max(
        minimums[FAIR_SHARE], minimums[RECLAIM], snapshot.fair_share_min_runtime_seconds
    )
    return minimums


@dataclass(frozen=True, slots=True)
class Admission:
    """Start workload ``id`` on ``placement``; ``borrowed`` of its GPUs lie beyond its guarantee.

    ``ranks`` is the size it starts at: the workload's own, or for an elastic one the
    size the plan chose among its ``sizes``."""

    id: str
    placement: tuple[tuple[str, int], ...]
    borrowed: int

    def __init__(self, id: str, placement: tuple[tuple[str, int], ...], borrowed: int) -> None:
        # Written out for the reason ``Waiting`` gives; the same fields, in the same order.
        object.__setattr__(self, "id", id)
        object.__setattr__(self, "placement", placement)
        object.__setattr__(self, "borrowed", borrowed)

    @property
    def ranks(self) -> int:
        """The number of ranks the placement starts."""
        return sum(ranks for _, ranks in self.placement)


@dataclass(frozen=True, slots=True)
class Preemption:
    """Signal every rank of running workload ``id``, giving it ``grace_seconds`` to checkpoint.

    ``reason`` is "reclaim", "priority", "fair-share" or "consolidate" (a small job moved
    off a node so that a gang within its guarantee fits; it restarts at once elsewhere);
    ``preemptor`` is the pending workload the GPUs are freed for.
    """

    id: str
    reason: str
    preemptor: str
    grace_seconds: float

    def __init__(self, id: str, reason: str, preemptor: str, grace_seconds: float) -> None:
        # Written out for the reason ``Waiting`` gives (a plan of the engine benchmark's
        # running-heavy cluster preempts 9,180 workloads); the same fields, in order.
        object.__setattr__(self, "id", id)
        object.__setattr__(self, "reason", reason)
        object.__setattr__(self, "preemptor", preemptor)
        object.__setattr__(self, "grace_seconds", grace_seconds)


@dataclass(frozen=True, slots=True)
class Resize:
    """Run elastic workload ``workload`` at ``ranks`` ranks (one of its sizes) on
    ``placement``: the (node name, ranks) pairs it keeps or gets.

    A shrink frees GPUs for the pending workload ``for_workload``, which waits for them;
    a grow (``for_workload`` None) takes free GPUs. ``reason`` says so in words: "shrunk
    from 8 to 4 ranks to reclaim team a's guarantee for job x", "grown from 4 to 8 ranks".
    """

    workload: str
    ranks: int
    placement: tuple[tuple[str, int], ...]
    reason: str
    for_workload: str | None = None


@dataclass(frozen=True, slots=True)
class Waiting:
    """A pending workload that stays pending, with a sentence saying why.

    ``protected_until`` is set when victims that would let it in exist but are protected
    by their minimum runtime: the moment the last of them may go.
    """

    id: str
    reason: str
    protected_until: float | None = None

    def __init__(self, id: str, reason: str, protected_until: float | None = None) -> None:
        # Written out rather than generated by ``dataclass``, which keeps an ``__init__``
        # a class defines: a plan builds one of these for every workload that waits
        # (49,714 on the engine benchmark's cluster), and compiled (fairshare/native.py)
        # this one runs four times faster than the generated one, which stays
        # interpreted. The same three fields, in the same order.
        object.__setattr__(self, "id", id)
        object.__setattr__(self, "reason", reason)
        object.__setattr__(self, "protected_until", protected_until)


@dataclass(frozen=True, slots=True)
class QueueStatus:
    """One queue's standing for one flavor after the plan.

    ``usage`` counts GPUs held by running, terminating and newly admitted workloads;
    ``fair_share`` is the demand-capped share from hierarchical water-filling;
    ``borrowed`` is usage beyond the guarantee and ``lent`` the part of the idle
    guarantee that other queues use. With decayed usage, ``weight_fair_share`` is the
    fair share by weight alone and ``usage_ratio`` what the queue used recently beyond
    its guarantee relative to its weight's share of its siblings' (1: exactly its share).
    """

    guarantee: int
    usage: int
    fair_share: float
    borrowed: int
    lent: int
    weight_fair_share: float = 0.0
    usage_ratio: float = 1.0


@dataclass(frozen=True, slots=True)
class Plan:
    """All decisions of one scheduling cycle and every queue's status per flavor.

    ``resize`` lists the running elastic workloads the plan shrinks or grows; empty
    unless a class allows it (``PriorityClass.shrink_elastic``)."""

    admit: tuple[Admission, ...]
    preempt: tuple[Preemption, ...]
    waiting: tuple[Waiting, ...]
    queues: Mapping[str, Mapping[str, QueueStatus]]
    resize: tuple[Resize, ...] = ()


class Unset:
    """The type of ``UNSET``: a field of a ``QuotaChange`` that stays as it is."""

    _instance: ClassVar[Unset | None] = None

    def __new__(cls) -> Unset:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> tuple[type[Unset], tuple[()]]:
        # ``copy`` and ``pickle`` give back the one instance.
        return (Unset, ())


UNSET: Final = Unset()


@dataclass(frozen=True, slots=True)
class QuotaChange:
    """A proposed edit of one queue's quota for one flavor (and of its weight).

    Fields left ``UNSET`` keep their value; ``None`` for a limit removes the limit and
    ``None`` for the guarantee means no guarantee.
    """

    queue: str
    flavor: str
    guarantee: int | Unset | None = UNSET
    borrow_limit: int | Unset | None = UNSET
    lend_limit: int | Unset | None = UNSET
    weight: float | Unset = UNSET


@dataclass(frozen=True, slots=True)
class FairShareMove:
    """A queue's fair share for one flavor before and after a quota change."""

    before: float
    after: float


@dataclass(frozen=True, slots=True)
class Consequences:
    """What a quota change would do right now.

    ``reclaimed``: running workloads the new plan would preempt that the current plan
    would not; ``released``: workloads the current plan would preempt and the new one
    spares; ``admitted``: workloads that would newly start; ``fair_share``: every
    queue's fair share per flavor before and after.
    """

    reclaimed: tuple[Preemption, ...]
    released: tuple[str, ...]
    admitted: tuple[Admission, ...]
    fair_share: Mapping[str, Mapping[str, FairShareMove]]

    def to_dict(self) -> dict[str, object]:
        """The JSON-able form printed by ``python -m fairshare diff``."""
        return {
            "reclaimed": [
                {
                    "id": p.id,
                    "reason": p.reason,
                    "preemptor": p.preemptor,
                    "grace_seconds": p.grace_seconds,
                }
                for p in self.reclaimed
            ],
            "released": list(self.released),
            "admitted": [
                {
                    "id": a.id,
                    "placement": [{"node": n, "ranks": r} for n, r in a.placement],
                    "borrowed": a.borrowed,
                }
                for a in self.admitted
            ],
            "fair_share": {
                queue: {
                    flavor: {"before": move.before, "after": move.after}
                    for flavor, move in flavors.items()
                }
                for queue, flavors in self.fair_share.items()
            },
        }


def _rebuilt_from_fields(value: Any) -> tuple[type, tuple[object, ...]]:
    """How ``copy`` and ``pickle`` rebuild one of the frozen dataclasses above: through
    its constructor, from its fields.

    Registered with ``copyreg`` because the compiled model (``native.py``) refuses what
    the default way of rebuilding an object does to a frozen dataclass, setting its
    attributes one by one; through the constructor the copy is the same value, compiled
    or not.
    """
    return (type(value), tuple(getattr(value, f.name) for f in fields(value)))


for _frozen in (
    Node,
    FlavorQuota,
    Queue,
    PriorityClass,
    Workload,
    Snapshot,
    Admission,
    Preemption,
    Resize,
    Waiting,
    QueueStatus,
    Plan,
    QuotaChange,
    FairShareMove,
    Consequences,
):
    copyreg.pickle(_frozen, _rebuilt_from_fields)
