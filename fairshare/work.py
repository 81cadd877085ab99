"""The work the planner handles: running workloads as candidate victims, pending
workloads as jobs to plan, and the order each is taken in.

Owns R9's order of victims (``RunningWork.order``, from ``rules.r9_victim_order``) and
the order of a queue's pending jobs (``in_queue_order``), and the key of a queue in a
pass's order (``QueueKey``, which ``cycle.py`` computes). Holds and orders work; never
judges whether a candidate may be taken (``candidates.py``) nor plans a job.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from operator import attrgetter

from .model import PREEMPT_LOWER_PRIORITY, PriorityClass, Workload
from .rules import r9_lost_gpu_seconds, r9_victim_order

_INF = float("inf")

# R9's order of victims, cheapest first (``rules.r9_victim_order``: priority, lost
# GPU-seconds, minus the admission time, id). Typed as a tuple of any length on
# purpose: compiled, a tuple of fixed length is kept unboxed, and every read of a
# candidate's order would build a new tuple and new floats (the victim scans read them
# for every heap entry); a tuple of any length is kept as it is.
VictimOrder = tuple[object, ...]

# The sort key of a candidate or a pending job: its ``order``, read by the sort in C.
by_order = attrgetter("order")
# The same for a candidate's GPUs.
by_gpus = attrgetter("gpus")


class RunningWork:
    """A running workload (or one admitted earlier in this plan) as a candidate victim."""

    __slots__ = (
        "gpus",
        "lost",
        "minimum",
        "nodes",
        "order",
        "order_id",
        "order_newer",
        "order_priority",
        "planned",
        "preempts_lower",
        "priority_class",
        "queue",
        "runtime",
        "shield_version",
        "shielded",
        "victim",
        "workload",
    )

    def __init__(
        self,
        workload: Workload,
        queue: int,
        priority_class: PriorityClass,
        nodes: tuple[tuple[int, int], ...],
        now: float,
        minimum: Mapping[str, float],
        planned: bool = False,
    ) -> None:
        self.workload = workload
        # Per preemption reason: the seconds it runs before it may be taken for it.
        self.minimum = minimum
        # Admitted earlier in this same plan rather than running in the snapshot; its
        # ``workload`` is then the pending workload that was admitted.
        self.planned = planned
        self.queue = queue
        self.priority_class = priority_class
        # Whether its class preempts lower priorities (R7), read for every candidate a
        # scan steps over (``VictimCandidates.shielded``) without comparing strings.
        self.preempts_lower = priority_class.preemption_policy == PREEMPT_LOWER_PRIORITY
        self.gpus = workload.gpus
        # (node index, GPUs on that node) pairs.
        self.nodes = nodes
        # Taken as a victim in this plan.
        self.victim = False
        # Work admitted in this plan starts now: its workload is the pending one, which
        # has no admission of its own yet (or that of an earlier attempt).
        admitted = now if planned else workload.admitted_at
        # The GPU-seconds it would lose (R9), the second part of its order.
        self.lost = r9_lost_gpu_seconds(self.gpus, now, admitted, workload.last_checkpoint_at)
        order = r9_victim_order(priority_class.value, self.lost, admitted, workload.id)
        self.order: VictimOrder = order
        # The order's other parts, each as it is, for the victim scans' heaps to compare
        # (``candidates.ScanEntry``); the second part is ``lost``.
        self.order_priority = order[0]
        self.order_newer = order[2]
        self.order_id = order[3]
        # Seconds since admission; the snapshot's clock does not move during a plan.
        self.runtime = _INF if admitted is None else now - admitted
        # The answer of VictimCandidates.shielded and the queue's shield version it holds for.
        self.shield_version = -1
        self.shielded = False


class PendingJob:
    """A pending workload as the planner sees it."""

    __slots__ = (
        "attempted_at_version",
        "gpus",
        "priority",
        "priority_class",
        "queue",
        "submitted_at",
        "workload",
    )

    def __init__(self, workload: Workload, queue: int, priority_class: PriorityClass) -> None:
        self.workload = workload
        self.queue = queue
        self.priority_class = priority_class
        self.gpus = workload.gpus
        # Its place inside its queue (``in_queue_order``): higher priority first, then
        # older submission, then id.
        self.priority = priority_class.value
        self.submitted_at = workload.submitted_at
        # The planner's candidates version when it last tried to preempt for it, -1
        # before it ever did: a later pass retries it only once new candidates came.
        self.attempted_at_version = -1

    def at_size(self, ranks: int) -> PendingJob:
        """This elastic job as a gang of exactly ``ranks`` ranks, for one size the
        planner tries; it shares the job's place in its queue."""
        sized = PendingJob(
            dataclasses.replace(self.workload, ranks=ranks, sizes=()),
            self.queue,
            self.priority_class,
        )
        sized.attempted_at_version = self.attempted_at_version
        return sized


