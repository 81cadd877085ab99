"""Elastic gangs that run: which of them give up ranks to a pending workload instead of
being evicted whole (a shrink), and how one grows back into room that nobody waits for.

A running elastic gang (``Workload.sizes``) whose class allows it
(``PriorityClass.shrink_elastic``) may be shrunk for reclaim, priority or fair share on
the terms on which it may be evicted for that reason: past its minimum runtime for the
reason, its queue (and the queues up to the common ancestor with the preemptor's) above
their guarantee lines before the plan, R3, R7 and R8. The rules are judged for the GPUs
the shrink frees, not for the whole gang, and a shrink never straddles a line: it gives
only what keeps its queue on or above it. A gang goes down to one of its smaller sizes,
never below its smallest.

A shrink costs the gang a restart at the step its ranks agree on: all its GPUs lose the
work since its last checkpoint (R9's lost GPU-seconds for the whole gang, as an eviction
would) but it runs on at once, while an evicted gang also loses its GPUs for as long as
it waits to come back. The planner takes the shrinks when they cost no more than the
evictions the same search would take (``shrink_costs_less``).

Decides which gangs shrink and where their ranks go, and whether and where a gang grows;
the planner records the decisions (``decisions.py``) and chooses when to ask
(``cycle.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from .ledger import QuotaLedger
from .model import FAIR_SHARE, PRIORITY, RECLAIM, Workload
from .nodes import NodeMap, Placement
from .preemption import MAX_CANDIDATES_PER_ATTEMPT
from .rules import r3_guarantee_overshoot, r7_may_preempt_by_priority, r8_may_preempt_for_fair_share
from .work import PendingJob, RunningWork

# What a set of shrinks or of evictions costs: the highest priority among the gangs it
# takes from (R9 orders victims by priority first), then the GPU-seconds they lose.
Cost = tuple[float, float]


class Shrink:
    """Running elastic gang ``run`` shrunk to ``ranks`` for ``reason``; ``freed`` maps a
    node index to the ranks it gives up there."""

    __slots__ = ("freed", "ranks", "reason", "run")

    def __init__(self, run: RunningWork, ranks: int, freed: dict[int, int], reason: str) -> None:
        self.run = run
        self.ranks = ranks
        self.freed = freed
        self.reason = reason

    @property
    def gpus(self) -> int:
        """The GPUs the shrink frees."""
        return (self.run.workload.ranks - self.ranks) * self.run.workload.gpus_per_rank

    def kept(self, names: Sequence[str]) -> tuple[tuple[str, int], ...]:
        """Where the gang runs after the shrink: (node name, ranks) in its own order."""
        gpus_per_rank = self.run.workload.gpus_per_rank
        kept: list[tuple[str, int]] = []
        for node, gpus in self.run.nodes:
            ranks = gpus // gpus_per_rank - self.freed.get(node, 0)
            if ranks > 0:
                kept.append((names[node], ranks))
        return tuple(kept)


def may_shrink(run: RunningWork) -> bool:
    """Whether running ``run`` is an elastic gang its class lets shrink, above its
    smallest size (work admitted in this plan has not started, and is withdrawn whole)."""
    sizes = run.workload.sizes
    return (
        run.priority_class.shrink_elastic
        and not run.planned
        and bool(sizes)
        and run.workload.ranks > sizes[0]
    )


def may_grow(workload: Workload, shrink_elastic: bool) -> bool:
    """Whether running ``workload`` is an elastic gang its class lets resize, below its
    largest size."""
    return shrink_elastic and bool(workload.sizes) and workload.ranks < workload.sizes[-1]


def shrink_costs_less(shrink: Cost, eviction: Cost) -> bool:
    """Whether shrinks of ``shrink`` cost are taken rather than evictions of ``eviction``.

    Both lose the work since the last checkpoint of every gang they touch; an evicted
    gang loses its GPUs for its wait as well, so a shrink wins a tie.
    """
    return shrink <= eviction


def shrinks_cost(shrinks: Sequence[Shrink]) -> Cost:
    """What ``shrinks`` cost: the highest priority shrunk, and the work since the last
    checkpoint of every rank of those gangs (each restarts whole)."""
    return (
        float(max(shrink.run.priority_class.value for shrink in shrinks)),
        sum(shrink.run.lost for shrink in shrinks),
    )


def evictions_cost(victims: Sequence[tuple[RunningWork, str]]) -> Cost:
    """What evicting ``victims`` costs: the highest priority taken, and R9's lost work."""
    return (
        float(max(run.priority_class.value for run, _ in victims)),
        sum(run.lost for run, _ in victims),
    )


