"""One flavor's planning state, and the decisions that change it.

``FlavorDecisions`` sets up what a flavor's planner works on (its nodes, the quota
ledger, the candidate victims, the memos of earlier searches) and records what becomes
of a workload: it starts on its GPUs (``_admit``), its victims give way to it
(``_take``) or running elastic gangs give up ranks to it (``_shrink``), it waits for
GPUs reserved for it (``_wait_on``) or with a reason
(``_wait_as``, and the reasons in words). The planner's searches
(``searches.FlavorSearches``) and its passes (``cycle.FlavorPlanner``) build on it.
Records decisions; never chooses which workload comes next nor which victims to take.
"""

from __future__ import annotations

from collections.abc import Mapping

from .candidates import VictimCandidates
from .consolidation import CONSOLIDATIONS_PER_PLAN
from .elastic import Shrink, may_grow, may_shrink
from .ledger import QuotaLedger
from .model import (
    FAIR_SHARE,
    PENDING,
    PRIORITY,
    RECLAIM,
    TERMINATING,
    Admission,
    Preemption,
    PriorityClass,
    Resize,
    Snapshot,
    Waiting,
    Workload,
    minimum_runtimes,
)
from .nodes import NodeMap, Placement
from .preemption import Victims
from .tree import QueueTree
from .work import PendingJob, RunningWork, by_order, in_queue_order

# Node-clearing reclaim searches (see preemption.reclaim_by_node) a plan may run: each
# is a pass over the running work of the queues above their guarantee.
NODE_SEARCHES_PER_PLAN = 8
# Searches a plan may run to find until when a waiting workload's victims are protected
# by their minimum runtime: each repeats the workload's preemption searches.
PROTECTION_SEARCHES_PER_PLAN = 16

# How a workload that found no way in waits: FlavorPlanner.changes when it was planned,
# its reason, until when its victims are protected, and whether it tried to preempt.
WaitOutcome = tuple[int, str, float | None, bool]


def jobs_phrase(ids: list[str]) -> str:
    """``ids`` in words for a reason: "job a", or "jobs a, b, c and 2 more" (each once)."""
    if len(ids) == 1:
        # Most waits name one job (every waiting job's reason is built, thousands a plan).
        return f"job {ids[0]}"
    unique = list(dict.fromkeys(ids))
    shown = ", ".join(unique[:3])
    more = f" and {len(unique) - 3} more" if len(unique) > 3 else ""
    return f"job {shown}" if len(unique) == 1 else f"jobs {shown}{more}"


