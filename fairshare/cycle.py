"""The cycle: the order in which one flavor's pending workloads are planned, and what
becomes of each.

Decides, for every pending workload of one flavor, whether it starts now on free GPUs,
waits for GPUs already being released (R11), takes victims (reclaim, priority or fair
share; consolidation when free GPUs are scattered) or shrinks running elastic gangs
(``elastic.py``), whichever loses less work, and waits for them, or waits with a
reason; and, once all of them are planned, which running elastic gangs grow.
Workloads are taken from a heap of queues: work that fits inside its queue's
guarantee (its own or an ancestor's) first, and of that the work inside its queue's own
guarantee first, oldest submission first across queues; then the queue furthest below
its fair share (ties: older submission); inside a queue, higher priority first, then
older submission. Work admitted earlier in
the same plan may be taken back before it starts, and workloads still waiting get more
passes, so that the next cycle does not undo the plan.

The passes are this module's; ``FlavorPlanner`` builds on the keys that order the
queues (``order.py``), the preemption searches (``searches.py``) and the planning state
and the decisions it records (``decisions.py``).
"""

from __future__ import annotations

import heapq

from .consolidation import consolidate, reclaim_and_move
from .decisions import WaitOutcome
from .elastic import (
    Shrink,
    evictions_cost,
    give_back,
    grow_placement,
    grown_placement,
    shrink_costs_less,
    shrink_for,
    shrinks_cost,
    take_again,
)
from .model import FAIR_SHARE, PRIORITY, RECLAIM, PriorityClass, Resize
from .nodes import Placement
from .order import FlavorOrder
from .preemption import MAX_CANDIDATES_PER_ATTEMPT, reclaim_by_node
from .reclaim_scan import ReclaimStream
from .work import INSIDE_OWN_GUARANTEE, PendingJob, QueueKey, RunningWork

# Passes over the workloads still waiting after the first pass, each run only when the
# previous pass changed what they could do.
RETRY_PASSES = 3