def may_give(ledger: QuotaLedger, run: RunningWork, job: PendingJob, mode: str, gpus: int) -> bool:
    """Whether ``run`` may give ``gpus`` of its GPUs to ``job`` for ``mode`` (reclaim,
    priority, fair share), on the terms an eviction of that many GPUs would meet."""
    if run.victim or run.runtime < run.minimum[mode]:
        return False
    queue = job.queue
    if mode == PRIORITY:
        return run.queue == queue and r7_may_preempt_by_priority(
            job.priority_class, run.priority_class, run.runtime, run.minimum[PRIORITY]
        )
    if run.queue == queue:
        return False
    tree = ledger.tree
    found = tree.lca_row(queue)[run.queue]
    if found is None:
        found = tree.lca_chains(queue, run.queue)
    chain, side_of_queue, side_of_donor = found
    usage = ledger.usage
    waiting = ledger.waiting_usage
    planned = ledger.planned_usage
    line = ledger.line
    # The guarantee line holds against the plan's own work, as for an eviction
    # (VictimCandidates._above_line_before_plan).
    for x in chain:
        if usage[x] - waiting[x] - planned[x] <= line[x]:
            return False
    # A shrink gives only what keeps every queue on or above its line (R3): unlike an
    # evicted gang, a shrunk one can always give less.
    for x in chain:
        if r3_guarantee_overshoot(usage[x] - waiting[x], line[x], gpus) != 0:
            return False
    if mode == RECLAIM:
        return True
    if mode != FAIR_SHARE or side_of_queue == side_of_donor:
        return False
    fair = ledger.fair_share
    for x in chain:
        if usage[x] - gpus < fair[x] - 1e-9:
            return False
    return r8_may_preempt_for_fair_share(
        usage[side_of_queue],
        fair[side_of_queue],
        job.gpus,
        usage[side_of_donor],
        fair[side_of_donor],
        gpus,
    )


