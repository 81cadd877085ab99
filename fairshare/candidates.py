"""Candidate victims: which running work a pending workload may take GPUs from, and in
what order.

Decides, per kind of preemption, which running workloads are eligible victims: reclaim
(R6 with R3's guarantee line: only queues above their line give, straddling gangs last),
priority (R7, lower preemptible classes of the preemptor's own queue) and fair share (R8,
between queues whose shares say the move does not flap back). Inside each kind the
cheapest victims come first (R9: lower priority, then least lost work). A victim is
skipped when taking it would only move the loss onto lower work of its own queue (it
would preempt that work by R7 once requeued).

The work it scans and its R9 order are ``work.py``'s; what a reclaim scan keeps while it
runs is ``reclaim_scan.py``'s. Judges and orders candidates; never chooses which of them
a preemptor takes (``preemption.py``) nor places a job.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from heapq import heapify, heappop, heappush
from typing import cast

from .ledger import QuotaLedger
from .model import FAIR_SHARE, PRIORITY, RECLAIM
from .reclaim_scan import ReclaimScan, closed_below_lca
from .rules import (
    r3_guarantee_overshoot,
    r6_may_reclaim,
    r7_may_preempt_by_priority,
    r8_may_preempt_for_fair_share,
)
from .tree import LcaChain, QueueTree
from .work import PendingJob, RunningWork, VictimOrder, by_order

_INF = float("inf")


# A queue's entry in ``VictimCandidates.donor_heads``: the order of its first live
# candidate followed by the queue (see ``_donor_head``).
DonorHead = tuple[object, ...]


def _donor_head(order: VictimOrder, queue: int) -> DonorHead:
    """The entry of ``queue`` in the donor heads, its first live candidate's ``order``
    followed by the queue in one flat tuple, which sorts as (order, queue) does (every
    order has as many parts): nested, a comparison of two entries walked the orders
    twice, once for equality and once for the order."""
    return order + (queue,)  # noqa: RUF005 (concatenation copies the order in C)


class ScanEntry:
    """An entry of a victim scan's heap: ``runs[at]``, a candidate of ``queue``, where
    ``runs`` is the list it is in (the queue's candidates, or only those admitted in
    this plan). Entries go by the candidate's R9 order (``RunningWork.order``), then by
    queue and index, as the tuple of all these would.

    A class with its own comparison rather than that tuple: compiled, ``__lt__``
    compares the parts of the order as numbers, while a comparison of tuples goes
    through Python's generic comparison for each pair of items, twice for the pair
    that differs. The scans' heaps made a tenth of a plan's work on the engine
    benchmark's running-heavy cluster.
    """

    __slots__ = ("at", "queue", "run", "runs")

    def __init__(self, run: RunningWork, queue: int, at: int, runs: list[RunningWork]) -> None:
        self.run = run
        self.queue = queue
        self.at = at
        self.runs = runs

    def __lt__(self, other: ScanEntry) -> bool:
        mine = self.run
        theirs = other.run
        if mine.order_priority != theirs.order_priority:
            return mine.order_priority < theirs.order_priority
        if mine.lost != theirs.lost:
            return mine.lost < theirs.lost
        if mine.order_newer != theirs.order_newer:
            return mine.order_newer < theirs.order_newer
        if mine.order_id != theirs.order_id:
            return mine.order_id < theirs.order_id
        if self.queue != other.queue:
            return self.queue < other.queue
        # A queue has one entry in a heap at a time, so its index settles it.
        return self.at < other.at


def _scan_position(entry: ScanEntry) -> tuple[int, int, list[RunningWork]]:
    """The queue, the index and the list of a heap entry."""
    return entry.queue, entry.at, entry.runs


def next_live(runs: list[RunningWork], start: int) -> int:
    """The index of the first of ``runs`` from ``start`` on that is not a victim yet."""
    end = len(runs)
    while start < end and runs[start].victim:
        start += 1
    return start


class VictimCandidates:
    """Every queue's preemptible running work in R9 order, and the scans over it."""

    def __init__(
        self,
        tree: QueueTree,
        ledger: QuotaLedger,
        by_queue: list[list[RunningWork]],
    ) -> None:
        self.tree = tree
        self.ledger = ledger
        for runs in by_queue:
            runs.sort(key=by_order)
        # Per queue: its preemptible running work, cheapest victim first.
        self.by_queue = by_queue
        # Per queue: the part of it admitted in this plan, in the same order.
        self.planned_by_queue: list[list[RunningWork]] = [[] for _ in by_queue]
        # Per queue: no candidate before this index is still live (all are victims).
        self.first_live = [0] * len(by_queue)
        # Per queue: bumped whenever it gains a candidate or one of them becomes a victim.
        self.shield_version = [0] * len(by_queue)
        # Per queue: the order of its first live candidate (None for none), as it stands
        # in ``donor_heads``: kept rather than derived, so that the entry is found again
        # when the head moves.
        self.head_of: list[VictimOrder | None] = [
            runs[0].order if runs else None for runs in by_queue
        ]
        # The queues above their guarantee (the only ones reclaim takes from) that have a
        # live candidate, as head_of[queue] followed by the queue in one flat tuple
        # (``_donor_head``), sorted: the order in which a reclaim scan meets them. Kept
        # current as candidates come and go and as the ledger sees queues cross their
        # guarantee.
        over = ledger.over_guarantee
        self.donor_heads: list[DonorHead] = sorted(
            _donor_head(runs[0].order, queue)
            for queue, runs in enumerate(by_queue)
            if runs and queue in over
        )
        ledger.guarantee_crossed = self._guarantee_crossed
        # Per queue: its smallest candidate's GPUs (0 for none).
        self.smallest_gpus = [min((run.gpus for run in runs), default=0) for runs in by_queue]
        # Candidates that a scan passed over only because they have not run their
        # minimum runtime yet, with the reason they were wanted for; the planner clears
        # it before each workload's searches and reads it to say until when it waits.
        self.protected: list[tuple[RunningWork, str]] = []
        # Set while the planner asks whether the protected candidates would let a
        # workload in: protection of running work is then ignored.
        self.ignore_protection = False
        # Candidates the fair-share scans have offered so far (the planner tells an
        # attempt that found none from one whose candidates did not do).
        self.fair_share_offered = 0

    def is_protected(self, run: RunningWork, reason: str) -> bool:
        """Whether ``run`` has not run its minimum runtime for ``reason`` yet.

        Work admitted in this plan has run for no time at all; its protection is never
        ignored, since it has not started and no waiting reason can name its end.
        """
        if run.runtime >= run.minimum[reason]:
            return False
        if run.planned:
            return True
        if self.ignore_protection:
            return False
        self.protected.append((run, reason))
        return True

    def first_live_index(self, queue: int) -> int:
        """Move ``queue``'s first live index past the candidates already taken as victims."""
        first = next_live(self.by_queue[queue], self.first_live[queue])
        self.first_live[queue] = first
        return first

    def add(self, run: RunningWork) -> None:
        """A workload admitted in this plan becomes a candidate victim for later ones."""
        queue = run.queue
        runs = self.by_queue[queue]
        if not runs:
            self.smallest_gpus[queue] = run.gpus
        else:
            self.smallest_gpus[queue] = min(self.smallest_gpus[queue], run.gpus)
        at = bisect.bisect_left(runs, run.order, key=by_order)
        runs.insert(at, run)
        # Left of equal orders, as in ``runs``: a job admitted again in this plan after
        # giving way has the order of its earlier admission, now a victim.
        bisect.insort_left(self.planned_by_queue[queue], run, key=by_order)
        self.shield_version[queue] += 1
        if at < self.first_live[queue]:
            self.first_live[queue] = at
        head = self.head_of[queue]
        if head is None or run.order < head:
            self._move_head(queue)

    def take(self, run: RunningWork) -> None:
        """Mark ``run`` as a victim of this plan."""
        run.victim = True
        queue = run.queue
        self.shield_version[queue] += 1
        # Equal, not the same object: compiled, an order is a tuple built afresh on each
        # read. Another run of the same order (a job admitted again after giving way)
        # only has the head looked up again, to the same place.
        if self.head_of[queue] == run.order:
            self._move_head(queue)

    def _move_head(self, queue: int) -> None:
        """Move ``queue``'s head to its first live candidate."""
        first = self.first_live_index(queue)
        runs = self.by_queue[queue]
        listed = queue in self.ledger.over_guarantee
        if listed:
            self._list_head(queue, False)
        self.head_of[queue] = runs[first].order if first < len(runs) else None
        if listed:
            self._list_head(queue, True)

    def _guarantee_crossed(self, queue: int) -> None:
        self._list_head(queue, queue in self.ledger.over_guarantee)

    def _list_head(self, queue: int, listed: bool) -> None:
        """Put ``queue``'s head into ``donor_heads`` or take it out."""
        head = self.head_of[queue]
        if head is None:
            return
        heads = self.donor_heads
        entry = _donor_head(head, queue)
        at = bisect.bisect_left(heads, entry)
        if listed:
            heads.insert(at, entry)
        else:
            del heads[at]

    def _push_next_head(self, scan: ReclaimScan, heap: list[ScanEntry]) -> None:
        """Push onto a reclaim scan's ``heap`` the first live candidate of the next
        queue of its donor heads that the scan admits as a donor, and move the scan's
        position past it (its frontier is that queue, or -1 when none is left).

        A reclaim scan keeps one such entry in its heap: every queue further on starts at
        a costlier candidate, so the heap's smallest entry is the cheapest candidate of
        all the donors. The scan looks at the donors whose cheapest candidates it
        reaches, not at every queue above its guarantee (hundreds on a large cluster,
        while a search takes its victims from a few).

        The scan may take work of a donor when the donor and its chain up to the common
        ancestor with the scan's queue run above their lines as the ledger stood when
        the scan began (R6, R3); the chain is recorded then. The tests are spelled out
        here rather than called per head: most heads a scan walks past are turned away
        (on the engine benchmark's running-heavy cluster, 340,000 of 430,000 a plan).
        """
        heads = scan.heads
        end = len(heads)
        position = scan.position
        queue = scan.queue
        start_usage = scan.start_usage
        ledger = self.ledger
        tree = self.tree
        waiting = ledger.waiting_usage
        line = ledger.line
        planned = ledger.planned_usage
        parent = tree.parent
        # The scan's closed_below lists, each asked of it once here rather than per head.
        closed_running: list[bool] | None = None
        closed: list[bool] | None = None
        while position < end:
            donor = cast(int, heads[position][-1])
            position += 1
            if donor == queue or start_usage[donor] - waiting[donor] <= line[donor]:
                continue
            # Without work admitted in this plan the donor has only running work to give
            # (and then its own test above is that of the work it runs).
            above = parent[donor]
            if above != -1:
                if not planned[donor]:
                    if closed_running is None:
                        closed_running = scan.closed_below(tree, ledger, True)
                    if closed_running[above]:
                        continue
                else:
                    if closed is None:
                        closed = scan.closed_below(tree, ledger, False)
                    if closed[above]:
                        continue
            found = scan.lca_row[donor]
            if found is None:
                found = tree.lca_chains(queue, donor)
            scan.chains[donor] = found[0]
            first = self.first_live_index(donor)
            runs = self.by_queue[donor]
            heappush(heap, ScanEntry(runs[first], donor, first, runs))
            scan.position = position
            scan.frontier = donor
            return
        scan.position = position
        scan.frontier = -1

    def shielded(self, run: RunningWork) -> bool:
        """Whether taking ``run`` would only move the loss onto its own queue's lower work.

        Once requeued, ``run`` would preempt a lower-priority job of its own queue by R7 in
        the next cycle, so the plan would not be stable; that lower job is the victim to
        take instead (it comes earlier in the order, unless a rule protects it).
        """
        if not run.preempts_lower:
            return False
        # The answer depends on the queue's candidates and which of them are victims; it
        # holds until either changes (the queue's shield version moves on).
        version = self.shield_version[run.queue]
        if run.shield_version == version:
            return run.shielded
        run.shield_version = version
        run.shielded = self._lower_work_to_take(run)
        return run.shielded

    def _lower_work_to_take(self, run: RunningWork) -> bool:
        runs = self.by_queue[run.queue]
        for i in range(self.first_live[run.queue], len(runs)):
            lower = runs[i]
            if lower.priority_class.value >= run.priority_class.value:
                return False
            if (
                not lower.victim
                and lower.gpus >= run.gpus
                and r7_may_preempt_by_priority(
                    run.priority_class, lower.priority_class, lower.runtime, lower.minimum[PRIORITY]
                )
            ):
                return True
        return False

    def _above_line_before_plan(self, chain: tuple[int, ...]) -> bool:
        """Whether every queue of ``chain`` runs above its guarantee line without the work
        this plan admitted or reserved for it (the guarantee line, R3).

        A queue at or under its line never gives running work to reclaim or fair share,
        even when this plan's own admissions for it (or the GPUs it waits for) make it
        look above: it would lose work it runs within its guarantee to make room for its
        new work, or to a queue that only this plan's reservations put ahead of it. Work
        admitted in this same plan may still be withdrawn, as before.
        """
        ledger = self.ledger
        usage = ledger.usage
        waiting = ledger.waiting_usage
        planned = ledger.planned_usage
        line = ledger.line
        # A loop rather than all(): this runs for every candidate a scan looks at.
        for x in chain:  # noqa: SIM110
            if usage[x] - waiting[x] - planned[x] <= line[x]:
                return False
        return True

    def _next_entry(
        self, donor: int, runs: list[RunningWork], at: int, donor_exposed: bool
    ) -> ScanEntry | None:
        """The heap entry of the donor's candidate after ``runs[at]``, or None.

        A donor that no longer runs above its line without this plan's work gives only
        work admitted in this plan (see ``_above_line_before_plan``), and during a scan
        it never comes back above (its victims only lower its usage). From then on the
        scan walks that work alone: a busy donor runs many candidates and this plan
        admitted few of them (on the engine benchmark's cluster, stepping through them
        all made the fair-share scans pop 53,000 candidates a plan instead of 19,000).
        """
        following = at + 1
        if not donor_exposed:
            planned = self.planned_by_queue[donor]
            if runs is not planned:
                run = runs[at]
                following = bisect.bisect_left(planned, run.order, key=by_order)
                if run.planned:
                    # Past the run itself (and any earlier admission of its job that
                    # shares its order, a victim now).
                    while planned[following] is not run:
                        following += 1
                    following += 1
                runs = planned
        return self._entry_from(donor, runs, following)

    def _entry_from(self, donor: int, runs: list[RunningWork], start: int) -> ScanEntry | None:
        """The heap entry of the first of the donor's ``runs`` from ``start`` on that is
        neither a victim nor shielded, or None.

        A scan would pop such a candidate only to step past it (on the engine
        benchmark's running-heavy cluster, 100,000 pops a plan). Whether a candidate is
        shielded does not change during a search (no candidate comes or goes), and what
        a scan tests when it pops one, its donor's chain above its line, never comes
        back once it fails (victims only lower usage): passing over it earlier changes
        neither the candidates the scan yields nor where it stops.
        """
        end = len(runs)
        while start < end:
            run = runs[start]
            if not run.victim and not self.shielded(run):
                return ScanEntry(run, donor, start, runs)
            start += 1
        return None

    def reclaim(self, queue: int) -> Iterator[tuple[RunningWork, str]]:
        """R6 with R3: running work of queues above their guarantee line, cheapest first.

        A victim that would take its queue (or an ancestor below the common ancestor with
        ``queue``) below the line straddles it; straddlers are used last, the smallest
        overshoot first.
        """
        tree = self.tree
        ledger = self.ledger
        usage = ledger.usage
        line = ledger.line
        waiting = ledger.waiting_usage
        planned = ledger.planned_usage
        heap: list[ScanEntry] = []
        # Donors are judged as the ledger stood when the scan began, whenever the scan
        # reaches them: the victims it yields change the usage as it goes.
        scan = ReclaimScan(queue, tree.lca_row(queue), usage[:], self.donor_heads[:])
        chains = scan.chains
        self._push_next_head(scan, heap)
        straddlers: list[tuple[int, VictimOrder, RunningWork]] = []
        # Per donor: whether it runs above its line without this plan's work. Usage only
        # changes when the caller takes a victim, so the answers hold until the next yield.
        exposed_donors: dict[int, bool] = {}
        while heap:
            donor, at, runs = _scan_position(heappop(heap))
            if donor == scan.frontier:
                self._push_next_head(scan, heap)
            run = runs[at]
            chain = chains[donor]
            donor_exposed = exposed_donors.get(donor)
            if donor_exposed is None:
                donor_exposed = self._above_line_before_plan(chain)
                exposed_donors[donor] = donor_exposed
            exposed = run.planned or donor_exposed
            if not exposed and not planned[donor]:
                # Victims only lower the donor's usage: none of its work can go now.
                continue
            overshoot = 0
            eligible = True
            victim_gpus = run.gpus
            for x in chain:
                over = r3_guarantee_overshoot(usage[x] - waiting[x], line[x], victim_gpus)
                if over is None:
                    eligible = False
                    break
                overshoot = max(overshoot, over)
            if not eligible:
                continue
            entry = self._next_entry(donor, runs, at, donor_exposed)
            if entry is not None:
                heappush(heap, entry)
            if run.victim or not exposed or self.shielded(run):
                continue
            if self.is_protected(run, RECLAIM):
                continue
            if overshoot:
                straddlers.append((overshoot, run.order, run))
                continue
            yield run, RECLAIM
            exposed_donors.clear()
        straddlers.sort(key=lambda item: (item[0], item[1]))
        for _, _, run in straddlers:
            if run.victim:
                continue
            chain = chains[run.queue]
            if not run.planned and not self._above_line_before_plan(chain):
                continue
            if all(r3_guarantee_overshoot(usage[x], line[x], run.gpus) is not None for x in chain):
                yield run, RECLAIM

    def priority(
        self, job: PendingJob, reclaimed: list[tuple[RunningWork, str]] | None = None
    ) -> Iterator[tuple[RunningWork, str]]:
        """R7: lower-priority preemptible work of the same queue, lowest priority first.

        When the preemptor's queue ends within its guarantee, borrowed GPUs of other
        queues may complete the set (R6). ``reclaimed`` is what a reclaim scan for the
        same queue yielded in a search that failed just before (``ReclaimStream``); it
        is read again rather than scanned anew.
        """
        queue = job.queue
        runs = self.by_queue[queue]
        preemptor_class = job.priority_class
        for i in range(self.first_live[queue], len(runs)):
            run = runs[i]
            if run.priority_class.value >= preemptor_class.value:
                break
            # The runtime test comes last, so that only a protected run that would
            # otherwise go counts as protected.
            if (
                run.victim
                or not r7_may_preempt_by_priority(preemptor_class, run.priority_class, _INF, 0.0)
                or self.is_protected(run, PRIORITY)
            ):
                continue
            yield run, PRIORITY
        ledger = self.ledger
        if r6_may_reclaim(ledger.usage[queue], job.gpus, ledger.guarantee[queue]):
            if reclaimed is None:
                yield from self.reclaim(queue)
            else:
                yield from reclaimed

    def fair_share(self, job: PendingJob) -> Iterator[tuple[RunningWork, str]]:
        """R8: work of queues above their fair share that may give GPUs without flapping."""
        queue = job.queue
        tree = self.tree
        ledger = self.ledger
        usage = ledger.usage
        fair = ledger.fair_share
        gpus = job.gpus
        by_queue = self.by_queue
        smallest_gpus = self.smallest_gpus
        planned = ledger.planned_usage
        waiting = ledger.waiting_usage
        line = ledger.line
        lca_row = tree.lca_row(queue)
        parent = tree.parent
        closed: list[bool] | None = None
        heap: list[ScanEntry] = []
        chains: dict[int, LcaChain] = {}
        for donor in ledger.over_fair_share:
            runs = by_queue[donor]
            smallest = smallest_gpus[donor]
            if donor == queue or not runs or usage[donor] - smallest < fair[donor]:
                continue
            donor_planned = planned[donor]
            if not donor_planned:
                # Without work admitted in this plan the donor has only running work to
                # give: _above_line_before_plan's test of its chain, the donor itself
                # first (most donors of a full cluster run at or under their own
                # line), then its ancestors, judged once per scan.
                if usage[donor] - waiting[donor] <= line[donor]:
                    continue
                above = parent[donor]
                if above != -1:
                    if closed is None:
                        closed = closed_below_lca(tree, queue, usage, ledger, True)
                    if closed[above]:
                        continue
            found = lca_row[donor]
            if found is None:
                found = tree.lca_chains(queue, donor)
            chain, side_of_queue, side_of_donor = found
            if side_of_queue == side_of_donor:
                continue
            # Both tests of R8 only get harder for a larger victim: when the queue's
            # smallest candidate fails them, every candidate of the queue does.
            for x in chain:
                if usage[x] - smallest < fair[x] - 1e-9:
                    break
            else:
                if not r8_may_preempt_for_fair_share(
                    usage[side_of_queue],
                    fair[side_of_queue],
                    gpus,
                    usage[side_of_donor],
                    fair[side_of_donor],
                    smallest,
                ):
                    continue
                chains[donor] = found
                entry = self._entry_from(donor, runs, self.first_live_index(donor))
                if entry is not None:
                    heap.append(entry)
        heapify(heap)
        # Per donor, as in ``reclaim``: valid until the next yield.
        exposed_donors: dict[int, bool] = {}
        while heap:
            donor, at, runs = _scan_position(heappop(heap))
            run = runs[at]
            chain, side_of_queue, side_of_donor = chains[donor]
            donor_exposed = exposed_donors.get(donor)
            if donor_exposed is None:
                donor_exposed = self._above_line_before_plan(chain)
                exposed_donors[donor] = donor_exposed
            exposed = run.planned or donor_exposed
            if not exposed and not planned[donor]:
                # Victims only lower the donor's usage: none of its work can go now.
                continue
            entry = self._next_entry(donor, runs, at, donor_exposed)
            if entry is not None:
                heappush(heap, entry)
            if not exposed or run.victim or self.shielded(run):
                continue
            victim_gpus = run.gpus
            for x in chain:
                if usage[x] - victim_gpus < fair[x] - 1e-9:
                    break
            else:
                if r8_may_preempt_for_fair_share(
                    usage[side_of_queue],
                    fair[side_of_queue],
                    gpus,
                    usage[side_of_donor],
                    fair[side_of_donor],
                    victim_gpus,
                ) and not self.is_protected(run, FAIR_SHARE):
                    self.fair_share_offered += 1
                    yield run, FAIR_SHARE
                    exposed_donors.clear()