_by_submission = attrgetter("submitted_at")


def in_queue_order(jobs: list[PendingJob]) -> None:
    """Sort a queue's pending ``jobs``: higher priority first, then older submission,
    then id.

    Sorted by submission time and then, stably, by priority rather than by one tuple key:
    a sort of plain floats or plain ints compares them directly, while a tuple key is
    compared element by element through Python's generic comparison, and sorting the
    pending jobs was the largest part of a plan's set-up. Jobs of one priority submitted
    at the same moment are few; each run of them is sorted by id afterwards.
    """
    jobs.sort(key=_by_submission)
    # Then stably by priority: the priorities are those of a few classes, so the jobs are
    # dealt out by priority rather than sorted a second time.
    by_priority: dict[int, list[PendingJob]] = {}
    for job in jobs:
        same_priority = by_priority.get(job.priority)
        if same_priority is None:
            by_priority[job.priority] = [job]
        else:
            same_priority.append(job)
    if len(by_priority) > 1:
        jobs[:] = [
            job for priority in sorted(by_priority, reverse=True) for job in by_priority[priority]
        ]
    end = len(jobs)
    start = 0
    while start < end:
        first = jobs[start]
        stop = start + 1
        while (
            stop < end
            and jobs[stop].submitted_at == first.submitted_at
            and jobs[stop].priority == first.priority
        ):
            stop += 1
        if stop - start > 1:
            jobs[start:stop] = sorted(jobs[start:stop], key=_by_id)
        start = stop


def _by_id(job: PendingJob) -> str:
    return job.workload.id


class QueueKey:
    """The key of a queue in a pass's heap: how far beyond the guarantees its next job
    goes (``rank``, as ``order.FlavorOrder._guarantee_rank`` says), INSIDE_OWN_GUARANTEE for a job inside its
    queue's own guarantee and otherwise usage minus fair share (``distance``, see
    ``FlavorOrder._queue_key``), the next job's submission, the queue's name and index, compared in
    that order.

    A class with its own comparison rather than the tuple of them: compiled, ``__lt__``
    compares them as numbers, while a tuple goes through Python's generic comparison
    for each pair of items (see ``candidates.ScanEntry``).
    """

    __slots__ = ("distance", "name", "queue", "rank", "submitted")

    def __init__(self, rank: int, distance: float, submitted: float, name: str, queue: int) -> None:
        self.rank = rank
        self.distance = distance
        self.submitted = submitted
        self.name = name
        self.queue = queue

    def __lt__(self, other: QueueKey) -> bool:
        if self.rank != other.rank:
            return self.rank < other.rank
        if self.distance != other.distance:
            return self.distance < other.distance
        if self.submitted != other.submitted:
            return self.submitted < other.submitted
        if self.name != other.name:
            return self.name < other.name
        return self.queue < other.queue


# The second part of the key of a job inside its queue's own guarantee: before any other
# work of its guarantee rank, and among such jobs the older submission first.
INSIDE_OWN_GUARANTEE = -math.inf