def ranks_to_free(
    nodes: NodeMap, run: RunningWork, count: int, prefer: Sequence[int]
) -> dict[int, int]:
    """Which ``count`` ranks of ``run`` go: those on the nodes of ``prefer`` (where the
    waiting work is placed) first, then those on the nodes with the most room, so that
    the freed GPUs lie together with the free ones."""
    gpus_per_rank = run.workload.gpus_per_rank
    preferred = set(prefer)
    order: list[tuple[bool, int, int, int]] = []
    for node, gpus in run.nodes:
        room = nodes.free[node] + nodes.releasing[node]
        order.append((node not in preferred, -room, node, gpus // gpus_per_rank))
    order.sort()
    freed: dict[int, int] = {}
    left = count
    for _, _, node, ranks in order:
        if left <= 0:
            break
        take = min(ranks, left)
        freed[node] = take
        left -= take
    return freed


def placement_after(
    ledger: QuotaLedger, nodes: NodeMap, job: PendingJob, shrinks: Sequence[Shrink]
) -> Placement | None:
    """Where ``job`` goes once ``shrinks`` are done (the GPUs they free already taken
    from their gangs' queues in ``ledger``), or None when its quota or the nodes do not
    let it in."""
    workload = job.workload
    if ledger.quota_reason(job.queue, workload.gpus, job.priority_class) is not None:
        return None
    room: dict[int, int] = {}
    for shrink in shrinks:
        gpus_per_rank = shrink.run.workload.gpus_per_rank
        for node, ranks in shrink.freed.items():
            before = room.get(node)
            if before is None:
                before = nodes.free[node] + nodes.releasing[node]
            room[node] = before + ranks * gpus_per_rank
    if not room:
        return None
    return nodes.place_on(workload.ranks, workload.gpus_per_rank, room)


def shrink_for(
    ledger: QuotaLedger,
    nodes: NodeMap,
    elastic: Sequence[RunningWork],
    job: PendingJob,
    mode: str,
) -> tuple[list[Shrink], Placement] | None:
    """The shrinks of running ``elastic`` gangs (in R9's order) that let ``job`` in for
    ``mode``, and its placement; None when none do.

    Gangs are shrunk cheapest first, each to the smallest size the rules allow, until
    the job fits; then each, the costliest first, keeps as many ranks as still let the
    job in, giving up first those on the nodes the job goes to, and a gang the job does
    not need is left whole. On success the GPUs the shrinks free stay taken from their
    gangs' queues in ``ledger``, as ``preemption.preempt_for`` leaves its victims'; on
    failure every tentative change is undone.
    """
    chosen: list[Shrink] = []
    found: Placement | None = None
    examined = 0
    for run in elastic:
        if run.victim:
            continue
        # Bounded as an eviction search is, for the same reason.
        examined += 1
        if examined > MAX_CANDIDATES_PER_ATTEMPT:
            break
        workload = run.workload
        for size in workload.sizes:
            if size >= workload.ranks:
                break
            gpus = (workload.ranks - size) * workload.gpus_per_rank
            if may_give(ledger, run, job, mode, gpus):
                shrink = Shrink(
                    run, size, ranks_to_free(nodes, run, workload.ranks - size, ()), mode
                )
                ledger.add_usage(run.queue, -gpus)
                chosen.append(shrink)
                found = placement_after(ledger, nodes, job, chosen)
                break
        if found is not None:
            break
    if found is None:
        give_back(ledger, chosen)
        return None
    for i in range(len(chosen) - 1, -1, -1):
        shrink = chosen[i]
        run = shrink.run
        workload = run.workload
        used = [node for node, _ in found]
        ledger.add_usage(run.queue, shrink.gpus)
        improved = False
        # Larger sizes first (the gang's own size: left whole), down to the size chosen,
        # whose ranks are then picked again on the nodes the job goes to.
        for size in reversed(workload.sizes):
            if size < shrink.ranks:
                break
            if size > workload.ranks:
                continue
            trial: list[Shrink] = []
            gpus = (workload.ranks - size) * workload.gpus_per_rank
            if gpus:
                if not may_give(ledger, run, job, mode, gpus):
                    continue
                freed = ranks_to_free(nodes, run, workload.ranks - size, used)
                trial.append(Shrink(run, size, freed, mode))
            ledger.add_usage(run.queue, -gpus)
            others = [*chosen[:i], *trial, *chosen[i + 1 :]]
            placement = placement_after(ledger, nodes, job, others) if others else None
            if placement is not None:
                chosen = others
                found = placement
                improved = True
                break
            ledger.add_usage(run.queue, gpus)
        if not improved:
            # Nothing better: the shrink stays as chosen.
            ledger.add_usage(run.queue, -shrink.gpus)
    return chosen, found


def give_back(ledger: QuotaLedger, shrinks: Sequence[Shrink]) -> None:
    """Count again the GPUs ``shrinks`` took from their gangs' queues."""
    for shrink in shrinks:
        ledger.add_usage(shrink.run.queue, shrink.gpus)


def take_again(ledger: QuotaLedger, shrinks: Sequence[Shrink]) -> None:
    """Take the GPUs of ``shrinks`` from their gangs' queues again, after ``give_back``."""
    for shrink in shrinks:
        ledger.add_usage(shrink.run.queue, -shrink.gpus)


def grow_placement(nodes: NodeMap, workload: Workload, ranks: int) -> Placement | None:
    """Where ``ranks`` more ranks of running ``workload`` go on free GPUs: on its own
    nodes first, then best fit elsewhere (R10); None when they do not fit. Claims
    nothing."""
    gpus_per_rank = workload.gpus_per_rank
    added: dict[int, int] = {}
    left = ranks
    for name, _ in workload.placement:
        node = nodes.index[name]
        fit = min(nodes.free[node] // gpus_per_rank, left)
        if fit > 0:
            added[node] = fit
            left -= fit
    if left <= 0:
        return list(added.items())
    # The rest elsewhere: the own nodes' free GPUs are set aside while it looks.
    for node, fit in added.items():
        nodes.set_free(node, nodes.free[node] - fit * gpus_per_rank)
    elsewhere = nodes.place_free(left, gpus_per_rank)
    for node, fit in added.items():
        nodes.set_free(node, nodes.free[node] + fit * gpus_per_rank)
    if elsewhere is None:
        return None
    for node, fit in elsewhere:
        added[node] = added.get(node, 0) + fit
    return list(added.items())


def grown_placement(
    names: Sequence[str], index: dict[str, int], workload: Workload, added: Placement
) -> tuple[tuple[str, int], ...]:
    """``workload``'s placement with the ranks of ``added`` (node index, ranks) on top:
    its own nodes in their order, then the new ones."""
    extra = dict(added)
    placement: list[tuple[str, int]] = []
    for name, ranks in workload.placement:
        placement.append((name, ranks + extra.pop(index[name], 0)))
    for node, ranks in extra.items():
        placement.append((names[node], ranks))
    return tuple(placement)
