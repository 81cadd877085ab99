"""The jobs of a replay: a job's state as the simulation runs it, and the shapes of its
gang (how a trace job of so many GPUs is split into ranks, fixed or elastic, and which
jobs of a trace are elastic)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from simulation.traces import ClusterNode, TraceJob

# The topology level a gang that asks for one domain asks for.
TOPOLOGY_LEVEL = "rack"


@dataclass(slots=True)
class SimJob:
    """The mutable state of one job during the replay."""

    index: int
    id: str
    name: str
    team: str
    gpus: int
    ranks: int
    gpus_per_rank: int
    duration: float
    submitted_at: float
    state: str = "future"  # future | pending | running | terminating | done | unfit
    attempt: int = 0
    committed: float = 0.0
    admitted_at: float = 0.0
    work_from: float = 0.0
    checkpoints_planned: int = 0
    pending_since: float = 0.0
    pending_seconds: float = 0.0
    workload: Any = None
    preemptions: int = 0
    # Elastic jobs: the rank counts it may run at (empty: a fixed gang).
    sizes: tuple[int, ...] = ()
    # The ranks the current attempt runs at, the share of the work per second that gives
    # (running_ranks / ranks), the running time one checkpoint's work takes, and that plus
    # the save: one period of the attempt.
    running_ranks: int = 0
    rate: float = 1.0
    step: float = 0.0
    period: float = 0.0
    resizes: int = 0

    @property
    def least_gpus(self) -> int:
        """The fewest GPUs it can start on: its smallest size, or all its GPUs."""
        return (self.sizes[0] if self.sizes else self.ranks) * self.gpus_per_rank

    @property
    def held_gpus(self) -> int:
        """The GPUs the current attempt holds."""
        return self.running_ranks * self.gpus_per_rank


def gang_shape(gpus: int, largest_node: int) -> tuple[int, int]:
    """Split a job of ``gpus`` GPUs into (ranks, gpus_per_rank) for nodes of ``largest_node``."""
    if gpus <= largest_node:
        return 1, gpus
    per_rank = max(d for d in range(1, largest_node + 1) if gpus % d == 0)
    return gpus // per_rank, per_rank


def elastic_shape(gpus: int, largest_node: int) -> tuple[int, int, tuple[int, ...]]:
    """The (ranks, gpus_per_rank, sizes) of an elastic job of ``gpus`` GPUs: the fixed
    gang's shape (:func:`gang_shape`) when it has an even number of ranks, else twice the
    ranks of half the GPUs each, else (an odd number of GPUs on one node) ranks of one GPU;
    it may run at any number of ranks from half of them (rounded up) to all."""
    ranks, per_rank = gang_shape(gpus, largest_node)
    if ranks % 2:
        if per_rank % 2 == 0:
            ranks, per_rank = 2 * ranks, per_rank // 2
        else:
            ranks, per_rank = gpus, 1
    return ranks, per_rank, tuple(range((ranks + 1) // 2, ranks + 1))


def elastic_jobs(trace: Sequence[TraceJob], share: float, seed: int) -> set[int]:
    """The indices in ``trace`` of the elastic jobs: ``share`` of its multi-GPU jobs,
    rounded to the nearest whole job, drawn from a generator seeded with ``seed`` (its own
    stream, apart from the teams' draw of the trace loaders)."""
    if not 0 <= share <= 1:
        raise ValueError(f"the elastic share must be between 0 and 1, not {share}")
    multi = [index for index, job in enumerate(trace) if job.gpus > 1]
    count = round(share * len(multi))
    if not count:
        return set()
    return set(random.Random(f"elastic-{seed}").sample(multi, count))


def gang_fits(
    ranks: int, gpus_per_rank: int, nodes: Sequence[ClusterNode], *, one_rack: bool = False
) -> bool:
    """True when an empty cluster can hold the gang (ranks never split across nodes);
    with ``one_rack``, inside a single rack."""
    if not one_rack:
        return sum(node.gpus // gpus_per_rank for node in nodes) >= ranks
    room: dict[str, int] = {}
    for node in nodes:
        rack = node.topology.get(TOPOLOGY_LEVEL, node.name)
        room[rack] = room.get(rack, 0) + node.gpus // gpus_per_rank
    return max(room.values(), default=0) >= ranks
