"""Consolidation (R10 when free GPUs are scattered): which small jobs move so a gang fits.

Decides, for a gang inside its queue's guarantee that finds no node with room while
enough GPUs are free in total, which small jobs to move and where each restarts. Small
jobs finishing at random leave holes on every node, and no reclaim helps when the queues
above their lines hold too little on any one node; moving a few small jobs to the holes
elsewhere clears a node for the gang, and each moved job's queue loses only the restart.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from operator import itemgetter

from .candidates import VictimCandidates
from .ledger import QuotaLedger
from .model import CONSOLIDATE, RECLAIM
from .nodes import NodeMap, Placement
from .preemption import Victims, list_on_nodes, r3_budget, reclaimable_by_node, room_on
from .work import PendingJob, RunningWork, by_gpus, by_order

# How many consolidation searches a plan may run: each is a pass over the running work.
CONSOLIDATIONS_PER_PLAN = 8


def restart_in_any_order(
    rooms_by_size: Mapping[int, int],
    moved: Iterable[tuple[int, int]],
    gang: tuple[int, int] | None,
    requeued: Iterable[int] = (),
) -> bool:
    """Whether the next plan starts the gang (``gang``: ranks, GPUs per rank) and then
    every moved job (``moved``: ranks and GPUs per rank of each, all its ranks on one
    node now), whatever order it plans the moved jobs in, with the jobs reclaimed beside
    them (``requeued``: GPUs of each, one node each) planned anywhere among them: each
    of those takes the room that best fits it, or waits if none holds it. A reclaimed
    job requeued inside its queue's guarantee may well be planned before a moved job and
    take the room the move counted on.

    The gang goes first: every job that gave way to it names it (``Workload.preemptor``)
    and is planned after it while it waits (``FlavorPlanner._pass``), so no moved job
    takes back the node cleared for it. The holes a consolidation keeps for the moved
    jobs bind only this plan. In the next one the moved jobs are pending work like any
    other: each goes, in queue order, to the node with the least room that holds all
    its ranks, else over the nodes with the most room (R10, ``NodeMap.place_free``), not
    to its hole. Best fit depends on the order: with 1, 2 and 3 GPUs free elsewhere,
    jobs of 2, 2, 1 and 1 GPUs all fit when the larger go first, but a 1-GPU job planned
    first takes the single free GPU, the second the node with 2, and one 2-GPU job is
    left without room; it then waits or preempts, and its queue loses more than the
    restart. The queue order of the next plan depends on what it admits, so every order
    is tried here, on ``rooms_by_size`` (how many nodes have each number of GPUs free
    once the plan's victims exit, see ``_RoomsOnceExited``). The moved jobs are few, and
    the search only counts how many of each shape are left, so it stays small.

    Only the sizes of the rooms matter, and a search touches at most one room per rank
    it places (the gang's and the moved jobs') and per requeued job: every placement
    takes the smallest room that holds it or the largest room there is, so with at
    least as many rooms of a size as placements, a room of that size is left for each
    of them, and further rooms of that size change no answer. They are left out: on a large cluster
    thousands of nodes have room, while these searches place a handful of jobs.
    """
    shapes = Counter(moved)
    kinds = sorted(shapes)
    others = Counter(requeued)
    other_kinds = sorted(others)
    settled: set[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = set()

    def place(rooms: tuple[int, ...], gpus: int) -> tuple[int, ...] | None:
        # R10 for one rank: the node with the least room that holds it.
        at = bisect_left(rooms, gpus)
        if at == len(rooms):
            return None
        left = list(rooms[:at] + rooms[at + 1 :])
        insort(left, rooms[at] - gpus)
        return tuple(left)

    def place_gang(
        rooms: tuple[int, ...], ranks: int, gpus_per_rank: int
    ) -> tuple[int, ...] | None:
        # R10 for a gang (NodeMap.place_free): best fit when one node holds all the
        # ranks left, else the node with the most room takes as many as it holds.
        left = list(rooms)
        while True:
            at = bisect_left(left, ranks * gpus_per_rank)
            if at < len(left):
                left[at] -= ranks * gpus_per_rank
                return tuple(sorted(left))
            if not left or left[-1] < gpus_per_rank:
                return None
            fit = left[-1] // gpus_per_rank
            left[-1] -= fit * gpus_per_rank
            ranks -= fit
            left.sort()

    def starts(rooms: tuple[int, ...], counts: tuple[int, ...], waiting: tuple[int, ...]) -> bool:
        key = (rooms, counts, waiting)
        if key in settled:
            return True
        for i, count in enumerate(counts):
            if count:
                after = place_gang(rooms, *kinds[i])
                if after is None:
                    return False
                left = (*counts[:i], count - 1, *counts[i + 1 :])
                if not starts(after, left, waiting):
                    return False
        for i, count in enumerate(waiting):
            if count:
                # Planned here: it starts where it fits best, or waits and takes nothing.
                after = place(rooms, other_kinds[i]) or rooms
                left = (*waiting[:i], count - 1, *waiting[i + 1 :])
                if not starts(after, counts, left):
                    return False
        settled.add(key)
        return True

    placements = (
        sum(ranks * count for (ranks, _), count in shapes.items())
        + sum(others.values())
        + (gang[0] if gang is not None else 0)
    )
    rooms = tuple(
        size
        for size in sorted(rooms_by_size)
        if size > 0
        for _ in range(min(rooms_by_size[size], placements))
    )
    if gang is not None:
        placed = place_gang(rooms, *gang)
        if placed is None:
            return False
        rooms = placed
    return starts(
        rooms,
        tuple(shapes[kind] for kind in kinds),
        tuple(others[kind] for kind in other_kinds),
    )


def consolidate(
    nodes: NodeMap, victims: VictimCandidates, job: PendingJob
) -> tuple[Victims, Placement, list[tuple[int, int]]] | None:
    """Move small jobs so that ``job`` fits; the caller checked its guarantee and free GPUs.

    A job may move when it is preemptible, sits on one node, its ranks are smaller than
    one rank of the gang and it has run its minimum runtime for consolidation; it is
    requeued and restarts at once on GPUs free elsewhere (a "hole" per rank, kept for it
    in this plan): a gang of small ranks may spread over holes that no rank of the gang
    fits in. Nodes are cleared fewest moved GPUs per rank first. Returns the victims,
    the gang's placement and the holes as (node, GPUs), or None.
    """
    workload = job.workload
    gpus_per_rank = workload.gpus_per_rank
    ranks = workload.ranks
    free = nodes.free
    releasing = nodes.releasing
    movable = _movable_by_node(victims, gpus_per_rank, None, by_rank=True)
    offers: list[tuple[tuple[float, float, int], list[RunningWork], int, int]] = []
    for node, runs in movable.items():
        offer = room_on(nodes, node, runs, gpus_per_rank, ranks, None)
        if offer is None:
            continue
        taken, gained = offer
        moved = sum(run.gpus for run in taken)
        offers.append(
            (
                (moved / gained, sum(run.lost for run in taken) / gained, node),
                taken,
                gained,
                node,
            )
        )
    if not offers:
        return None
    offers.sort(key=itemgetter(0))

    # The free GPUs the moved jobs may restart on: nodes with free GPUs, by node.
    spare = {node: gpus for node, gpus in enumerate(free) if gpus > 0}
    rooms = _RoomsOnceExited(nodes)
    hostable = nodes.hostable_ranks(gpus_per_rank)
    cleared: set[int] = set()
    moved_jobs: list[RunningWork] = []
    hole_of: dict[int, list[tuple[int, int]]] = {}
    hosting: set[int] = set()
    moving_ids: set[int] = set()
    for _, runs, gained, node in offers:
        if node in hosting or any(id(run) in moving_ids for run in runs):
            # Moved jobs restart there, or a gang of several nodes moves off it already
            # (its other GPUs here counted): it cannot be cleared as well.
            continue
        filled: dict[int, int] = {}
        found: dict[int, list[tuple[int, int]]] = {}
        for run in sorted(runs, key=lambda run: -run.workload.gpus_per_rank):
            rank_gpus = run.workload.gpus_per_rank
            holes: list[tuple[int, int]] = []
            for _ in range(run.workload.ranks):
                best = min(
                    (
                        other
                        for other, gpus in spare.items()
                        if other != node and gpus - filled.get(other, 0) >= rank_gpus
                    ),
                    key=lambda other: (spare[other] - filled.get(other, 0), other),
                    default=None,
                )
                if best is None:
                    break
                filled[best] = filled.get(best, 0) + rank_gpus
                holes.append((best, rank_gpus))
            if len(holes) < run.workload.ranks:
                break
            found[id(run)] = holes
        if len(found) < len(runs):
            continue
        moving = [*moved_jobs, *runs]
        if not restart_in_any_order(rooms.after(moving), _shapes(moving), None):
            # The next plan might not start them all, whatever the holes kept here.
            continue
        for other, gpus in filled.items():
            spare[other] -= gpus
        spare.pop(node, None)
        hosting.update(filled)
        cleared.add(node)
        moved_jobs.extend(runs)
        for run in runs:
            moving_ids.add(id(run))
        hole_of.update(found)
        hostable += gained
        if hostable >= ranks:
            break
    if hostable < ranks:
        return None
    room_after = {
        node: free[node]
        + releasing[node]
        + sum(gpus for run in moved_jobs for on, gpus in run.nodes if on == node)
        for node in cleared
    }
    placement = nodes.place_on(ranks, gpus_per_rank, room_after)
    if placement is None:
        return None
    used = {node for node, _ in placement}
    # Jobs on a cleared node the placement does not use stay where they are.
    kept = [run for run in moved_jobs if any(node in used for node, _ in run.nodes)]
    if not kept or not restart_in_any_order(
        rooms.after(kept), _shapes(kept), (ranks, gpus_per_rank)
    ):
        return None
    holes = [hole for run in kept for hole in hole_of[id(run)]]
    return [(run, CONSOLIDATE) for run in kept], placement, holes


def _shapes(runs: Iterable[RunningWork]) -> list[tuple[int, int]]:
    """Ranks and GPUs per rank of each of ``runs``, as ``restart_in_any_order`` takes
    moved jobs."""
    return [(run.workload.ranks, run.workload.gpus_per_rank) for run in runs]


def _movable_by_node(
    victims: VictimCandidates,
    gpus_per_rank: int,
    inside: list[bool] | None,
    *,
    by_rank: bool = False,
) -> dict[int, list[RunningWork]]:
    """Per node, the running jobs a consolidation may move off it, in candidate order:
    on one node and smaller than a rank of the gang (with ``by_rank``, on any nodes and
    each rank smaller: they restart rank by rank in holes of that size, and one on
    several nodes is listed on each), past their minimum runtime before consolidation,
    neither a victim nor admitted in this plan, and of a queue that ``inside`` marks
    True (any queue with None)."""
    movable: dict[int, list[RunningWork]] = {}
    for queue, runs in enumerate(victims.by_queue):
        if inside is not None and not inside[queue]:
            continue
        for run in runs:
            if (
                run.victim
                or run.planned
                or run.runtime < run.minimum[CONSOLIDATE]
                or (
                    run.workload.gpus_per_rank >= gpus_per_rank
                    if by_rank
                    else len(run.nodes) != 1 or run.gpus >= gpus_per_rank
                )
            ):
                continue
            list_on_nodes(movable, run)
    return movable


class _RoomsOnceExited:
    """How many nodes have each number of GPUs free in the next plan, once the
    releasing work and a set of victims have exited (the rooms ``restart_in_any_order``
    places the moved jobs on).

    A search asks for many sets of victims while the nodes stay as they are: the count
    over all nodes is made once, and each set of victims only moves the nodes it runs
    on from one size to another.
    """

    __slots__ = ("by_size", "free", "releasing")

    def __init__(self, nodes: NodeMap) -> None:
        self.free = nodes.free
        self.releasing = nodes.releasing
        # Counted when first asked: a search that finds no node to clear never asks,
        # and the nodes do not change while it runs.
        self.by_size: Counter[int] | None = None

    def after(self, victims: Iterable[RunningWork]) -> Counter[int]:
        freed: dict[int, int] = defaultdict(int)
        for run in victims:
            for node, gpus in run.nodes:
                freed[node] += gpus
        if self.by_size is None:
            self.by_size = Counter(
                [
                    free + releasing
                    for free, releasing in zip(self.free, self.releasing, strict=True)
                ]
            )
        by_size = self.by_size.copy()
        for node, gpus in freed.items():
            before = self.free[node] + self.releasing[node]
            by_size[before] -= 1
            by_size[before + gpus] += 1
        return by_size


def reclaim_and_move(
    ledger: QuotaLedger, nodes: NodeMap, victims: VictimCandidates, job: PendingJob
) -> tuple[Victims, Placement, list[tuple[int, int]]] | None:
    """Reclaim and consolidation together, when no node can be cleared by either alone.

    On a full cluster of small jobs the queues above their lines may hold most of every
    node while each node also runs a small job of a queue at or under its line: reclaim
    cannot take that job and consolidation finds no free hole to move it to, so a job
    inside its guarantee would wait until one of them ends. Here a node is cleared of the
    donors' work (reclaim) and of such small jobs, each of which moves to the GPUs of one
    more donor job reclaimed on another node (its hole, kept for it in this plan); every
    donor victim keeps its queue on or above its line (R3). A job moves only when its
    queue stays inside its own guarantee with the gang started, and only when
    the next plan restarts all the moved jobs whatever order it plans them in
    (``restart_in_any_order``). Returns the victims with their reasons, the placement and
    the holes as (node, GPUs), or None.
    """
    workload = job.workload
    gpus_per_rank = workload.gpus_per_rank
    ranks = workload.ranks
    chains, on_node = reclaimable_by_node(ledger, victims, job.queue)
    if not on_node:
        return None
    # Only work of queues that, with the gang started, stay inside their own guarantee
    # moves: the next plan restarts it before the donors' reclaimed work, which goes
    # beyond the donors' guarantees, and so before that work can take its hole. (An
    # ancestor's usage counts the donors' GPUs that this plan reclaims, so it says
    # nothing yet about the next plan.) No donor is inside: a donor runs above its
    # guarantee.
    usage = ledger.usage
    guarantee = ledger.guarantee
    inside = [
        usage[queue] + (job.gpus if queue == job.queue else 0) <= guarantee[queue]
        for queue in range(len(usage))
    ]
    movable = _movable_by_node(victims, gpus_per_rank, inside)
    # The donor jobs that can leave a hole (on one node, not shielded), smallest and
    # then earliest in the order first: a moved job's hole is the first one large
    # enough that is still unclaimed and on another node. Built once, as a search per
    # moved job over every donor made this the plan's largest cost on a large cluster.
    # Sorted twice, stably, by keys read in C: once by the order, then by the size.
    hole_pool = [
        other
        for runs in on_node.values()
        for other in runs
        if len(other.nodes) == 1 and not victims.shielded(other)
    ]
    hole_pool.sort(key=by_order)
    hole_pool.sort(key=by_gpus)
    hole_sizes = [other.gpus for other in hole_pool]
    free = nodes.free
    releasing = nodes.releasing
    rooms = _RoomsOnceExited(nodes)
    # Nodes that need the fewest moved GPUs first: each move costs a restart and a hole.
    # Only nodes that could gain enough with every donor job and every movable job gone:
    # on a full cluster most fall short, and a node's room only shrinks as the search
    # claims donor jobs.
    candidates: list[tuple[int, int]] = []
    for node, runs in movable.items():
        room = free[node] + releasing[node]
        most = min(ranks, nodes.gpus[node] // gpus_per_rank)
        if room // gpus_per_rank >= most:
            continue
        moving_gpus = 0
        for run in runs:
            moving_gpus += run.gpus
        reachable = room + moving_gpus
        for run in on_node.get(node, ()):
            if len(run.nodes) == 1:
                reachable += run.gpus
        if reachable // gpus_per_rank >= most:
            candidates.append((moving_gpus, node))
    candidates.sort()
    taken_from: dict[int, int] = defaultdict(int)
    chosen: dict[int, tuple[RunningWork, str]] = {}
    holes: list[tuple[int, int]] = []
    hole_nodes: set[int] = set()
    room_after: dict[int, int] = {}
    hostable = nodes.hostable_ranks(gpus_per_rank)
    for _, node in candidates:
        if node in hole_nodes or node in room_after:
            continue
        most = min(ranks, nodes.gpus[node] // gpus_per_rank)
        room = free[node] + releasing[node]
        before = room // gpus_per_rank
        if before >= most:
            continue
        # All it could gain, before the order of what goes is worked out: on a full
        # cluster most nodes fall short even with every donor job and every movable
        # job gone.
        reachable = room + sum(run.gpus for run in movable[node])
        for run in on_node.get(node, ()):
            if len(run.nodes) == 1 and id(run) not in chosen:
                reachable += run.gpus
        if reachable // gpus_per_rank < most:
            continue
        reclaimed: list[RunningWork] = []
        for run in sorted(on_node.get(node, ()), key=by_order):
            if id(run) in chosen or victims.shielded(run) or len(run.nodes) != 1:
                continue
            reclaimed.append(run)
            room += run.gpus
            if room // gpus_per_rank >= most:
                break
        moved: list[RunningWork] = []
        for run in sorted(movable[node], key=lambda run: -run.gpus):
            if room // gpus_per_rank >= most:
                break
            moved.append(run)
            room += run.gpus
        if room // gpus_per_rank < most or not moved:
            continue
        # A hole for each moved job: the GPUs of a donor job on another node.
        hole_victims: list[tuple[RunningWork, RunningWork]] = []
        used: set[int] = set()
        for run in moved:
            hole = None
            for at in range(bisect_left(hole_sizes, run.gpus), len(hole_pool)):
                other = hole_pool[at]
                other_node = other.nodes[0][0]
                if (
                    other_node != node
                    and other_node not in room_after
                    and id(other) not in chosen
                    and id(other) not in used
                ):
                    hole = other
                    break
            if hole is None:
                break
            used.add(id(hole))
            hole_victims.append((run, hole))
        if len(hole_victims) < len(moved):
            continue
        exiting = [
            *[run for run, _ in chosen.values()],
            *reclaimed,
            *[run for pair in hole_victims for run in pair],
        ]
        moving = [run for run, reason in chosen.values() if reason == CONSOLIDATE]
        requeued = _requeued_inside_guarantee(
            ledger,
            exiting,
            [
                *[run for run, reason in chosen.values() if reason == RECLAIM],
                *reclaimed,
                *[hole for _, hole in hole_victims],
            ],
        )
        if not restart_in_any_order(
            rooms.after(exiting), _shapes([*moving, *moved]), None, requeued
        ):
            # The next plan might not start them all, whatever the holes kept here.
            continue
        extra = r3_budget(
            ledger, chains, taken_from, [*reclaimed, *[hole for _, hole in hole_victims]]
        )
        if extra is None:
            continue
        for x, gpus in extra.items():
            taken_from[x] += gpus
        for run in reclaimed:
            chosen[id(run)] = (run, RECLAIM)
        for run, hole in hole_victims:
            chosen[id(run)] = (run, CONSOLIDATE)
            chosen[id(hole)] = (hole, RECLAIM)
            holes.append((hole.nodes[0][0], run.gpus))
            hole_nodes.add(hole.nodes[0][0])
        room_after[node] = room
        hostable += room // gpus_per_rank - before
        if hostable >= ranks:
            break
    if hostable < ranks:
        return None
    placement = nodes.place_on(ranks, gpus_per_rank, room_after)
    if placement is None or not any(node in room_after for node, _ in placement):
        return None
    if not restart_in_any_order(
        rooms.after([run for run, _ in chosen.values()]),
        _shapes([run for run, reason in chosen.values() if reason == CONSOLIDATE]),
        (ranks, gpus_per_rank),
        _requeued_inside_guarantee(
            ledger,
            [run for run, _ in chosen.values()],
            [run for run, reason in chosen.values() if reason == RECLAIM],
        ),
    ):
        return None
    return list(chosen.values()), placement, holes


def _requeued_inside_guarantee(
    ledger: QuotaLedger, leaving: list[RunningWork], reclaimed: list[RunningWork]
) -> list[int]:
    """The GPUs of each job of ``reclaimed`` that its queue's own guarantee holds once
    every job of ``leaving`` has left: requeued, it is work inside its guarantee in the
    next plan, planned by age beside the moved jobs, and may take the room a move
    counts on. The others are planned after them."""
    usage_after: dict[int, int] = {}
    for run in leaving:
        usage_after[run.queue] = usage_after.get(run.queue, ledger.usage[run.queue]) - run.gpus
    return [
        run.gpus
        for run in reclaimed
        if usage_after.get(run.queue, ledger.usage[run.queue]) + run.gpus
        <= ledger.guarantee[run.queue]
    ]
