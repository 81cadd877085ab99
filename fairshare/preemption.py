"""Preemption (R9, R10): which of the candidate victims a pending workload takes.

Decides the set of victims for one preemptor: the cheapest candidates, added until the
gang fits on real nodes within its quotas, then trimmed of every victim it can do
without (most expensive first) and of victims on nodes the placement does not use. When
the cheapest reclaim victims are scattered over many nodes, a second search clears
whole nodes instead (``reclaim_by_node``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from heapq import heapify, heappop

from .candidates import VictimCandidates
from .ledger import QuotaLedger
from .model import RECLAIM
from .nodes import NodeMap, Placement
from .rules import r3_guarantee_overshoot
from .work import PendingJob, RunningWork, by_order

# A failed preemption attempt examines at most this many candidate victims. It bounds a
# plan's time on a saturated cluster; a workload that needs more victims than that waits.
MAX_CANDIDATES_PER_ATTEMPT = 128

# Victims with the reason each is taken for.
Victims = list[tuple[RunningWork, str]]


class _RoomTally:
    """One search's view of the nodes: per node, its GPUs once the releases and the
    victims chosen so far are done (only nodes of ``domain`` count when one is given).

    A class rather than a closure inside ``preempt_for``: compiled, a method is called
    directly, a closure through Python's calling convention, once per candidate.
    """

    __slots__ = ("free", "gpus_per_rank", "inside", "ledger", "releasing", "room")

    def __init__(
        self,
        ledger: QuotaLedger,
        nodes: NodeMap,
        gpus_per_rank: int,
        domain: Sequence[int] | None,
    ) -> None:
        self.ledger = ledger
        self.free = nodes.free
        self.releasing = nodes.releasing
        self.gpus_per_rank = gpus_per_rank
        self.inside: set[int] | None = None if domain is None else set(domain)
        # Per node: its GPUs once the releases and the victims chosen so far are done,
        # or -1 where none of them runs: the node map's scratch list, which
        # ``room_after`` leaves as it found it for the next search. A list rather than a
        # dict keyed by node: compiled, each key made an int object, for every node of
        # every candidate tried.
        self.room = nodes.room_scratch

    def shift(self, run: RunningWork, sign: int) -> int:
        """Take (``sign`` +1) or give back (-1) ``run``'s GPUs and quota usage; the
        ranks of ``gpus_per_rank`` GPUs that adds (fewer when negative)."""
        gpus_per_rank = self.gpus_per_rank
        inside = self.inside
        room = self.room
        free = self.free
        releasing = self.releasing
        change = 0
        for node, on_node in run.nodes:
            if inside is not None and node not in inside:
                continue
            old = room[node]
            if old < 0:
                old = free[node] + releasing[node]
            # Added or taken rather than multiplied by ``sign``: compiled, a product of
            # ints is a call.
            new = old + on_node if sign > 0 else old - on_node
            room[node] = new
            change += new // gpus_per_rank - old // gpus_per_rank
        self.ledger.add_usage(run.queue, -run.gpus if sign > 0 else run.gpus)
        return change

    def room_after(self, tried: Victims) -> dict[int, int]:
        """Node -> its GPUs once the releases and the victims chosen are done, for the
        nodes of ``tried`` (every candidate taken in, in the order they were), in the
        order they were first counted; the scratch list is cleared for the next search."""
        inside = self.inside
        room = self.room
        after: dict[int, int] = {}
        for run, _ in tried:
            for node, _ in run.nodes:
                if inside is not None and node not in inside:
                    continue
                if room[node] >= 0:
                    after[node] = room[node]
                    room[node] = -1
        return after

    def clear(self, tried: Victims) -> None:
        """Clear the scratch list for the next search, as ``room_after`` does, where no
        placement follows (a failed search's up to 128 candidates)."""
        room = self.room
        for run, _ in tried:
            for node, _ in run.nodes:
                room[node] = -1


def preempt_for(
    ledger: QuotaLedger,
    nodes: NodeMap,
    job: PendingJob,
    candidates: Iterable[tuple[RunningWork, str]],
    domain: Sequence[int] | None = None,
) -> tuple[Victims, Placement] | None:
    """Pick the cheapest victims that let ``job`` fit on real nodes within its quotas.

    Victims are added cheapest first until the gang fits (counting free and releasing
    GPUs first, R11); then every victim whose return still lets it fit is dropped,
    most expensive first (R9); victims on nodes the placement does not use free
    nothing and are dropped too (R10). On success the victims' quota usage stays
    removed; on failure every tentative change is undone. With a topology ``domain``
    (node indices) only GPUs freed inside it count and the gang is placed there.
    """
    workload = job.workload
    gpus_per_rank = workload.gpus_per_rank
    ranks = workload.ranks
    gpus = workload.gpus
    queue = job.queue
    priority_class = job.priority_class
    hostable = (
        nodes.hostable_ranks(gpus_per_rank)
        if domain is None
        else nodes.hostable_in(domain, gpus_per_rank)
    )
    tally = _RoomTally(ledger, nodes, gpus_per_rank, domain)
    chosen: Victims = []

    fits = False
    # Counted by hand rather than by enumerate(): compiled, enumerate over an iterator
    # builds a tuple and an int object for every candidate.
    examined = 0
    for run, reason in candidates:
        examined += 1  # noqa: SIM113 (see above)
        if examined > MAX_CANDIDATES_PER_ATTEMPT:
            break
        hostable += tally.shift(run, +1)
        chosen.append((run, reason))
        if hostable >= ranks and ledger.quota_reason(queue, gpus, priority_class) is None:
            fits = True
            break
    if not fits:
        # The node tallies die with this attempt; only the quota usage has to be
        # given back, one queue at a time (a failed attempt took up to 129 victims,
        # of a few queues).
        tally.clear(chosen)
        # Summed per queue in the ledger's scratch list, the queues in the order they
        # first came: compiled, a dict made an int object for each key and sum.
        given = ledger.given_scratch
        queues: list[int] = []
        for run, _ in chosen:
            victim_queue = run.queue
            if not given[victim_queue]:
                queues.append(victim_queue)
            given[victim_queue] = given[victim_queue] + run.gpus
        for victim_queue in queues:
            victim_gpus = given[victim_queue]
            given[victim_queue] = 0
            ledger.add_usage(victim_queue, victim_gpus)
        return None
    tried = chosen[:]
    for i in range(len(chosen) - 1, -1, -1):
        run = chosen[i][0]
        change = tally.shift(run, -1)
        if hostable + change >= ranks and ledger.quota_reason(queue, gpus, priority_class) is None:
            hostable += change
            chosen.pop(i)
        else:
            tally.shift(run, +1)
    room_after = tally.room_after(tried)
    placement = (
        nodes.place_on(ranks, gpus_per_rank, room_after)
        if domain is None
        else nodes.place_in(domain, ranks, gpus_per_rank, room_after)
    )
    if placement is None:
        for run, _ in reversed(chosen):
            ledger.add_usage(run.queue, run.gpus)
        return None
    # A victim on nodes the placement does not use frees nothing there; it stays only
    # when the quotas need its GPUs back (R10).
    used = {node for node, _ in placement}
    kept: Victims = []
    for run, reason in reversed(chosen):
        if not any(node in used for node, _ in run.nodes):
            ledger.add_usage(run.queue, run.gpus)
            if ledger.quota_reason(queue, gpus, priority_class) is None:
                continue
            ledger.add_usage(run.queue, -run.gpus)
        kept.append((run, reason))
    kept.reverse()
    if ledger.quota_reason(queue, gpus, priority_class) is not None or not kept:
        for run, _ in kept:
            ledger.add_usage(run.queue, run.gpus)
        return None
    return kept, placement


def room_on(
    nodes: NodeMap,
    node: int,
    runs: list[RunningWork],
    gpus_per_rank: int,
    ranks: int,
    shields: VictimCandidates | None,
) -> tuple[list[RunningWork], int] | None:
    """The cheapest of ``runs`` (all on ``node``) whose exit gives the node room for as
    many ranks of ``gpus_per_rank`` GPUs as it can hold (``ranks`` at most), and the
    ranks that adds; None when the node has that room already or cannot gain any.

    Runs that ``shields`` finds shielded (``VictimCandidates.shielded``) are passed
    over; with None every run may go.
    """
    room = nodes.free[node] + nodes.releasing[node]
    before = room // gpus_per_rank
    most = min(ranks, nodes.gpus[node] // gpus_per_rank)
    if before >= most:
        return None
    if len(runs) > 1:
        # Most nodes offer one run: the call of the sort is spared for them.
        runs.sort(key=by_order)
    taken: list[RunningWork] = []
    for run in runs:
        if shields is not None and shields.shielded(run):
            continue
        taken.append(run)
        room += sum(gpus for on, gpus in run.nodes if on == node)
        if room // gpus_per_rank >= most:
            break
    gained = room // gpus_per_rank - before
    return (taken, gained) if gained > 0 else None


def reclaim_by_node(
    ledger: QuotaLedger, nodes: NodeMap, victims: VictimCandidates, job: PendingJob
) -> tuple[Victims, Placement] | None:
    """R6 with R10 when the cheapest victims are scattered: clear nodes, not GPUs.

    Cheap victims spread over many nodes can use up the donors' GPUs above their
    guarantee lines before any node has room for a rank. Here each node offers the
    cheapest reclaimable work on it that makes room for ranks of the gang; nodes
    are taken cheapest per rank first, each only while its victims keep their
    queues on or above the line as R3 asks, until the gang fits. The victims then
    go through the trimming and placement of every other search.
    """
    gpus_per_rank = job.workload.gpus_per_rank
    ranks = job.workload.ranks
    chains, on_node = reclaimable_by_node(ledger, victims, job.queue)

    offers: list[tuple[tuple[float, float, float, int], list[RunningWork], int]] = []
    for node, runs in on_node.items():
        offer = room_on(nodes, node, runs, gpus_per_rank, ranks, victims)
        if offer is None:
            continue
        taken, gained = offer
        # Loops rather than max() and sum() over generator expressions: compiled, each
        # of those builds a generator object, for every node on offer.
        highest = taken[0].priority_class.value
        lost = 0.0
        gpus = 0
        for run in taken:
            highest = max(highest, run.priority_class.value)
            lost += run.lost
            gpus += run.gpus
        cost = (float(highest), lost / gained, gpus / gained, node)
        offers.append((cost, taken, gained))
    # Taken cheapest first from a heap rather than sorted: the gang fits after a few
    # of the thousands of nodes on offer. Costs end with the node, so no two are equal
    # and the order is the sort's.
    heapify(offers)

    hostable = nodes.hostable_ranks(gpus_per_rank)
    taken_from: dict[int, int] = defaultdict(int)
    chosen: dict[int, RunningWork] = {}
    while offers:
        _, runs, gained = heappop(offers)
        new = [run for run in runs if id(run) not in chosen]
        extra = r3_budget(ledger, chains, taken_from, new)
        if extra is None:
            continue
        for x, gpus in extra.items():
            taken_from[x] += gpus
        for run in new:
            chosen[id(run)] = run
        hostable += gained
        if hostable >= ranks:
            return preempt_for(ledger, nodes, job, [(run, RECLAIM) for run in chosen.values()])
    return None


def reclaimable_by_node(
    ledger: QuotaLedger, victims: VictimCandidates, queue: int
) -> tuple[dict[int, tuple[int, ...]], dict[int, list[RunningWork]]]:
    """The running work ``queue`` may reclaim (R6), by node, and for each donor queue the
    chain of queues up to the common ancestor that must stay on their lines (R3).

    Donors are queues that run above their line without the GPUs reserved for their own
    waiting jobs; protected work (minimum runtime) is left out.
    """
    tree = ledger.tree
    usage = ledger.usage
    waiting = ledger.waiting_usage
    line = ledger.line
    lca_row = tree.lca_row(queue)
    chains: dict[int, tuple[int, ...]] = {}
    on_node: dict[int, list[RunningWork]] = {}
    for donor in ledger.over_guarantee:
        if donor == queue or usage[donor] - waiting[donor] <= line[donor]:
            continue
        found = lca_row[donor]
        chain = (found if found is not None else tree.lca_chains(queue, donor))[0]
        if any(usage[x] - waiting[x] <= line[x] for x in chain):
            continue
        chains[donor] = chain
        runs = victims.by_queue[donor]
        for i in range(victims.first_live[donor], len(runs)):
            run = runs[i]
            if not run.victim and not victims.is_protected(run, RECLAIM):
                list_on_nodes(on_node, run)
    return chains, on_node


def list_on_nodes(by_node: dict[int, list[RunningWork]], run: RunningWork) -> None:
    """Add ``run`` to the list of each node it runs on in ``by_node``: a plain dict
    rather than a defaultdict, whose Python-level factory call compiled code made for
    each missing node (200,000 a running-heavy plan)."""
    for node, _ in run.nodes:
        listed = by_node.get(node)
        if listed is None:
            by_node[node] = [run]
        else:
            listed.append(run)


def r3_budget(
    ledger: QuotaLedger,
    chains: dict[int, tuple[int, ...]],
    taken_from: dict[int, int],
    runs: Sequence[RunningWork],
) -> dict[int, int] | None:
    """The GPUs ``runs`` would take from each queue of their chains, or None when one of
    them would take a queue below its line (R3) beyond what ``taken_from`` already takes."""
    usage = ledger.usage
    waiting = ledger.waiting_usage
    line = ledger.line
    planned = ledger.planned_usage
    extra: dict[int, int] = defaultdict(int)
    for run in runs:
        for x in chains[run.queue]:
            left = usage[x] - waiting[x] - taken_from[x] - extra[x]
            if r3_guarantee_overshoot(left, line[x], run.gpus) is None:
                return None
            # Running work leaves only a queue that runs above its line without
            # this plan's own admissions (see VictimCandidates.reclaim).
            if not run.planned and left - planned[x] <= line[x]:
                return None
            extra[x] += run.gpus
    return extra