class FlavorPlanner(FlavorOrder):
    """Plans the pending workloads of one flavor."""

    # The pass being run (``_pass``): its heap of queues, their pending jobs and the
    # position of each queue's next job.
    pass_heap: list[QueueKey]
    pass_pending: list[list[PendingJob]]
    pass_position: list[int]

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
        if self.growable:
            self._grow()
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
        # What ``_others_wait_inside_guarantee`` reads while a job is planned.
        self.pass_heap = heap
        self.pass_pending = pending
        self.pass_position = position
        # The workloads of this pass that others gave way to and that have yet to be
        # planned in it; the pending workloads held back until each is.
        awaited: set[str] = set()
        if self.awaited:
            awaited = {
                job.workload.id
                for jobs in pending
                for job in jobs
                if job.workload.id in self.awaited
            }
        self.pass_awaited = awaited
        deferred: dict[str, list[PendingJob]] = {}
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
            queue = heappop(heap).queue
            jobs = pending[queue]
            at = position[queue]
            if awaited:
                self._plan_in_turn(jobs[at], deferred)
            else:
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
                key = QueueKey(
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
        # Held back for a workload that never came (two that gave way to each other).
        for followers in deferred.values():
            for job in followers:
                self._plan_job(job)
        awaited.clear()

    def _plan_in_turn(self, job: PendingJob, deferred: dict[str, list[PendingJob]]) -> None:
        """Plan ``job``, unless it gave way to a workload this pass has yet to plan: then
        it is held back in ``deferred`` and planned right after that one.

        The GPUs a job's victims free are kept for it while they are released; once a
        victim has exited and is pending again, only the order keeps them. A victim
        inside its own guarantee, or moved aside by a consolidation, would go first by
        age and take back the GPUs it had just freed (a moved gang restarts on the node
        cleared for the job it moved for, its one node with room for all its ranks).
        Planned after the job it gave way to, it takes only what that job leaves.
        """
        awaited = self.pass_awaited
        workload = job.workload
        preemptor = workload.preemptor
        if preemptor is not None and preemptor != workload.id and preemptor in awaited:
            deferred.setdefault(preemptor, []).append(job)
            return
        self._plan_job(job)
        if workload.id in awaited:
            awaited.discard(workload.id)
            for follower in deferred.pop(workload.id, []):
                self._plan_in_turn(follower, deferred)

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
        queue = key.queue
        below = key.distance
        gpus = jobs[at].gpus
        changes = self.changes
        known_outcomes = self.outcome_by_kind
        # When the first two parts tie, a job falls behind ``first`` when it was
        # submitted later, or at the same moment and its queue's name and index go
        # after ``first``'s (the same for every job here).
        tied = first is not None and first.rank == key.rank and first.distance == below
        tie_submitted = first.submitted if first is not None else 0.0
        behind_on_a_tie = first is not None and (key.name, queue) > (first.name, first.queue)
        # The kind of the job before and its outcome: ``changes`` stays as it is while
        # jobs only wait, so jobs of one kind in a row look it up once.
        ranks = -1
        gpus_per_rank = -1
        priority_class: PriorityClass | None = None
        outcome: WaitOutcome | None = None
        count = len(jobs)
        kept = self.kept
        awaited = self.pass_awaited
        while at < count:
            job = jobs[at]
            workload = job.workload
            if (
                workload.topology_level is not None
                or workload.sizes
                or (kept and workload.id in kept)
                or (awaited and (workload.id in awaited or workload.preemptor is not None))
            ):
                break
            if job.gpus != gpus:
                # A job of another size: of its key only the guarantee rank can differ.
                gpus = job.gpus
                if first is not None:
                    # A job of another size: its rank, and whether it fits inside the
                    # queue's own guarantee, may differ.
                    rank = self._guarantee_rank(queue, gpus)
                    below = self._order_distance(queue, gpus)
                    if rank > first.rank or (rank == first.rank and below > first.distance):
                        break
                    tied = rank == first.rank and below == first.distance
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

    def _release_kept(self, workload_id: str) -> list[int]:
        """Count the GPUs being freed for ``workload_id``, kept for it until now, among
        the releasing GPUs, and the free ones kept beside them among the free; the nodes
        they are on, where it looks first if it waits.

        Kept until the workload is planned, in its place in the order: from then on
        whatever it does not take is everyone's, as any releasing GPU is."""
        nodes = self.nodes
        on: dict[int, None] = {}
        for victim, on_nodes in self.kept.pop(workload_id):
            for node, gpus in on_nodes:
                nodes.release(node, gpus, victim)
                on[node] = None
        for node, gpus in self.kept_free.pop(workload_id, ()):
            nodes.set_free(node, nodes.free[node] + gpus)
            nodes.unplaceable_on_free.clear()
            nodes.unplaceable_in_domain.clear()
        self.unplaceable_on_releasing.clear()
        self.unplaceable_in_domain_releasing.clear()
        self.changes += 1
        return list(on)

    def _shrink_search(self, job: PendingJob, mode: str) -> tuple[list[Shrink], Placement] | None:
        """The shrinks of running elastic gangs that let ``job`` in for ``mode``, with
        their quota usage given back until the planner takes them (``_take_shrinks``),
        so that the eviction search starts from the same ledger.

        It changes nothing it reads, so a workload of the same kind planned while
        nothing else changed finds the same (``outcome_by_kind`` may be reused); and a
        search that failed is not run again for as many ranks or more of the same kind
        until new candidates come, as ``failed_attempts`` spares eviction searches."""
        workload = job.workload
        priority_class = job.priority_class
        value = priority_class.value if mode == PRIORITY else 0
        attempt = (job.queue, mode, workload.gpus_per_rank, value, priority_class.preemptible)
        failed = self.failed_shrinks.get(attempt)
        if (
            failed is not None
            and failed[1] == self.candidates_version
            and workload.ranks >= failed[0]
        ):
            return None
        found = shrink_for(self.ledger, self.nodes, self.shrinkable, job, mode)
        if found is None:
            self.failed_shrinks[attempt] = (workload.ranks, self.candidates_version)
            return None
        give_back(self.ledger, found[0])
        return found

    def _take_shrinks(self, job: PendingJob, found: tuple[list[Shrink], Placement]) -> None:
        """Take the shrinks ``_shrink_search`` found for ``job``."""
        shrinks, placement = found
        take_again(self.ledger, shrinks)
        self._shrink(job, shrinks, placement)

    def _grow(self) -> None:
        """Grow running elastic gangs into the GPUs left free once every pending
        workload of the flavor was planned.

        A gang grows to the largest of its sizes that its quota allows and the free GPUs
        hold (its own nodes first), once it has run its class's fair-share minimum since
        its last start or resize (the anti-flap margin: what it takes may be taken back
        by fair share). It grows beyond a guarantee on its path only while no other
        team's work of the flavor waits (that work would reclaim or take back by fair
        share what it borrows, one plan after the grow), and not at all while work of
        its own team of higher priority waits (the queue's order gives free GPUs to
        that work first). Higher priority first, then the gang that started first.
        """
        ledger = self.ledger
        nodes = self.nodes
        path = self.tree.path
        taken = {p.id for p in self.preempt}
        for resize in self.resize:
            taken.add(resize.workload)
        waiting_priority: dict[int, int] = {}
        for jobs in self.pending:
            for job in jobs:
                if job.workload.id in self.waits:
                    known = waiting_priority.get(job.queue)
                    if known is None or job.priority > known:
                        waiting_priority[job.queue] = job.priority
        gangs = sorted(
            self.growable,
            key=lambda entry: (-entry[2].value, entry[0].admitted_at or 0.0, entry[0].id),
        )
        for workload, queue, priority_class in gangs:
            if workload.id in taken:
                continue
            admitted = workload.admitted_at
            minimum = self.minimums[priority_class.name][FAIR_SHARE]
            if admitted is not None and self.now - admitted < minimum:
                continue
            own = waiting_priority.get(queue)
            if own is not None and own > priority_class.value:
                continue
            others_wait = any(other != queue for other in waiting_priority)
            gpus_per_rank = workload.gpus_per_rank
            for size in reversed(workload.sizes):
                if size <= workload.ranks:
                    break
                extra = (size - workload.ranks) * gpus_per_rank
                if ledger.quota_reason(queue, extra, priority_class) is not None:
                    continue
                if others_wait and any(
                    ledger.usage[x] + extra > ledger.guarantee[x] for x in path[queue]
                ):
                    continue
                added = grow_placement(nodes, workload, size - workload.ranks)
                if added is None:
                    continue
                nodes.claim(added, gpus_per_rank)
                ledger.add_usage(queue, extra)
                if not priority_class.preemptible:
                    ledger.pinned_usage[queue] += extra
                self.resize.append(
                    Resize(
                        workload.id,
                        size,
                        grown_placement(nodes.names, nodes.index, workload, added),
                        f"grown from {workload.ranks} to {size} ranks",
                    )
                )
                self.resized_usage.append((queue, extra))
                break

    def _plan_job(self, job: PendingJob) -> None:
        kept_on: list[int] = []
        if self.kept and job.workload.id in self.kept:
            kept_on = self._release_kept(job.workload.id)
        if not job.workload.sizes:
            self._plan_gang(job, kept_on)
            return
        if self._admit_largest_size(job):
            return
        # No size fits without preemption: the job preempts, or waits, for its
        # smallest size only. Taking more than the least it can run on would cost
        # others work that the job does not need to start.
        smallest = job.at_size(job.workload.sizes[0])
        self._plan_gang(smallest, kept_on)
        job.attempted_at_version = smallest.attempted_at_version

    def _admit_largest_size(self, job: PendingJob) -> bool:
        """Admit elastic ``job`` at the largest of its sizes, up to its ranks, that its
        quota allows and free GPUs hold; whether one did."""
        workload = job.workload
        gpus_per_rank = workload.gpus_per_rank
        nodes = self.nodes
        others_wait: bool | None = None
        for ranks in reversed(workload.sizes):
            if ranks > workload.ranks:
                continue
            if self.ledger.quota_reason(job.queue, ranks * gpus_per_rank, job.priority_class):
                continue
            if (
                self.ledger.usage[job.queue] + ranks * gpus_per_rank
                > self.ledger.guarantee[job.queue]
            ):
                # A size beyond its queue's own guarantee would borrow GPUs that another
                # team's work inside its own guarantee, planned later in this pass,
                # needs: that work would reclaim them in the next plan (an
                # admit-then-reclaim flap).
                if others_wait is None:
                    others_wait = self._others_wait_inside_guarantee()
                if others_wait:
                    continue
            placement = nodes.place_free(ranks, gpus_per_rank)
            if placement is not None:
                self._admit(job.at_size(ranks), placement)
                return True
        return False

    def _others_wait_inside_guarantee(self) -> bool:
        """Whether another queue's next job in this pass fits inside its queue's own
        guarantee at its smallest size. An elastic job's place in the pass is that of its
        largest size, so such a job may come after work beyond the guarantees."""
        usage = self.ledger.usage
        guarantee = self.ledger.guarantee
        pending = self.pass_pending
        position = self.pass_position
        for key in self.pass_heap:
            queue = key.queue
            workload = pending[queue][position[queue]].workload
            smallest = workload.sizes[0] if workload.sizes else workload.ranks
            if usage[queue] + smallest * workload.gpus_per_rank <= guarantee[queue]:
                return True
        return False

    def _plan_gang(self, job: PendingJob, kept_on: list[int]) -> None:
        """Plan ``job`` as a gang of exactly its ranks: start it on free GPUs, wait for
        GPUs being released, preempt for it, move small jobs aside, or let it wait."""
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
            if kept_on:
                placement = nodes.place_within(ranks, gpus_per_rank, kept_on)
                if placement is not None:
                    self._wait_on(job, placement)
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
            # Running elastic gangs that could give up ranks instead (elastic.py): the
            # eviction search below decides only which of the two costs less.
            shrunk = self._shrink_search(job, mode) if self.shrinkable else None
            failed = failed_attempts.get(attempt)
            if failed is not None and failed[1] == self.candidates_version and ranks >= failed[0]:
                if shrunk is not None:
                    self._take_shrinks(job, shrunk)
                    return
                continue
            if mode == FAIR_SHARE and self._known_dry(job):
                if shrunk is not None:
                    self._take_shrinks(job, shrunk)
                    return
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
                if shrunk is not None:
                    self._take_shrinks(job, shrunk)
                    return
                if stream is not None and stream.complete(MAX_CANDIDATES_PER_ATTEMPT):
                    reclaimed = stream.items
                continue
            victims, placement = result
            if shrunk is not None and shrink_costs_less(
                shrinks_cost(shrunk[0]), evictions_cost(victims)
            ):
                self._give_back(victims)
                self._take_shrinks(job, shrunk)
                return
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
