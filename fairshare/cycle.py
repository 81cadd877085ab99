"""The cycle: the order in which one flavor's pending workloads are planned, and what
becomes of each.

Decides, for every pending workload of one flavor, whether it starts now on free GPUs,
waits for GPUs already being released (R11), takes victims (reclaim, priority or fair
share; consolidation when free GPUs are scattered) and waits for them, or waits with a
reason. Workloads are taken from a heap of queues: work that fits inside its queue's
guarantee (its own or an ancestor's) first, and of that the work inside its queue's own
guarantee first, oldest submission first across queues; then the queue furthest below
its fair share (ties: older submission); inside a queue, higher priority first, then
older submission. Work admitted earlier in
the same plan may be taken back before it starts, and workloads still waiting get more
passes, so that the next cycle does not undo the plan.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime

from .candidates import (
    PendingJob,
    ReclaimStream,
    RunningWork,
    VictimCandidates,
    in_queue_order,
)
from .consolidation import CONSOLIDATIONS_PER_PLAN, consolidate, reclaim_and_move
from .ledger import QuotaLedger
from .model import (
    FAIR_SHARE,
    PENDING,
    PREEMPT_LOWER_PRIORITY,
    PRIORITY,
    RECLAIM,
    TERMINATING,
    Admission,
    Preemption,
    PriorityClass,
    Snapshot,
    Waiting,
    Workload,
    minimum_runtimes,
)
from .nodes import NodeMap, Placement
from .preemption import MAX_CANDIDATES_PER_ATTEMPT, Victims, preempt_for, reclaim_by_node
from .rules import r6_may_reclaim
from .tree import QueueTree

# Node-clearing reclaim searches (see preemption.reclaim_by_node) a plan may run: each
# is a pass over the running work of the queues above their guarantee.
NODE_SEARCHES_PER_PLAN = 8
# Passes over the workloads still waiting after the first pass, each run only when the
# previous pass changed what they could do.
RETRY_PASSES = 3
# Topology domains a gang that needs one searches for victims, per kind of preemption.
DOMAIN_SEARCHES_PER_MODE = 2
# Searches a plan may run to find until when a waiting workload's victims are protected
# by their minimum runtime: each repeats the workload's preemption searches.
PROTECTION_SEARCHES_PER_PLAN = 16

# The key of a queue in a pass's heap: (how far beyond the guarantees its next job goes,
# as _guarantee_rank says, INSIDE_OWN_GUARANTEE for a job inside its queue's own guarantee
# and otherwise usage minus fair share (see _queue_key), the next job's submission, queue
# name, queue index).
QueueKey = tuple[int, float, float, str, int]
# The second part of the key of a job inside its queue's own guarantee: before any other
# work of its guarantee rank, and among such jobs the older submission first.
INSIDE_OWN_GUARANTEE = -math.inf

# How a workload that found no way in waits: FlavorPlanner.changes when it was planned,
# its reason, until when its victims are protected, and whether it tried to preempt.
WaitOutcome = tuple[int, str, float | None, bool]


def _jobs_phrase(ids: list[str]) -> str:
    unique = list(dict.fromkeys(ids))
    shown = ", ".join(unique[:3])
    more = f" and {len(unique) - 3} more" if len(unique) > 3 else ""
    return f"job {shown}" if len(unique) == 1 else f"jobs {shown}{more}"


def _in_domain(
    candidates: Iterator[tuple[RunningWork, str]], domain_of: list[str | None], name: str
) -> Iterator[tuple[RunningWork, str]]:
    """The candidates that run in domain ``name``, one at a time as ``candidates`` yield.

    A generator function, not a generator expression: compiled by mypyc, a generator
    expression is built as a whole list first, while a victim scan judges each
    candidate by the usage that the victims taken before it left (R3 in
    ``VictimCandidates.reclaim``), so it must run only as far as the victims are taken.
    """
    for run, reason in candidates:
        if any(domain_of[node] == name for node, _ in run.nodes):
            yield run, reason


class FlavorPlanner:
    """Plans the pending workloads of one flavor."""

    def __init__(
        self,
        snapshot: Snapshot,
        tree: QueueTree,
        classes: Mapping[str, PriorityClass],
        flavor: str,
        workloads: list[Workload],
    ) -> None:
        self.now = snapshot.now
        # Per class: its minimum runtime per preemption reason, shared by its work.
        self.minimums = {
            name: minimum_runtimes(snapshot, priority_class)
            for name, priority_class in classes.items()
        }
        self.tree = tree
        self.flavor = flavor
        count = len(tree.names)
        nodes = NodeMap([node for node in snapshot.nodes if node.flavor == flavor])
        self.nodes = nodes

        held = [0] * len(nodes.names)
        leaf_usage = [0] * count
        leaf_demand = [0] * count
        pinned_usage = [0] * count
        pending: list[list[PendingJob]] = [[] for _ in range(count)]
        candidates: list[list[RunningWork]] = [[] for _ in range(count)]
        terminating: list[tuple[str, tuple[tuple[int, int], ...]]] = []
        for workload in workloads:
            queue = tree.index[workload.queue]
            priority_class = classes[workload.priority_class]
            gpus = workload.gpus
            leaf_demand[queue] += gpus
            if workload.state == PENDING:
                pending[queue].append(PendingJob(workload, queue, priority_class))
                continue
            on_nodes = tuple(
                (nodes.index[node], ranks * workload.gpus_per_rank)
                for node, ranks in workload.placement
            )
            for node, on_node in on_nodes:
                held[node] += on_node
            if workload.state == TERMINATING:
                # R11: a victim already on its way counts as capacity coming back.
                terminating.append((workload.id, on_nodes))
                continue
            leaf_usage[queue] += gpus
            if priority_class.preemptible:
                candidates[queue].append(
                    RunningWork(
                        workload,
                        queue,
                        priority_class,
                        on_nodes,
                        self.now,
                        self.minimums[priority_class.name],
                    )
                )
            else:
                pinned_usage[queue] += gpus
        for jobs in pending:
            in_queue_order(jobs)
        self.pending = pending
        # The reasons name them in this order, whatever order the snapshot lists them
        # in: by id, shorter ids first, so that numbered jobs come in number order.
        terminating.sort(key=lambda entry: (len(entry[0]), entry[0]))
        nodes.occupy(held, terminating)
        self.ledger = QuotaLedger(
            snapshot, tree, flavor, nodes.capacity, leaf_usage, leaf_demand, pinned_usage
        )
        self.victims = VictimCandidates(tree, self.ledger, candidates)
        # Per node: GPUs of preemptible running work in the snapshot (a rough measure of
        # what victims could free there, to rank topology domains).
        self.preemptible_on_node = [0] * len(nodes.names)
        for runs in candidates:
            for run in runs:
                for node, gpus in run.nodes:
                    self.preemptible_on_node[node] += gpus
        self.usage_matters = snapshot.usage_strength > 0
        self.protection_searches_left = PROTECTION_SEARCHES_PER_PLAN
        # Per kind of workload (queue, ranks, rank size, priority, preemptible): the
        # candidates' version and what protects its victims, as found by
        # _protected_until.
        self.protection_by_kind: dict[
            tuple[int, int, int, int, bool], tuple[tuple[int, int], tuple[str, float | None]]
        ] = {}
        self.node_searches_left = NODE_SEARCHES_PER_PLAN
        self.consolidations_left = CONSOLIDATIONS_PER_PLAN

        # Per rank size: the fewest ranks that found no room on free plus releasing GPUs
        # since the releasing GPUs last changed.
        self.unplaceable_on_releasing: dict[int, int] = {}
        # The same per (topology level, rank size), for gangs that need one domain.
        self.unplaceable_in_domain_releasing: dict[tuple[str, int], int] = {}
        # Per kind of attempt (queue, mode, rank size, preemptor's priority where it
        # matters, preemptible): the fewest ranks that failed, and the candidates'
        # version they failed against.
        self.failed_attempts: dict[tuple[int, str, int, int, bool], tuple[int, int]] = {}
        # Per queue: the fewest GPUs for which a fair-share search found no candidate at
        # all (none offered, none protected), and the candidates' version then.
        self.fair_share_dry: dict[int, tuple[int, int]] = {}
        # Moves on whenever a new candidate victim appears that could make a failed
        # attempt succeed.
        self.candidates_version = 0
        # Admitted in this plan: workload id -> (queue, GPUs), and the decisions.
        self.admitted: dict[str, tuple[int, int]] = {}
        self.admissions: dict[str, Admission] = {}
        self.waits: dict[str, Waiting] = {}
        self.preempt: list[Preemption] = []
        # Waiting workloads that hold a reservation (they need no retry).
        self.reserved: set[str] = set()
        # The last pass gave the waiting workloads something new to try (a candidate
        # victim), or freed GPUs by withdrawing an admission (everyone retries then).
        self.retry_waiting = False
        self.gpus_freed = False
        # Set once the first pass is over. During it a workload has no waiting reason
        # before it is planned (each is planned once, and one that gives way after its
        # admission is not planned again), so there is none to look up and keep.
        self.retrying = False
        # The physical reason to wait depends only on the gang's shape (ranks, GPUs
        # per rank), and many jobs share a shape.
        self.reason_by_shape: dict[tuple[int, int], str] = {}
        # Moves on whenever the plan changes anything a workload's planning reads (an
        # admission, a reservation, victims taken) and whenever a workload's planning
        # goes beyond reading: a preemption or consolidation search, or a topology
        # gang's domain search.
        self.changes = 0
        # Per kind of workload without a topology (queue, ranks, GPUs per rank, class):
        # the outcome of the last one planned that only read, and ``changes`` then.
        # Workloads of that kind planned before ``changes`` moves on wait for the same
        # reason, and a busy queue holds many of one kind (at the peak of Kueue's
        # baseline, 14,400 workloads of 30 queues and three classes all wait on quota).
        self.outcome_by_kind: dict[tuple[int, int, int, str], WaitOutcome] = {}

    def run(self) -> None:
        """Plan every pending workload of this flavor.

        Decisions land in ``admissions``, ``waits`` and ``preempt``. A pass that admitted
        work (new candidate victims) or withdrew an admission (free GPUs) changed what the
        workloads planned before could do, so those still waiting get up to three more
        passes.
        """
        self._pass(self.pending)
        for _ in range(RETRY_PASSES):
            if not self.retry_waiting:
                break
            self.retry_waiting = False
            everyone = self.gpus_freed
            self.gpus_freed = False
            # Each queue's jobs that wait and may do better now, in its order: picked
            # from its sorted pending jobs, so no list needs sorting again.
            retry: list[list[PendingJob]] = []
            for jobs in self.pending:
                again: list[PendingJob] = []
                for job in jobs:
                    workload_id = job.workload.id
                    if workload_id not in self.waits or workload_id in self.reserved:
                        continue
                    seen_version = job.attempted_at_version
                    if everyone or (seen_version >= 0 and seen_version != self.candidates_version):
                        again.append(job)
                retry.append(again)
            self.retrying = True
            self._pass(retry)
        # No scan runs any more: the ledger stops telling the candidates when a queue
        # crosses its guarantee. That also undoes the reference cycle between the two,
        # so the plan's candidates are freed when it ends, not walked and freed later
        # by the cyclic collector.
        self.ledger.guarantee_crossed = None

    def _pass(self, pending: list[list[PendingJob]]) -> None:
        heap: list[QueueKey] = []
        position = [0] * len(pending)
        for queue, jobs in enumerate(pending):
            if jobs:
                heap.append(self._queue_key(queue, jobs[0]))
        heapq.heapify(heap)
        heappop = heapq.heappop
        heappush = heapq.heappush
        ledger = self.ledger
        usage = ledger.usage
        fair_share = ledger.fair_share
        guarantee = ledger.guarantee
        boost = ledger.order_boost
        names = self.tree.names
        # Methods are called through ``self``, not bound to locals: compiled, a call
        # through ``self`` is a direct C call, one through a bound method a Python one.
        while heap:
            queue = heappop(heap)[4]
            jobs = pending[queue]
            at = position[queue]
            self._plan_job(jobs[at])
            at += 1
            if at < len(jobs):
                # The key of _queue_key, spelled out: this loop runs once per workload.
                head = jobs[at]
                gpus = head.gpus
                used = usage[queue]
                if used + gpus <= guarantee[queue]:
                    distance = INSIDE_OWN_GUARANTEE
                else:
                    below = used - fair_share[queue]
                    distance = below * boost[queue] if below < 0 else below
                key = (
                    self._guarantee_rank(queue, gpus),
                    distance,
                    head.workload.submitted_at,
                    names[queue],
                    queue,
                )
                if not heap or key < heap[0]:
                    reached = self._wait_in_a_row(jobs, at, key, heap[0] if heap else None)
                    if reached != at and reached < len(jobs):
                        key = self._queue_key(queue, jobs[reached])
                    at = reached
                if at < len(jobs):
                    heappush(heap, key)
            position[queue] = at

    def _wait_in_a_row(
        self, jobs: list[PendingJob], at: int, key: QueueKey, first: QueueKey | None
    ) -> int:
        """Let ``jobs[at:]`` wait on the outcome of their kind while they can; the
        position of the first that cannot, to be planned in full.

        ``key`` is ``jobs[at]``'s queue key and goes before ``first``, the head of the
        heap: the pass would plan it next. While nothing changes, the queue's usage
        and so the second part of its key stay as they are (the first, the guarantee
        rank, depends on the job's GPUs too, and is found again for a job of another
        size), and a job of a kind whose outcome is current would only reuse it; so the
        jobs that follow, up to one that would fall behind ``first``, are taken here
        without the heap, each as ``_plan_job`` takes it. At the peak of Kueue's
        baseline most of the 14,400 waiting workloads go this way.
        """
        queue = key[4]
        below = key[1]
        gpus = jobs[at].gpus
        changes = self.changes
        known_outcomes = self.outcome_by_kind
        # When the first two parts tie, a job falls behind ``first`` when it was
        # submitted later, or at the same moment and its queue's name and index go
        # after ``first``'s (the same for every job here).
        tied = first is not None and first[0] == key[0] and first[1] == below
        tie_submitted = first[2] if first is not None else 0.0
        behind_on_a_tie = first is not None and (key[3], queue) > (first[3], first[4])
        # The kind of the job before and its outcome: ``changes`` stays as it is while
        # jobs only wait, so jobs of one kind in a row look it up once.
        ranks = -1
        gpus_per_rank = -1
        priority_class: PriorityClass | None = None
        outcome: WaitOutcome | None = None
        count = len(jobs)
        while at < count:
            job = jobs[at]
            workload = job.workload
            if workload.topology_level is not None:
                break
            if job.gpus != gpus:
                # A job of another size: of its key only the guarantee rank can differ.
                gpus = job.gpus
                if first is not None:
                    # A job of another size: its rank, and whether it fits inside the
                    # queue's own guarantee, may differ.
                    rank = self._guarantee_rank(queue, gpus)
                    below = self._order_distance(queue, gpus)
                    if rank > first[0] or (rank == first[0] and below > first[1]):
                        break
                    tied = rank == first[0] and below == first[1]
            if tied:
                submitted = workload.submitted_at
                if submitted > tie_submitted or (submitted == tie_submitted and behind_on_a_tie):
                    break
            if (
                workload.ranks != ranks
                or workload.gpus_per_rank != gpus_per_rank
                or job.priority_class is not priority_class
            ):
                ranks = workload.ranks
                gpus_per_rank = workload.gpus_per_rank
                priority_class = job.priority_class
                outcome = known_outcomes.get((queue, ranks, gpus_per_rank, priority_class.name))
            if outcome is None or outcome[0] != changes:
                break
            self._wait_as(job, outcome)
            at += 1
        return at

    def _queue_key(self, queue: int, head: PendingJob) -> QueueKey:
        # Work that fits inside its queue's guarantee goes before any borrowing: otherwise
        # a borrower would take GPUs that the guarantee reclaims in the next cycle.
        #
        # Among work inside its own queue's guarantee, the older submission goes first,
        # whichever queue is further below its fair share. A guarantee promises each job
        # that fits in it a start within one cycle and a grace window, and such a job
        # reclaims its own victims when it is planned. Ordered by fair share, a queue with a stream of
        # jobs far below its share went first in every plan: each GPU freed by another
        # team's victim went to the stream's newest job, and the older job it was freed
        # for only claimed GPUs still being released, again and again, for as long as
        # the stream lasted. Ordered by age, each plan hands the GPUs freed (and those
        # being released) to the jobs that reclaimed first, so the capacity freed for a
        # job stays with it across cycles without a reservation the snapshot would have
        # to carry; this is the job-age order of Slurm's multifactor priority and the
        # FIFO order of Kueue's queues, applied to the promise. A job waits only for the
        # older work inside guarantees, whose victims were chosen no later than its own.
        #
        # Other work goes by the queue furthest below its fair share, the distance weighed
        # by how little it used recently (decayed usage); ties by older submission. That
        # includes work beyond its queue's guarantee that fits in the part of an
        # ancestor's guarantee no sibling uses or holds (rank 0, see _beyond_guarantee),
        # which comes after the work inside own guarantees: the promise is the queue's.
        return (
            self._guarantee_rank(queue, head.gpus),
            self._order_distance(queue, head.gpus),
            head.workload.submitted_at,
            self.tree.names[queue],
            queue,
        )

    def _order_distance(self, queue: int, gpus: int) -> float:
        """The second part of a queue's key when its next job takes ``gpus`` GPUs (see
        _queue_key)."""
        ledger = self.ledger
        usage = ledger.usage[queue]
        if usage + gpus <= ledger.guarantee[queue]:
            return INSIDE_OWN_GUARANTEE
        below = usage - ledger.fair_share[queue]
        return below * ledger.order_boost[queue] if below < 0 else below

    def _guarantee_rank(self, queue: int, gpus: int) -> int:
        """Where ``gpus`` more for ``queue`` stand in the order: 0 inside every
        guarantee on its path (or inside an ancestor's unheld part, see
        _beyond_guarantee), 1 inside the queue's own guarantee but beyond an
        ancestor's, 2 beyond every guarantee.

        A job inside its own guarantee can still take an ancestor beyond the ancestor's
        guarantee when a sibling borrows that guarantee. Planned before another team's
        job that fits inside all of its guarantees, it would take the free GPUs that
        job needs; the other team could reclaim the sibling's borrowed work only in the
        next cycle, once the new job runs (an admit-then-reclaim flap). Planned after
        it, the job finds too few free GPUs and reclaims its sibling's work itself, in
        this plan.
        """
        usage = self.ledger.usage
        guarantee = self.ledger.guarantee
        if usage[queue] + gpus <= guarantee[queue]:
            parent = self.tree.parent
            above = parent[queue]
            while above >= 0:
                if usage[above] + gpus > guarantee[above]:
                    return 1
                above = parent[above]
            return 0
        return 2 if self._beyond_guarantee(queue, gpus) else 0

    def _beyond_guarantee(self, queue: int, gpus: int) -> bool:
        """Whether ``gpus`` more would take ``queue`` beyond every guarantee on its path.

        A job beyond its own queue's guarantee may still fit inside an ancestor's, in the
        part that the ancestor's other children neither use nor hold as their own
        guarantee. It then counts as inside: planned after another team's borrowing, it
        would take that borrowing back by reclaim or fair share in the next cycle, once
        the borrower runs (an admit-then-preempt flap).
        """
        usage = self.ledger.usage
        guarantee = self.ledger.guarantee
        parent = self.tree.parent
        children = self.tree.children
        child = queue
        above = parent[queue]
        while above >= 0:
            # The ancestor's own usage counts its children's, so the job fits nowhere
            # inside a guarantee that it would exceed; most ancestors of a full cluster
            # stop here without looking at the siblings.
            room = guarantee[above] - gpus
            if usage[above] <= room:
                held = usage[child]
                for other in children[above]:
                    if other != child:
                        held += max(guarantee[other], usage[other])
                if held <= room:
                    return False
            child = above
            above = parent[above]
        return True

    def _plan_job(self, job: PendingJob) -> None:
        workload = job.workload
        queue = job.queue
        gpus = job.gpus
        gpus_per_rank = workload.gpus_per_rank
        ranks = workload.ranks
        priority_class = job.priority_class
        kind = None
        if workload.topology_level is None:
            kind = (queue, ranks, gpus_per_rank, priority_class.name)
            known_outcome = self.outcome_by_kind.get(kind)
            if known_outcome is not None and known_outcome[0] == self.changes:
                self._wait_as(job, known_outcome)
                return
        else:
            self.changes += 1
        changes = self.changes
        nodes = self.nodes
        ledger = self.ledger
        quota_reason = ledger.quota_reason(queue, gpus, priority_class)
        if workload.topology_level is not None:
            if quota_reason is None and self._plan_in_one_domain(job):
                return
            if workload.topology_required:
                self._record_wait(workload.id, quota_reason or self._domain_reason(job))
                return
        if quota_reason is None:
            # The cheap tests of NodeMap.place_free, spelled out: on a full cluster most
            # jobs stop here, and this runs once per pending workload.
            known_failure = nodes.unplaceable_on_free.get(gpus_per_rank)
            if (
                gpus <= nodes.free_total
                and gpus_per_rank <= nodes.max_node_gpus
                and (known_failure is None or ranks < known_failure)
            ):
                placement = nodes.place_free(ranks, gpus_per_rank)
                if placement is not None:
                    self._admit(job, placement)
                    return
            if nodes.releasing_nodes:
                known_failure = self.unplaceable_on_releasing.get(gpus_per_rank)
                if known_failure is None or ranks < known_failure:
                    if nodes.hostable_ranks(gpus_per_rank) >= ranks:
                        placement = nodes.place_on(ranks, gpus_per_rank, {})
                        if placement is not None:
                            self._wait_on(job, placement)
                            return
                    self.unplaceable_on_releasing[gpus_per_rank] = min(
                        ranks, known_failure if known_failure is not None else ranks
                    )
        modes = self._modes(job)
        self.victims.protected.clear()
        if modes:
            job.attempted_at_version = self.candidates_version
        failed_attempts = self.failed_attempts
        # What a failed reclaim search of this job read, for its priority search.
        reclaimed: list[tuple[RunningWork, str]] | None = None
        for mode in modes:
            # Reclaim and fair-share moves do not depend on the preemptor's priority.
            value = priority_class.value if mode == PRIORITY else 0
            attempt = (queue, mode, gpus_per_rank, value, priority_class.preemptible)
            failed = failed_attempts.get(attempt)
            if failed is not None and failed[1] == self.candidates_version and ranks >= failed[0]:
                continue
            if mode == FAIR_SHARE and self._known_dry(job):
                continue
            self.changes += 1
            candidates = self._candidates(job, mode, reclaimed)
            stream = None
            if mode == RECLAIM and PRIORITY in modes:
                # Kept only for a priority search that may follow.
                stream = ReclaimStream()
                candidates = stream.record(candidates)
            result = self._search(job, mode, candidates)
            if result is None and mode == RECLAIM and self.node_searches_left > 0:
                # Cheap victims scattered over many nodes can use up the donors'
                # budget above their guarantee lines before any node frees enough;
                # clearing whole nodes finds the victims that do make room. It
                # costs a pass over the running work, so a plan does it a few times.
                self.node_searches_left -= 1
                result = reclaim_by_node(ledger, nodes, self.victims, job)
            if result is None:
                failed_attempts[attempt] = (ranks, self.candidates_version)
                if stream is not None and stream.complete(MAX_CANDIDATES_PER_ATTEMPT):
                    reclaimed = stream.items
                continue
            victims, placement = result
            self._take(job, victims, placement)
            return
        if (
            quota_reason is None
            and self.consolidations_left > 0
            and gpus <= nodes.free_total
            and all(ledger.usage[x] + gpus <= ledger.guarantee[x] for x in self.tree.path[queue])
        ):
            # Enough GPUs are free, just not together, and the gang fits inside its
            # guarantee: move small jobs off a few nodes to the free GPUs elsewhere.
            self.consolidations_left -= 1
            self.changes += 1
            moved = consolidate(nodes, self.victims, job)
            if moved is not None:
                victims, placement, holes = moved
                for node, hole in holes:
                    # Kept for the moved jobs: nothing else in this plan takes them.
                    nodes.set_free(node, nodes.free[node] - hole)
                nodes.unplaceable_on_free.clear()
                nodes.unplaceable_in_domain.clear()
                self._take(job, victims, placement)
                return
        if (
            quota_reason is None
            and RECLAIM in modes
            and self.consolidations_left > 0
            and gpus > nodes.free_total
        ):
            # No node can be cleared by reclaim alone (each also runs a small job of a
            # queue at or under its line) nor by moving jobs (no GPU is free): reclaim
            # one more donor job elsewhere for each small job to move to.
            self.consolidations_left -= 1
            self.changes += 1
            moved = reclaim_and_move(ledger, nodes, self.victims, job)
            if moved is not None:
                victims, placement, holes = moved
                for run, reason in victims:
                    if reason == RECLAIM:
                        ledger.add_usage(run.queue, -run.gpus)
                self._take(job, victims, placement)
                for node, hole in holes:
                    # Kept for the moved jobs: nothing else in this plan claims them.
                    nodes.take_releasing(node, hole)
                return
        protected_until: float | None = None
        if quota_reason is None:
            shape = (ranks, gpus_per_rank)
            quota_reason = self.reason_by_shape.get(shape)
            if quota_reason is None:
                quota_reason = self._physical_reason(ranks, gpus_per_rank)
                self.reason_by_shape[shape] = quota_reason
            protection, protected_until = self._protected_until(job, modes)
            if protection:
                quota_reason = f"{quota_reason}; {protection}"
            if self.usage_matters:
                usage_reason = ledger.usage_reason(queue, gpus)
                if usage_reason:
                    quota_reason = f"{quota_reason}; {usage_reason}"
        outcome = (changes, quota_reason, protected_until, bool(modes))
        if kind is not None and self.changes == changes:
            self.outcome_by_kind[kind] = outcome
        self._wait_as(job, outcome)

    def _wait_as(self, job: PendingJob, outcome: WaitOutcome) -> None:
        """Record that ``job`` waits with ``outcome`` (see ``outcome_by_kind``)."""
        _, reason, protected_until, attempted = outcome
        if attempted:
            job.attempted_at_version = self.candidates_version
        self._record_wait(job.workload.id, reason, protected_until)

    def _record_wait(
        self, workload_id: str, reason: str, protected_until: float | None = None
    ) -> None:
        """Record that a workload being planned waits for ``reason``; a later pass keeps
        what it recorded before for the same reason (``retrying``)."""
        known = self.waits.get(workload_id) if self.retrying else None
        if known is None or known.reason != reason:
            self.waits[workload_id] = Waiting(workload_id, reason, protected_until)

    def _take(self, job: PendingJob, victims: Victims, placement: Placement) -> None:
        """Make ``victims`` give way to ``job``, which starts or waits on ``placement``."""
        self.changes += 1
        workload = job.workload
        gpus_per_rank = workload.gpus_per_rank
        nodes = self.nodes
        running_victims = False
        for run, reason in victims:
            self.victims.take(run)
            victim_id = run.workload.id
            if run.planned:
                # Admitted earlier in this same plan: it never starts, and its GPUs
                # are free at once rather than after a grace window.
                del self.admitted[victim_id]
                del self.admissions[victim_id]
                if not run.priority_class.preemptible:
                    self.ledger.pinned_usage[run.queue] -= run.gpus
                self.ledger.plan_usage(run.queue, -run.gpus)
                for node, gpus in run.nodes:
                    nodes.set_free(node, nodes.free[node] + gpus)
                nodes.unplaceable_on_free.clear()
                nodes.unplaceable_in_domain.clear()
                self.retry_waiting = True
                self.gpus_freed = True
                self.waits[victim_id] = Waiting(
                    victim_id, f"gives way to job {workload.id} ({reason})"
                )
                continue
            running_victims = True
            self.preempt.append(
                Preemption(victim_id, reason, workload.id, run.priority_class.grace_seconds)
            )
            for node, gpus in run.nodes:
                nodes.release(node, gpus, victim_id)
        self.unplaceable_on_releasing.clear()
        self.unplaceable_in_domain_releasing.clear()
        if not running_victims and all(
            nodes.free[node] >= ranks * gpus_per_rank for node, ranks in placement
        ):
            self._admit(job, placement)
        else:
            self._wait_on(job, placement, tuple(run.workload.id for run, _ in victims))

    def _admit(self, job: PendingJob, placement: Placement) -> None:
        """Start ``job`` on ``placement`` now; it becomes a candidate victim for later jobs.

        A later job of this same plan may still take it back (R6-R8); the plan then
        withdraws the admission instead of preempting, so the final plan is one that
        the next cycle would not undo.
        """
        self.changes += 1
        workload = job.workload
        queue = job.queue
        gpus = workload.gpus
        ledger = self.ledger
        borrowed = 0
        if job.priority_class.preemptible:
            borrowed = max(0, ledger.usage[queue] + gpus - ledger.guarantee[queue]) - max(
                0, ledger.usage[queue] - ledger.guarantee[queue]
            )
        else:
            ledger.pinned_usage[queue] += gpus
        self.nodes.claim(placement, workload.gpus_per_rank)
        ledger.add_usage(queue, gpus)
        ledger.plan_usage(queue, gpus)
        self.admitted[workload.id] = (queue, gpus)
        on_nodes = tuple((self.nodes.names[node], ranks) for node, ranks in placement)
        self.admissions[workload.id] = Admission(workload.id, on_nodes, borrowed)
        self.waits.pop(workload.id, None)
        if job.priority_class.preemptible:
            # A new candidate victim can make a failed attempt succeed: forget cached
            # failures, and give the workloads that already wait another pass.
            if ledger.usage[queue] > min(ledger.guarantee[queue], ledger.fair_share[queue]):
                self.candidates_version += 1
                self.retry_waiting = True
            started = dataclasses.replace(
                workload, state="running", placement=on_nodes, admitted_at=self.now
            )
            gpus_on_nodes = tuple(
                (node, ranks * workload.gpus_per_rank) for node, ranks in placement
            )
            self.victims.add(
                RunningWork(
                    started,
                    queue,
                    job.priority_class,
                    gpus_on_nodes,
                    self.now,
                    self.minimums[job.priority_class.name],
                    planned=True,
                )
            )

    def _plan_in_one_domain(self, job: PendingJob) -> bool:
        """Place ``job`` with all its ranks inside one domain of its topology level.

        Free GPUs first, in the domain with the least room that fits the gang, so that
        whole domains stay free for larger gangs; then GPUs being released; then
        victims, searched domain by domain so that the GPUs they free lie together
        (a search over the whole cluster frees GPUs scattered over domains that no
        gang of this kind can use), the domain with the cheapest victims winning.
        Returns whether the job was admitted, reserved or took victims.
        """
        workload = job.workload
        nodes = self.nodes
        ranks = workload.ranks
        gpus_per_rank = workload.gpus_per_rank
        level = workload.topology_level or ""
        domains = nodes.domains.get(level, {})
        free = nodes.free
        # Free GPUs only shrink until the cache is cleared: a gang of as many ranks or
        # more that found no domain finds none again.
        shape = (level, gpus_per_rank)
        known_failure = nodes.unplaceable_in_domain.get(shape)
        if known_failure is None or ranks < known_failure:
            fitting: list[tuple[int, str, Placement]] = []
            for name, members in domains.items():
                placement = nodes.place_in(members, ranks, gpus_per_rank, releasing=False)
                if placement is not None:
                    fitting.append((sum(free[node] for node in members), name, placement))
            if fitting:
                self._admit(job, min(fitting)[2])
                return True
            nodes.unplaceable_in_domain[shape] = min(ranks, known_failure or ranks)
        known_failure = self.unplaceable_in_domain_releasing.get(shape)
        if nodes.releasing_nodes and (known_failure is None or ranks < known_failure):
            for _name, members in sorted(domains.items()):
                placement = nodes.place_in(members, ranks, gpus_per_rank)
                if placement is not None:
                    self._wait_on(job, placement)
                    return True
            self.unplaceable_in_domain_releasing[shape] = min(ranks, known_failure or ranks)
        modes = self._modes(job)
        if modes:
            job.attempted_at_version = self.candidates_version
        failed_attempts = self.failed_attempts
        for mode in modes:
            value = job.priority_class.value if mode == PRIORITY else 0
            # The kinds of failed attempts of _plan_job, per topology level.
            attempt = (
                job.queue,
                f"{mode}@{level}",
                gpus_per_rank,
                value,
                job.priority_class.preemptible,
            )
            failed = failed_attempts.get(attempt)
            if failed is not None and failed[1] == self.candidates_version and ranks >= failed[0]:
                continue
            best: tuple[tuple[float, float, str], str] | None = None
            # The best search's victims and placement while their quota usage is still
            # taken: given back before the next search, which must start from the same
            # ledger, and searched again only if a later domain came in between.
            held: tuple[Victims, Placement] | None = None
            # Each search is a scan over the candidates: try the domains with the most
            # room for ranks once their preemptible work is gone, a few of them.
            for name in nodes.roomiest_domains(
                level, gpus_per_rank, self.preemptible_on_node, DOMAIN_SEARCHES_PER_MODE
            ):
                if mode == FAIR_SHARE and self._known_dry(job):
                    # No candidate in the whole cluster, so none in any domain either.
                    break
                if held is not None:
                    self._give_back(held[0])
                    held = None
                found = self._search_domain(job, mode, level, name)
                if found is None:
                    continue
                victims, _ = found
                cost = (
                    float(max(run.priority_class.value for run, _ in victims)),
                    sum(run.lost for run, _ in victims),
                    name,
                )
                if best is None or cost < best[0]:
                    best = (cost, name)
                    held = found
                else:
                    self._give_back(victims)
            if best is None:
                failed_attempts[attempt] = (ranks, self.candidates_version)
                continue
            if held is None:
                held = self._search_domain(job, mode, level, best[1])
            if held is not None:
                self._take(job, *held)
                return True
        return False

    def _search_domain(
        self, job: PendingJob, mode: str, level: str, name: str
    ) -> tuple[Victims, Placement] | None:
        """``preempt_for`` with ``mode``'s candidates that run in domain ``name`` of
        ``level``, placing ``job`` inside that domain."""
        return self._search(
            job,
            mode,
            _in_domain(self._candidates(job, mode), self.nodes.domain_of[level], name),
            self.nodes.domains[level][name],
        )

    def _search(
        self,
        job: PendingJob,
        mode: str,
        candidates: Iterator[tuple[RunningWork, str]],
        domain: list[int] | None = None,
    ) -> tuple[Victims, Placement] | None:
        """``preempt_for`` over ``mode``'s ``candidates`` (those in ``domain`` when one is
        given). A fair-share search that met no candidate at all, protected or not,
        marks the queue dry (``_note_dry``): with a domain too, as the candidates it
        filters are the whole cluster's."""
        offered = self.victims.fair_share_offered
        protected = len(self.victims.protected)
        found = preempt_for(self.ledger, self.nodes, job, candidates, domain)
        if (
            found is None
            and mode == FAIR_SHARE
            and self.victims.fair_share_offered == offered
            and len(self.victims.protected) == protected
        ):
            self._note_dry(job)
        return found

    def _known_dry(self, job: PendingJob) -> bool:
        """Whether a fair-share search for ``job`` is known to find no candidate at all
        (see ``fair_share_dry``)."""
        dry = self.fair_share_dry.get(job.queue)
        return dry is not None and dry[1] == self.candidates_version and job.gpus >= dry[0]

    def _note_dry(self, job: PendingJob) -> None:
        """Record that a fair-share search for ``job`` found no candidate, protected or
        not: R8 only gets harder for more GPUs, so no job of the queue that large or
        larger finds one either while the candidates stay the same, whatever its shape
        or topology."""
        dry = self.fair_share_dry.get(job.queue)
        if dry is None or dry[1] != self.candidates_version or job.gpus < dry[0]:
            self.fair_share_dry[job.queue] = (job.gpus, self.candidates_version)

    def _give_back(self, victims: Victims) -> None:
        """Undo the quota usage a successful ``preempt_for`` left taken for ``victims``."""
        for run, _ in victims:
            self.ledger.add_usage(run.queue, run.gpus)

    def _candidates(
        self, job: PendingJob, mode: str, reclaimed: list[tuple[RunningWork, str]] | None = None
    ) -> Iterator[tuple[RunningWork, str]]:
        if mode == RECLAIM:
            return self.victims.reclaim(job.queue)
        if mode == PRIORITY:
            return self.victims.priority(job, reclaimed)
        return self.victims.fair_share(job)

    def _domain_reason(self, job: PendingJob) -> str:
        workload = job.workload
        level = workload.topology_level
        if level not in self.nodes.domains:
            return f"no node of flavor {self.flavor} has a {level} in its topology"
        return (
            f"no {level} of flavor {self.flavor} has room for {workload.ranks} ranks of "
            f"{workload.gpus_per_rank} GPUs together"
        )

    def _protected_until(self, job: PendingJob, modes: list[str]) -> tuple[str, float | None]:
        """Until when the victims that would let ``job`` in are protected, in words and
        as a moment, or ("", None).

        Asked only of a workload that found no victims while some candidates were passed
        over for their minimum runtime: its searches run again with that protection
        ignored, and when they succeed the waiting reason names the protected victims
        and the moment the last of them may go. The searches' tentative quota changes
        are undone; a plan runs a bounded number of them, and workloads of one kind
        share the answer while the candidates stay the same.
        """
        victims = self.victims
        workload = job.workload
        kind = (
            job.queue,
            workload.ranks,
            workload.gpus_per_rank,
            job.priority_class.value,
            job.priority_class.preemptible,
        )
        version = (self.candidates_version, len(self.preempt))
        known = self.protection_by_kind.get(kind)
        if known is not None and known[0] == version:
            return known[1]
        if not victims.protected or self.protection_searches_left <= 0:
            return "", None
        self.protection_searches_left -= 1
        self.changes += 1
        victims.ignore_protection = True
        try:
            found = None
            for mode in modes:
                found = preempt_for(self.ledger, self.nodes, job, self._candidates(job, mode))
                if found is not None:
                    break
        finally:
            victims.ignore_protection = False
        phrase = ""
        moment_at: float | None = None
        if found is not None:
            chosen, _ = found
            for run, _ in chosen:
                # preempt_for leaves its victims' quota usage taken: give it back.
                self.ledger.add_usage(run.queue, run.gpus)
            protected = [
                (run, reason, self.now - run.runtime + run.minimum[reason])
                for run, reason in chosen
                if run.runtime < run.minimum[reason]
            ]
            if protected:
                until = max(at for _, _, at in protected)
                moment_at = until
                ids = [run.workload.id for run, _, _ in protected]
                reasons = sorted({reason for _, reason, _ in protected})
                moment = datetime.fromtimestamp(until, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
                phrase = (
                    f"{_jobs_phrase(ids)} may be preempted ({', '.join(reasons)}) only after "
                    f"their minimum runtime, at {moment} (in {until - self.now:.0f} s)"
                )
        self.protection_by_kind[kind] = (version, (phrase, moment_at))
        return phrase, moment_at

    def _modes(self, job: PendingJob) -> list[str]:
        """The kinds of preemption that could let ``job`` in: reclaim, priority, fair share."""
        queue = job.queue
        gpus = job.gpus
        ledger = self.ledger
        modes: list[str] = []
        # Victims of other queues never lower this queue's own borrowing, so a
        # non-preemptible job beyond its guarantee can only gain from priority (R5).
        within_guarantee = ledger.pinned_usage[queue] + gpus <= ledger.guarantee[queue]
        if r6_may_reclaim(ledger.usage[queue], gpus, ledger.guarantee[queue]):
            modes.append(RECLAIM)
        runs = self.victims.by_queue[queue]
        first = self.victims.first_live_index(queue)
        if (
            job.priority_class.preemption_policy == PREEMPT_LOWER_PRIORITY
            and first < len(runs)
            and runs[first].priority_class.value < job.priority_class.value
        ):
            modes.append(PRIORITY)
        if ledger.usage[queue] < ledger.fair_share[queue] and (
            job.priority_class.preemptible or within_guarantee
        ):
            modes.append(FAIR_SHARE)
        return modes

    def _wait_on(
        self, job: PendingJob, placement: Placement, victims: tuple[str, ...] = ()
    ) -> None:
        self.changes += 1
        workload = job.workload
        ledger = self.ledger
        from_releasing, released_by = self.nodes.claim(placement, workload.gpus_per_rank)
        ledger.add_usage(job.queue, workload.gpus)
        for x in self.tree.path[job.queue]:
            ledger.waiting_usage[x] += workload.gpus
        if not job.priority_class.preemptible:
            ledger.pinned_usage[job.queue] += workload.gpus
        if from_releasing:
            reason = (
                f"waiting for {from_releasing} GPUs being released by {_jobs_phrase(released_by)}"
            )
        elif victims:
            # The victims free quota rather than GPUs on the chosen nodes.
            reason = f"waiting for {_jobs_phrase(list(victims))} to exit and return quota"
        else:
            reason = "waiting for its reserved GPUs"
        self.waits[workload.id] = Waiting(workload.id, reason)
        self.reserved.add(workload.id)

    def _physical_reason(self, ranks: int, gpus_per_rank: int) -> str:
        flavor = self.flavor
        nodes = self.nodes
        if not nodes.names:
            return f"no node of flavor {flavor} exists"
        if gpus_per_rank > nodes.max_node_gpus:
            return f"no node of flavor {flavor} has {gpus_per_rank} GPUs"
        if ranks * gpus_per_rank > nodes.capacity:
            return f"flavor {flavor} has only {nodes.capacity} GPUs"
        if ranks * gpus_per_rank <= nodes.max_node_gpus:
            return f"no node of flavor {flavor} has {ranks * gpus_per_rank} free GPUs"
        return f"{ranks} ranks of {gpus_per_rank} GPUs do not fit on the free {flavor} GPUs"