class FlavorDecisions:
    """One flavor's planning state and the decisions recorded in it."""

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
        # Running elastic gangs whose class lets them be resized: those that may give
        # up ranks, and those below their largest size, with their queue and class.
        shrinkable: list[RunningWork] = []
        self.growable: list[tuple[Workload, int, PriorityClass]] = []
        terminating: list[tuple[str, tuple[tuple[int, int], ...]]] = []
        freed_for: list[tuple[str, str, tuple[tuple[int, int], ...]]] = []
        # The workloads that pending ones gave way to (their preemptors).
        gave_way: list[str] = []
        for workload in workloads:
            queue = tree.index[workload.queue]
            priority_class = classes[workload.priority_class]
            gpus = workload.gpus
            leaf_demand[queue] += gpus
            if workload.state == PENDING:
                pending[queue].append(PendingJob(workload, queue, priority_class))
                if workload.preemptor is not None:
                    gave_way.append(workload.preemptor)
                continue
            on_nodes = tuple(
                (nodes.index[node], ranks * workload.gpus_per_rank)
                for node, ranks in workload.placement
            )
            for node, on_node in on_nodes:
                held[node] += on_node
            if workload.state == TERMINATING:
                # R11: a victim already on its way counts as capacity coming back.
                if workload.preemptor is not None:
                    freed_for.append((workload.preemptor, workload.id, on_nodes))
                else:
                    terminating.append((workload.id, on_nodes))
                continue
            leaf_usage[queue] += gpus
            if may_grow(workload, priority_class.shrink_elastic):
                self.growable.append((workload, queue, priority_class))
            if priority_class.preemptible:
                run = RunningWork(
                    workload,
                    queue,
                    priority_class,
                    on_nodes,
                    self.now,
                    self.minimums[priority_class.name],
                )
                candidates[queue].append(run)
                if may_shrink(run):
                    shrinkable.append(run)
            else:
                pinned_usage[queue] += gpus
        for jobs in pending:
            in_queue_order(jobs)
        self.pending = pending
        # The reasons name them in this order, whatever order the snapshot lists them
        # in: by id, shorter ids first, so that numbered jobs come in number order.
        # GPUs being released for a workload that still waits are kept for it until it
        # is planned (FlavorPlanner._claim_kept): had the next plan handed them to
        # whichever job came first, the job they were freed for would pick new victims
        # or wait on without any, and its victims would have lost their work for
        # another. Those freed for a workload that no longer waits come back to all.
        self.kept: dict[str, list[tuple[str, tuple[tuple[int, int], ...]]]] = {}
        # Built only when some victim names its preemptor: a plan has thousands waiting.
        waiting_ids = {job.workload.id for jobs in pending for job in jobs} if freed_for else set()
        for preemptor, victim, on_nodes in freed_for:
            if preemptor in waiting_ids:
                self.kept.setdefault(preemptor, []).append((victim, on_nodes))
            else:
                terminating.append((victim, on_nodes))
        for victims in self.kept.values():
            victims.sort(key=lambda entry: (len(entry[0]), entry[0]))
        # Pending workloads that gave way to one that still waits are planned after it
        # (FlavorPlanner._pass): the ids of the workloads some of them wait for.
        self.awaited: set[str] = set()
        # Those of the pass being run, not planned in it yet (FlavorPlanner._plan_in_turn).
        self.pass_awaited: set[str] = set()
        if gave_way:
            if not waiting_ids:
                waiting_ids = {job.workload.id for jobs in pending for job in jobs}
            self.awaited = {preemptor for preemptor in gave_way if preemptor in waiting_ids}
        terminating.sort(key=lambda entry: (len(entry[0]), entry[0]))
        nodes.occupy(held, terminating)
        # The free GPUs beside them that its placement counted on, as far as the nodes
        # of its victims hold them: without them, a job planned first could take one
        # and leave the victims' GPUs too few for the workload they were freed for.
        self.kept_free: dict[str, list[tuple[int, int]]] = {}
        if self.kept:
            sizes = {job.workload.id: job.gpus for jobs in pending for job in jobs}
            for preemptor, victims in self.kept.items():
                need = sizes[preemptor]
                victim_nodes: dict[int, None] = {}
                for _, on_nodes in victims:
                    for node, gpus in on_nodes:
                        need -= gpus
                        victim_nodes[node] = None
                for node in victim_nodes:
                    take = min(nodes.free[node], need)
                    if take > 0:
                        nodes.set_free(node, nodes.free[node] - take)
                        self.kept_free.setdefault(preemptor, []).append((node, take))
                        need -= take
        self.ledger = QuotaLedger(
            snapshot, tree, flavor, nodes.capacity, leaf_usage, leaf_demand, pinned_usage
        )
        self.victims = VictimCandidates(tree, self.ledger, candidates)
        shrinkable.sort(key=by_order)
        # In R9's order, cheapest first; a gang leaves the list's use once it is taken.
        self.shrinkable = shrinkable
        # Running elastic gangs resized in this plan, and per resize the (queue, GPUs)
        # it adds to its queue's usage (fewer when negative), for the plan's status.
        self.resize: list[Resize] = []
        self.resized_usage: list[tuple[int, int]] = []
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
        # The same for the searches for running elastic gangs to shrink.
        self.failed_shrinks: dict[tuple[int, str, int, int, bool], tuple[int, int]] = {}
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

    def _shrink(self, job: PendingJob, shrinks: list[Shrink], placement: Placement) -> None:
        """Make running elastic gangs give up ranks (``shrinks``) to ``job``, which waits
        for their GPUs on ``placement``. The shrinks' quota usage is already given up
        (``elastic.shrink_for``); a shrunk gang is neither shrunk again nor evicted in
        this plan."""
        self.changes += 1
        nodes = self.nodes
        workload = job.workload
        freed_by: list[str] = []
        for shrink in shrinks:
            run = shrink.run
            self.victims.take(run)
            gang = run.workload
            for node, ranks in shrink.freed.items():
                nodes.release(node, ranks * gang.gpus_per_rank, gang.id)
            self.resize.append(
                Resize(
                    gang.id,
                    shrink.ranks,
                    shrink.kept(nodes.names),
                    self._shrink_reason(shrink, job),
                    workload.id,
                )
            )
            self.resized_usage.append((run.queue, -shrink.gpus))
            freed_by.append(gang.id)
        self.unplaceable_on_releasing.clear()
        self.unplaceable_in_domain_releasing.clear()
        self._wait_on(job, placement, tuple(freed_by), shrunk=True)

    def _shrink_reason(self, shrink: Shrink, job: PendingJob) -> str:
        """Why a gang shrinks, in words: its sizes, the reason and the job it is for."""
        sizes = f"shrunk from {shrink.run.workload.ranks} to {shrink.ranks} ranks"
        team = self.tree.names[job.queue]
        job_id = job.workload.id
        if shrink.reason == RECLAIM:
            return f"{sizes} to reclaim team {team}'s guarantee for job {job_id}"
        if shrink.reason == PRIORITY:
            return f"{sizes} for job {job_id} of higher priority"
        if shrink.reason == FAIR_SHARE:
            return f"{sizes} for job {job_id}: team {team} is below its fair share"
        return f"{sizes} for job {job_id}"

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
            gpus_on_nodes = tuple(
                (node, ranks * workload.gpus_per_rank) for node, ranks in placement
            )
            self.victims.add(
                RunningWork(
                    workload,
                    queue,
                    job.priority_class,
                    gpus_on_nodes,
                    self.now,
                    self.minimums[job.priority_class.name],
                    planned=True,
                )
            )

    def _wait_on(
        self,
        job: PendingJob,
        placement: Placement,
        victims: tuple[str, ...] = (),
        shrunk: bool = False,
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
                f"waiting for {from_releasing} GPUs being released by {jobs_phrase(released_by)}"
            )
        elif victims:
            # The victims (or the gangs shrunk) free quota rather than GPUs on the
            # chosen nodes.
            leave = "shrink" if shrunk else "exit"
            reason = f"waiting for {jobs_phrase(list(victims))} to {leave} and return quota"
        else:
            reason = "waiting for its reserved GPUs"
        self.waits[workload.id] = Waiting(workload.id, reason)
        self.reserved.add(workload.id)

    def _domain_reason(self, job: PendingJob) -> str:
        workload = job.workload
        level = workload.topology_level
        if level not in self.nodes.domains:
            return f"no node of flavor {self.flavor} has a {level} in its topology"
        return (
            f"no {level} of flavor {self.flavor} has room for {workload.ranks} ranks of "
            f"{workload.gpus_per_rank} GPUs together"
        )

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
