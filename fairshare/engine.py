"""The planner: one call turns a snapshot into every decision the cluster needs now.

Flavors never share GPUs, so each flavor is planned on its own. For one flavor the
planner keeps, per queue, the GPUs its running and newly planned workloads take (the
quota view, where a terminating victim no longer counts) and, per node, the GPUs that are
free now and those on their way back from terminating victims (the physical view, where
a victim still holds its GPUs, R1). Pending workloads are taken one at a time from the
queue furthest below its fair share; each is admitted on free GPUs, or waits for GPUs
already being released (R11), or preempts the cheapest victims that let it fit (R3, R6-R10),
or waits with a reason.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from .model import (
    CONSOLIDATE,
    FAIR_SHARE,
    PENDING,
    PREEMPT_LOWER_PRIORITY,
    PRIORITY,
    RECLAIM,
    TERMINATING,
    WORKLOAD_STATES,
    Admission,
    FrozenMap,
    Plan,
    Preemption,
    PriorityClass,
    QueueStatus,
    ScenarioError,
    Snapshot,
    Waiting,
    Workload,
)
from .rules import (
    r1_capacity_free_gpus,
    r3_guarantee_overshoot,
    r4_lendable_idle,
    r5_may_use_borrowed,
    r6_may_reclaim,
    r7_may_preempt_by_priority,
    r8_may_preempt_for_fair_share,
    r8_water_fill,
    r9_lost_gpu_seconds,
    r9_victim_order,
    r10_place,
    r11_releasing_first,
)

_INF = float("inf")
# A failed preemption attempt examines at most this many candidate victims. It bounds a
# plan's time on a saturated cluster; a workload that needs more victims than that waits.
_MAX_CANDIDATES_PER_ATTEMPT = 128
# Node-clearing reclaim searches (see _reclaim_by_node) a plan may run: each is a
# pass over the running work of the queues above their guarantee.
_NODE_SEARCHES_PER_PLAN = 8
# Consolidation (see _consolidate): how many searches a plan may run (each a pass over
# the running work), and how long a job must have run before it may be moved, so that a
# job is never moved twice in quick succession.
_CONSOLIDATIONS_PER_PLAN = 8
# A fair-share move (R8) never takes a job that started less than this long ago: GPUs
# that came back were handed out by queue order a moment earlier, and taking them back
# at once would turn one cycle's admission into the next cycle's preemption.
_FAIR_SHARE_MIN_RUNTIME_SECONDS = 60.0
_CONSOLIDATE_MIN_RUNTIME_SECONDS = 600.0


@dataclass(slots=True)
class _Tree:
    """The queue tree as index arrays, shared by every flavor of one plan."""

    names: list[str]
    index: dict[str, int]
    parent: list[int]
    children: list[list[int]]
    weight: list[float]
    path: list[tuple[int, ...]]
    top: list[int]
    bottom_up: list[int]
    lca_rows: dict[int, list[tuple[tuple[int, ...], int, int] | None]]
    # Per queue: each queue on its path (itself first) -> position on that path.
    depth_on_path: list[dict[int, int]]

    def lca_row(self, q: int) -> list[tuple[tuple[int, ...], int, int] | None]:
        """The memo of ``lca_chains(q, r)`` for every ``r``, indexed by ``r``; None until asked.

        The victim scans look up one entry per queue for every preemption attempt, so a
        plain list per preemptor's queue keeps the lookup cheap.
        """
        row = self.lca_rows.get(q)
        if row is None:
            row = [None] * len(self.names)
            self.lca_rows[q] = row
        return row

    def lca_chains(self, q: int, r: int) -> tuple[tuple[int, ...], int, int]:
        """Queues on ``r``'s path strictly below the lowest common ancestor with ``q``.

        Also returns the two children of that ancestor (or the two top-level queues) on
        which ``q`` and ``r`` lie, where R8 compares shares.
        """
        row = self.lca_row(q)
        found = row[r]
        if found is None:
            found = self._lca_chains(q, r)
            row[r] = found
        return found

    def _lca_chains(self, q: int, r: int) -> tuple[tuple[int, ...], int, int]:
        q_path = self.path[q]
        on_q = self.depth_on_path[q]
        r_path = self.path[r]
        for j, x in enumerate(r_path):
            pos = on_q.get(x)
            if pos is not None:
                return r_path[:j], q_path[pos - 1], r_path[j - 1]
        return r_path, q_path[-1], r_path[-1]


def _build_tree(snapshot: Snapshot) -> _Tree:
    names: list[str] = []
    index: dict[str, int] = {}
    for i, queue in enumerate(snapshot.queues):
        if queue.name in index:
            raise ScenarioError(f"queues[{i}].name: duplicate queue {queue.name!r}")
        index[queue.name] = i
        names.append(queue.name)
        if not queue.weight > 0:
            raise ScenarioError(f"queues[{i}].weight: must be positive, got {queue.weight!r}")
    count = len(names)
    parent = [-1] * count
    children: list[list[int]] = [[] for _ in range(count)]
    for i, queue in enumerate(snapshot.queues):
        if queue.parent is not None:
            if queue.parent not in index:
                raise ScenarioError(f"queues[{i}].parent: unknown queue {queue.parent!r}")
            parent[i] = index[queue.parent]
            children[parent[i]].append(i)
    path: list[tuple[int, ...]] = []
    for i in range(count):
        chain = [i]
        while parent[chain[-1]] != -1:
            chain.append(parent[chain[-1]])
            if len(chain) > count:
                raise ScenarioError(f"queues[{i}].parent: the queue tree has a cycle")
        path.append(tuple(chain))
    bottom_up = sorted(range(count), key=lambda i: -len(path[i]))
    return _Tree(
        names=names,
        index=index,
        parent=parent,
        children=children,
        weight=[q.weight for q in snapshot.queues],
        path=path,
        top=[i for i in range(count) if parent[i] == -1],
        bottom_up=bottom_up,
        lca_rows={},
        depth_on_path=[{x: pos for pos, x in enumerate(chain)} for chain in path],
    )


class _Run:
    """A running workload as a candidate victim."""

    __slots__ = (
        "cls",
        "gpus",
        "key",
        "nodes",
        "planned",
        "queue",
        "runtime",
        "shield_epoch",
        "shielded",
        "victim",
        "workload",
    )

    def __init__(
        self,
        workload: Workload,
        queue: int,
        cls: PriorityClass,
        nodes: tuple[tuple[int, int], ...],
        now: float,
        planned: bool = False,
    ) -> None:
        self.workload = workload
        self.planned = planned
        self.queue = queue
        self.cls = cls
        self.gpus = workload.gpus
        self.nodes = nodes
        self.victim = False
        lost = r9_lost_gpu_seconds(
            self.gpus, now, workload.admitted_at, workload.last_checkpoint_at
        )
        self.key = r9_victim_order(cls.value, lost, workload.admitted_at, workload.id)
        # Seconds since admission; the snapshot's clock does not move during a plan.
        admitted = workload.admitted_at
        self.runtime = _INF if admitted is None else now - admitted
        # The answer of _FlavorPlanner._shielded and the queue's shield epoch it holds for.
        self.shield_epoch = -1
        self.shielded = False


@dataclass(slots=True)
class _Job:
    """A pending workload as the planner sees it."""

    workload: Workload
    queue: int
    cls: PriorityClass
    gpus: int


def _validate_workloads(
    snapshot: Snapshot,
    tree: _Tree,
    classes: Mapping[str, PriorityClass],
    node_flavor: Mapping[str, str],
    node_gpus: Mapping[str, int],
) -> None:
    seen: set[str] = set()
    for i, w in enumerate(snapshot.workloads):
        where = f"workloads[{i}]"
        if w.id in seen:
            raise ScenarioError(f"{where}.id: duplicate workload {w.id!r}")
        seen.add(w.id)
        q = tree.index.get(w.queue)
        if q is None:
            raise ScenarioError(f"{where}.queue: unknown queue {w.queue!r}")
        if tree.children[q]:
            raise ScenarioError(f"{where}.queue: {w.queue!r} is not a leaf queue")
        if w.priority_class not in classes:
            raise ScenarioError(
                f"{where}.priority_class: unknown priority class {w.priority_class!r}"
            )
        if w.state not in WORKLOAD_STATES:
            raise ScenarioError(f"{where}.state: must be one of {WORKLOAD_STATES}, got {w.state!r}")
        if w.ranks < 1:
            raise ScenarioError(f"{where}.ranks: must be at least 1, got {w.ranks}")
        if w.gpus_per_rank < 1:
            raise ScenarioError(f"{where}.gpus_per_rank: must be at least 1, got {w.gpus_per_rank}")
        if w.state == PENDING:
            continue
        placed = 0
        for node, ranks in w.placement:
            if node not in node_flavor:
                raise ScenarioError(f"{where}.placement: unknown node {node!r}")
            if node_flavor[node] != w.flavor:
                raise ScenarioError(
                    f"{where}.placement: node {node!r} is of flavor {node_flavor[node]!r},"
                    f" not {w.flavor!r}"
                )
            if ranks < 1 or ranks * w.gpus_per_rank > node_gpus[node]:
                raise ScenarioError(f"{where}.placement: {ranks} ranks do not fit on {node!r}")
            placed += ranks
        if placed != w.ranks:
            raise ScenarioError(
                f"{where}.placement: places {placed} ranks, the workload has {w.ranks}"
            )


def _jobs_phrase(ids: list[str]) -> str:
    unique = list(dict.fromkeys(ids))
    shown = ", ".join(unique[:3])
    more = f" and {len(unique) - 3} more" if len(unique) > 3 else ""
    return f"job {shown}" if len(unique) == 1 else f"jobs {shown}{more}"


class _FlavorPlanner:
    """Plans the pending workloads of one flavor."""

    def __init__(
        self,
        snapshot: Snapshot,
        tree: _Tree,
        classes: Mapping[str, PriorityClass],
        flavor: str,
        workloads: list[Workload],
    ) -> None:
        self.now = snapshot.now
        self.tree = tree
        self.flavor = flavor
        count = len(tree.names)

        # Nodes of this flavor.
        self.node_names: list[str] = [n.name for n in snapshot.nodes if n.flavor == flavor]
        self.node_gpus: list[int] = [n.gpus for n in snapshot.nodes if n.flavor == flavor]
        node_index = {name: i for i, name in enumerate(self.node_names)}
        self.node_index = node_index
        self.capacity = sum(self.node_gpus)
        self.max_node_gpus = max(self.node_gpus, default=0)
        held = [0] * len(self.node_names)
        self.releasing = [0] * len(self.node_names)
        self.releasing_by: list[list[str]] = [[] for _ in self.node_names]

        # Quotas, with each parent's guarantee at least the sum of its children's.
        quotas = [q.quota(flavor) for q in snapshot.queues]
        self.guarantee = [max(0, quota.guarantee) for quota in quotas]
        for q in tree.bottom_up:
            if tree.children[q]:
                self.guarantee[q] = max(
                    self.guarantee[q], sum(self.guarantee[c] for c in tree.children[q])
                )
        self.borrow_limit = [quota.borrow_limit for quota in quotas]
        # The queues on each path that have a borrow limit, bottom up: most have none.
        self.limited_path = [
            tuple(x for x in chain if self.borrow_limit[x] is not None) for chain in tree.path
        ]
        self.lend_limit = [quota.lend_limit for quota in quotas]
        self.reserve = [
            0 if lend is None else max(0, self.guarantee[q] - lend)
            for q, lend in enumerate(self.lend_limit)
        ]

        self.usage = [0] * count
        self.node_searches_left = _NODE_SEARCHES_PER_PLAN
        self.consolidations_left = _CONSOLIDATIONS_PER_PLAN
        # GPUs that jobs only waiting on reservations add to ``usage``: a queue
        # must not look above its guarantee line because of its own waiting work.
        self.waiting_usage = [0] * count
        self.pinned_usage = [0] * count
        self.demand = [0] * count
        self.candidates: list[list[_Run]] = [[] for _ in range(count)]
        self.head = [0] * count
        # Bumped whenever a queue gains a candidate or one of them becomes a victim.
        self.shield_epoch = [0] * count
        pending: list[list[_Job]] = [[] for _ in range(count)]
        self.held_running: list[list[_Run]] = []
        self.terminating: list[Workload] = []
        for w in workloads:
            q = tree.index[w.queue]
            cls = classes[w.priority_class]
            gpus = w.gpus
            self.demand[q] += gpus
            if w.state == PENDING:
                pending[q].append(_Job(w, q, cls, gpus))
                continue
            nodes = tuple(
                (node_index[node], ranks * w.gpus_per_rank) for node, ranks in w.placement
            )
            for n, g in nodes:
                held[n] += g
            if w.state == TERMINATING:
                # R11: a victim already on its way counts as capacity coming back.
                self.terminating.append(w)
                for n, g in nodes:
                    self.releasing[n] += g
                    self.releasing_by[n].append(w.id)
                continue
            self.usage[q] += gpus
            run = _Run(w, q, cls, nodes, self.now)
            if cls.preemptible:
                self.candidates[q].append(run)
            else:
                self.pinned_usage[q] += gpus
        for q in range(count):
            self.candidates[q].sort(key=lambda run: run.key)
            pending[q].sort(
                key=lambda job: (-job.cls.value, job.workload.submitted_at, job.workload.id)
            )
        self.pending = pending
        self.min_candidate_gpus = [
            min((run.gpus for run in runs), default=0) for runs in self.candidates
        ]

        # Aggregate usage and demand up the tree.
        for q in tree.bottom_up:
            p = tree.parent[q]
            if p != -1:
                self.usage[p] += self.usage[q]
                self.demand[p] += self.demand[q]

        # R1: free GPUs per node, indexed by how many are free for best-fit placement.
        self.free = [r1_capacity_free_gpus(self.node_gpus[n], held[n]) for n in range(len(held))]
        self.buckets: list[dict[int, None]] = [{} for _ in range(self.max_node_gpus + 1)]
        for n, free in enumerate(self.free):
            self.buckets[free][n] = None
        self.free_total = sum(self.free)
        self.releasing_nodes: dict[int, None] = {
            n: None for n, rel in enumerate(self.releasing) if rel > 0
        }

        # Lend limits withhold part of an idle guarantee; track it as occupancy.
        self.has_reserve = any(self.reserve)
        self.occupancy = [0] * count
        self.child_occupancy = [0] * count
        if self.has_reserve:
            for q in tree.bottom_up:
                own = self.usage[q] if not tree.children[q] else self.child_occupancy[q]
                self.occupancy[q] = max(own, self.reserve[q])
                p = tree.parent[q]
                if p != -1:
                    self.child_occupancy[p] += self.occupancy[q]
        self.total_occupancy = sum(self.occupancy[t] for t in tree.top)

        self.fair_share = self._fair_shares()
        leaves = [q for q in range(count) if not tree.children[q]]
        self.over_guarantee: dict[int, None] = {
            q: None for q in leaves if self.usage[q] > self.guarantee[q]
        }
        self.over_fair_share: dict[int, None] = {
            q: None for q in leaves if self.usage[q] > self.fair_share[q]
        }

        self.free_fail: dict[int, int] = {}
        self.release_fail: dict[int, int] = {}
        self.attempt_fail: dict[tuple[int, str, int, int, bool], tuple[int, int]] = {}
        self.generation = 0
        self.admitted: dict[str, tuple[int, int]] = {}
        self.admissions: dict[str, Admission] = {}
        self.waits: dict[str, Waiting] = {}
        self.claimed: set[str] = set()
        self.changed = False
        self.freed = False
        # Workloads that tried to preempt, with the generation of candidates they saw.
        self.tried: dict[str, int] = {}
        self.preempt: list[Preemption] = []
        self.job_by_id = {job.workload.id: job for jobs in pending for job in jobs}
        self.physical_reasons: dict[tuple[int, int], str] = {}

    # Fair shares (R4, R8) -------------------------------------------------------------

    def _fair_shares(self) -> list[float]:
        tree = self.tree
        count = len(tree.names)
        cap = [0.0] * count
        hold = [0.0] * count
        for q in tree.bottom_up:
            if tree.children[q]:
                wanted = float(sum(cap[c] for c in tree.children[q]))
            else:
                wanted = float(self.demand[q])
            limit = self.borrow_limit[q]
            if limit is not None:
                wanted = min(wanted, float(self.guarantee[q] + limit))
            cap[q] = wanted
            hold[q] = max(
                min(float(self.guarantee[q]), wanted),
                float(self.reserve[q]),
                float(sum(hold[c] for c in tree.children[q])),
            )
        shares = [0.0] * count

        def divide(amount: float, siblings: list[int]) -> None:
            if not siblings:
                return
            given = r8_water_fill(
                amount,
                [float(self.guarantee[s]) for s in siblings],
                [cap[s] for s in siblings],
                [hold[s] for s in siblings],
                [tree.weight[s] for s in siblings],
            )
            for s, share in zip(siblings, given, strict=True):
                shares[s] = share
                if tree.children[s]:
                    withheld = max(0.0, hold[s] - min(float(self.guarantee[s]), cap[s]))
                    divide(share + withheld, tree.children[s])

        divide(float(self.capacity), tree.top)
        return shares

    # Quota view ------------------------------------------------------------------------

    def _add_usage(self, q: int, delta: int) -> None:
        tree = self.tree
        after = self.usage[q] + delta
        # Keep the indexes of leaf queues that could lose GPUs to others current.
        if after > self.guarantee[q]:
            self.over_guarantee[q] = None
        else:
            self.over_guarantee.pop(q, None)
        if after > self.fair_share[q]:
            self.over_fair_share[q] = None
        else:
            self.over_fair_share.pop(q, None)
        if not self.has_reserve:
            for x in tree.path[q]:
                self.usage[x] += delta
            return
        change = delta
        for x in tree.path[q]:
            self.usage[x] += delta
            if tree.children[x]:
                self.child_occupancy[x] += change
                new = max(self.child_occupancy[x], self.reserve[x])
            else:
                new = max(self.usage[x], self.reserve[x])
            change = new - self.occupancy[x]
            self.occupancy[x] = new
        self.total_occupancy += change

    def _quota_reason(self, q: int, gpus: int, cls: PriorityClass) -> str | None:
        """Why ``gpus`` more GPUs for queue ``q`` break a quota rule, or None when they do not."""
        tree = self.tree
        usage = self.usage
        # Borrowed GPUs are counted against the queue's preemptible work first, so a
        # non-preemptible workload needs room beside the queue's other non-preemptible ones.
        pinned = self.pinned_usage[q]
        if not r5_may_use_borrowed(cls, pinned + gpus - self.guarantee[q]):
            return (
                "non-preemptible work cannot run on borrowed GPUs: "
                f"team {tree.names[q]} has {max(0, self.guarantee[q] - pinned)} "
                f"of its {self.guarantee[q]} guaranteed {self.flavor} GPUs free of "
                "non-preemptible work"
            )
        for x in self.limited_path[q]:
            limit = self.borrow_limit[x]
            if limit is not None and usage[x] + gpus - self.guarantee[x] > limit:
                return f"team {tree.names[x]} at its borrow limit of {limit} {self.flavor} GPUs"
        if self.has_reserve:
            change = gpus
            for x in tree.path[q]:
                if tree.children[x]:
                    new = max(self.child_occupancy[x] + change, self.reserve[x])
                else:
                    new = max(usage[x] + gpus, self.reserve[x])
                change = new - self.occupancy[x]
            if self.total_occupancy + change > self.capacity:
                return f"the idle {self.flavor} GPUs are held back by other teams' lend limits"
        return None

    # Physical view ---------------------------------------------------------------------

    def _set_free(self, n: int, value: int) -> None:
        old = self.free[n]
        del self.buckets[old][n]
        self.buckets[value][n] = None
        self.free[n] = value
        self.free_total += value - old

    def _place_free(self, ranks: int, gpr: int) -> list[tuple[int, int]] | None:
        """R10 on free GPUs only: best fit for a gang that fits one node, else largest first."""
        if ranks * gpr > self.free_total or gpr > self.max_node_gpus:
            return None
        failed = self.free_fail.get(gpr)
        if failed is not None and ranks >= failed:
            return None
        buckets = self.buckets
        top = self.max_node_gpus
        taken: list[tuple[int, int, int]] = []
        remaining = ranks
        placement: list[tuple[int, int]] | None = None
        while True:
            need = remaining * gpr
            chosen = -1
            for k in range(need, top + 1):
                if buckets[k]:
                    chosen = next(iter(buckets[k]))
                    break
            if chosen >= 0:
                taken_nodes = [(n, r) for n, r, _ in taken]
                placement = [*taken_nodes, (chosen, remaining)]
                break
            largest = -1
            for k in range(top, gpr - 1, -1):
                if buckets[k]:
                    largest = k
                    break
            if largest < 0:
                break
            node = next(iter(buckets[largest]))
            del buckets[largest][node]
            fit = largest // gpr
            taken.append((node, fit, largest))
            remaining -= fit
        for node, _, k in taken:
            buckets[k][node] = None
        if placement is None:
            self.free_fail[gpr] = min(ranks, self.free_fail.get(gpr, ranks))
        return placement

    def _hostable_ranks(self, gpr: int) -> int:
        """R2: ranks of ``gpr`` GPUs that free plus releasing GPUs could host."""
        total = 0
        for k in range(gpr, self.max_node_gpus + 1):
            if self.buckets[k]:
                total += len(self.buckets[k]) * (k // gpr)
        for n in self.releasing_nodes:
            total += (self.free[n] + self.releasing[n]) // gpr - self.free[n] // gpr
        return total

    def _place_on(
        self, ranks: int, gpr: int, potential: Mapping[int, int]
    ) -> list[tuple[int, int]] | None:
        """R10 on free GPUs plus ``potential`` (node -> GPUs once releases and victims are done)."""
        available: dict[str, int] = {}
        names = self.node_names
        for n, room in potential.items():
            if room >= gpr:
                available[names[n]] = room
        for n in self.releasing_nodes:
            if n not in potential:
                room = self.free[n] + self.releasing[n]
                if room >= gpr:
                    available[names[n]] = room
        # Untouched nodes with free GPUs, largest first, until the gang surely fits.
        enough = sum(room // gpr for room in available.values())
        for k in range(self.max_node_gpus, gpr - 1, -1):
            if enough >= ranks and k < ranks * gpr:
                break
            for n in self.buckets[k]:
                if names[n] not in available:
                    available[names[n]] = k
                    enough += k // gpr
        placed = r10_place(ranks, gpr, available)
        if placed is None:
            return None
        return [(self.node_index[name], r) for name, r in placed]

    def _claim(self, placement: list[tuple[int, int]], gpr: int) -> tuple[int, list[str]]:
        """Reserve a placement for a waiting preemptor: free GPUs first, then releasing ones."""
        from_releasing = 0
        released_by: list[str] = []
        for n, ranks in placement:
            need = ranks * gpr
            from_free = min(self.free[n], need)
            if from_free:
                self._set_free(n, self.free[n] - from_free)
            rest = r11_releasing_first(self.releasing[n], need - from_free)
            if rest:
                self.releasing[n] -= rest
                from_releasing += rest
                released_by.extend(self.releasing_by[n])
                if self.releasing[n] == 0:
                    self.releasing_nodes.pop(n, None)
        return from_releasing, released_by

    # Candidate victims ----------------------------------------------------------------

    @staticmethod
    def _next_candidate(runs: list[_Run], i: int) -> int:
        """The index of the first of ``runs`` from ``i`` on that is not a victim yet."""
        end = len(runs)
        while i < end and runs[i].victim:
            i += 1
        return i

    def _first_candidate(self, q: int) -> int:
        """Move queue ``q``'s head past the candidates already taken as victims."""
        head = self._next_candidate(self.candidates[q], self.head[q])
        self.head[q] = head
        return head

    def _shielded(self, run: _Run) -> bool:
        """Whether taking ``run`` would only move the loss onto its own queue's lower work.

        Once requeued, ``run`` would preempt a lower-priority job of its own queue by R7 in
        the next cycle, so the plan would not be stable; that lower job is the victim to
        take instead (it comes earlier in the order, unless a rule protects it).
        """
        if run.cls.preemption_policy != PREEMPT_LOWER_PRIORITY:
            return False
        # The answer depends on the queue's candidates and which of them are victims; it
        # holds until either changes (the queue's shield epoch moves on).
        epoch = self.shield_epoch[run.queue]
        if run.shield_epoch == epoch:
            return run.shielded
        run.shield_epoch = epoch
        run.shielded = self._lower_work_to_take(run)
        return run.shielded

    def _lower_work_to_take(self, run: _Run) -> bool:
        runs = self.candidates[run.queue]
        for i in range(self.head[run.queue], len(runs)):
            lower = runs[i]
            if lower.cls.value >= run.cls.value:
                return False
            if (
                not lower.victim
                and lower.gpus >= run.gpus
                and r7_may_preempt_by_priority(run.cls, lower.cls, lower.runtime)
            ):
                return True
        return False

    def _reclaim_candidates(self, q: int) -> Iterator[tuple[_Run, str]]:
        """R6 with R3: running work of queues above their guarantee, cheapest first.

        A victim that would take its queue (or an ancestor below the common ancestor)
        below the guarantee line straddles it; straddlers are used last, the smallest
        overshoot first.
        """
        tree = self.tree
        usage = self.usage
        guarantee = self.guarantee
        candidates = self.candidates
        row = tree.lca_row(q)
        heap: list[tuple[tuple[int, float, float, str], int, int]] = []
        chains: dict[int, tuple[int, ...]] = {}
        waiting = self.waiting_usage
        for r in list(self.over_guarantee):
            runs = candidates[r]
            if r == q or not runs or usage[r] - waiting[r] <= guarantee[r]:
                continue
            found = row[r]
            if found is None:
                found = tree.lca_chains(q, r)
            chain = found[0]
            for x in chain:
                if usage[x] - waiting[x] <= guarantee[x]:
                    break
            else:
                chains[r] = chain
                i = self._first_candidate(r)
                if i < len(runs):
                    heap.append((runs[i].key, r, i))
        heapq.heapify(heap)
        straddlers: list[tuple[int, tuple[int, float, float, str], _Run]] = []
        while heap:
            _, r, i = heapq.heappop(heap)
            runs = candidates[r]
            run = runs[i]
            chain = chains[r]
            overshoot = 0
            eligible = True
            victim_gpus = run.gpus
            for x in chain:
                over = r3_guarantee_overshoot(usage[x] - waiting[x], guarantee[x], victim_gpus)
                if over is None:
                    eligible = False
                    break
                overshoot = max(overshoot, over)
            if not eligible:
                continue
            nxt = self._next_candidate(runs, i + 1)
            if nxt < len(runs):
                heapq.heappush(heap, (runs[nxt].key, r, nxt))
            if run.victim or self._shielded(run):
                continue
            if overshoot:
                straddlers.append((overshoot, run.key, run))
                continue
            yield run, RECLAIM
        straddlers.sort(key=lambda item: (item[0], item[1]))
        for _, _, run in straddlers:
            if run.victim:
                continue
            if all(
                r3_guarantee_overshoot(usage[x], guarantee[x], run.gpus) is not None
                for x in chains[run.queue]
            ):
                yield run, RECLAIM

    def _priority_candidates(self, job: _Job) -> Iterator[tuple[_Run, str]]:
        """R7: lower-priority preemptible work of the same queue, lowest priority first.

        When the preemptor's queue ends within its guarantee, borrowed GPUs of other
        queues may complete the set (R6).
        """
        q = job.queue
        runs = self.candidates[q]
        for i in range(self.head[q], len(runs)):
            run = runs[i]
            if run.cls.value >= job.cls.value:
                break
            if run.victim or not r7_may_preempt_by_priority(job.cls, run.cls, run.runtime):
                continue
            yield run, PRIORITY
        if r6_may_reclaim(self.usage[q], job.gpus, self.guarantee[q]):
            yield from self._reclaim_candidates(q)

    def _fair_share_candidates(self, job: _Job) -> Iterator[tuple[_Run, str]]:
        """R8: work of queues above their fair share that may give GPUs without flapping."""
        q = job.queue
        tree = self.tree
        usage = self.usage
        fair = self.fair_share
        gpus = job.gpus
        candidates = self.candidates
        min_candidate_gpus = self.min_candidate_gpus
        row = tree.lca_row(q)
        heap: list[tuple[tuple[int, float, float, str], int, int]] = []
        chains: dict[int, tuple[tuple[int, ...], int, int]] = {}
        for r in list(self.over_fair_share):
            runs = candidates[r]
            smallest = min_candidate_gpus[r]
            if r == q or not runs or usage[r] - smallest < fair[r]:
                continue
            found = row[r]
            if found is None:
                found = tree.lca_chains(q, r)
            chain, side_q, side_r = found
            if side_q == side_r:
                continue
            # Both tests of R8 only get harder for a larger victim: when the queue's
            # smallest candidate fails them, every candidate of the queue does.
            for x in chain:
                if usage[x] - smallest < fair[x] - 1e-9:
                    break
            else:
                if not r8_may_preempt_for_fair_share(
                    usage[side_q], fair[side_q], gpus, usage[side_r], fair[side_r], smallest
                ):
                    continue
                chains[r] = found
                i = self._first_candidate(r)
                if i < len(runs):
                    heap.append((runs[i].key, r, i))
        heapq.heapify(heap)
        while heap:
            _, r, i = heapq.heappop(heap)
            runs = candidates[r]
            run = runs[i]
            nxt = self._next_candidate(runs, i + 1)
            if nxt < len(runs):
                heapq.heappush(heap, (runs[nxt].key, r, nxt))
            if run.victim or run.runtime < max(
                run.cls.min_runtime_seconds, _FAIR_SHARE_MIN_RUNTIME_SECONDS
            ):
                continue
            chain, side_q, side_r = chains[r]
            if self._shielded(run):
                continue
            victim_gpus = run.gpus
            for x in chain:
                if usage[x] - victim_gpus < fair[x] - 1e-9:
                    break
            else:
                if r8_may_preempt_for_fair_share(
                    usage[side_q], fair[side_q], gpus, usage[side_r], fair[side_r], victim_gpus
                ):
                    yield run, FAIR_SHARE

    # Preemption (R9, R10) --------------------------------------------------------------

    def _preempt_for(
        self, job: _Job, candidates: Iterator[tuple[_Run, str]]
    ) -> tuple[list[tuple[_Run, str]], list[tuple[int, int]]] | None:
        """Pick the cheapest victims that let ``job`` fit on real nodes within its quotas.

        Victims are added cheapest first until the gang fits (counting free and releasing
        GPUs first, R11); then every victim whose return still lets it fit is dropped,
        most expensive first (R9); victims on nodes the placement does not use free
        nothing and are dropped too (R10). On success the victims' quota usage stays
        removed; on failure every tentative change is undone.
        """
        w = job.workload
        gpr = w.gpus_per_rank
        ranks = w.ranks
        gpus = w.gpus
        q = job.queue
        hostable = self._hostable_ranks(gpr)
        potential: dict[int, int] = {}
        chosen: list[tuple[_Run, str]] = []

        free = self.free
        releasing = self.releasing
        add_usage = self._add_usage

        def shift(run: _Run, sign: int) -> int:
            # A node's room: what an earlier shift left there, else free plus releasing.
            change = 0
            for n, g in run.nodes:
                old = potential.get(n)
                if old is None:
                    old = free[n] + releasing[n]
                new = old + sign * g
                potential[n] = new
                change += new // gpr - old // gpr
            add_usage(run.queue, -sign * run.gpus)
            return change

        fits = False
        for examined, (run, reason) in enumerate(candidates, start=1):
            if examined > _MAX_CANDIDATES_PER_ATTEMPT:
                break
            hostable += shift(run, +1)
            chosen.append((run, reason))
            if hostable >= ranks and self._quota_reason(q, gpus, job.cls) is None:
                fits = True
                break
        if not fits:
            # The node tallies in ``potential`` die with this attempt; only the quota
            # usage has to be given back.
            for run, _ in reversed(chosen):
                self._add_usage(run.queue, run.gpus)
            return None
        for i in range(len(chosen) - 1, -1, -1):
            run = chosen[i][0]
            change = shift(run, -1)
            if hostable + change >= ranks and self._quota_reason(q, gpus, job.cls) is None:
                hostable += change
                chosen.pop(i)
            else:
                shift(run, +1)
        placement = self._place_on(ranks, gpr, potential)
        if placement is None:
            for run, _ in reversed(chosen):
                self._add_usage(run.queue, run.gpus)
            return None
        # A victim on nodes the placement does not use frees nothing there; it stays only
        # when the quotas need its GPUs back (R10).
        used = {n for n, _ in placement}
        kept: list[tuple[_Run, str]] = []
        for run, reason in reversed(chosen):
            if not any(n in used for n, _ in run.nodes):
                self._add_usage(run.queue, run.gpus)
                if self._quota_reason(q, gpus, job.cls) is None:
                    continue
                self._add_usage(run.queue, -run.gpus)
            kept.append((run, reason))
        kept.reverse()
        if self._quota_reason(q, gpus, job.cls) is not None or not kept:
            for run, _ in kept:
                self._add_usage(run.queue, run.gpus)
            return None
        return kept, placement

    def _room_on(
        self, n: int, runs: list[_Run], gpr: int, ranks: int, usable: Callable[[_Run], bool]
    ) -> tuple[list[_Run], int] | None:
        """The cheapest of ``runs`` (all on node ``n``) whose exit gives ``n`` room for as
        many ranks of ``gpr`` GPUs as it can hold (``ranks`` at most), and the ranks that
        adds; None when the node has that room already or cannot gain any."""
        room = self.free[n] + self.releasing[n]
        before = room // gpr
        most = min(ranks, self.node_gpus[n] // gpr)
        if before >= most:
            return None
        runs.sort(key=lambda run: run.key)
        taken: list[_Run] = []
        for run in runs:
            if not usable(run):
                continue
            taken.append(run)
            room += sum(g for m, g in run.nodes if m == n)
            if room // gpr >= most:
                break
        gained = room // gpr - before
        return (taken, gained) if gained > 0 else None

    def _reclaim_by_node(
        self, job: _Job
    ) -> tuple[list[tuple[_Run, str]], list[tuple[int, int]]] | None:
        """R6 with R10 when the cheapest victims are scattered: clear nodes, not GPUs.

        Cheap victims spread over many nodes can use up the donors' GPUs above their
        guarantee lines before any node has room for a rank. Here each node offers the
        cheapest reclaimable work on it that makes room for ranks of the gang; nodes
        are taken cheapest per rank first, each only while its victims keep their
        queues on or above the line as R3 asks, until the gang fits. The victims then
        go through the trimming and placement of every other search.
        """
        q = job.queue
        gpr = job.workload.gpus_per_rank
        ranks = job.workload.ranks
        tree = self.tree
        usage = self.usage
        waiting = self.waiting_usage
        guarantee = self.guarantee
        row = tree.lca_row(q)
        chains: dict[int, tuple[int, ...]] = {}
        on_node: dict[int, list[_Run]] = defaultdict(list)
        for r in self.over_guarantee:
            if r == q or usage[r] - waiting[r] <= guarantee[r]:
                continue
            found = row[r]
            chain = (found if found is not None else tree.lca_chains(q, r))[0]
            if any(usage[x] - waiting[x] <= guarantee[x] for x in chain):
                continue
            chains[r] = chain
            runs = self.candidates[r]
            for i in range(self.head[r], len(runs)):
                run = runs[i]
                if not run.victim:
                    for n, _ in run.nodes:
                        on_node[n].append(run)

        offers: list[tuple[tuple[float, float, float, int], list[_Run], int]] = []
        for n, runs in on_node.items():
            offer = self._room_on(n, runs, gpr, ranks, lambda run: not self._shielded(run))
            if offer is None:
                continue
            taken, gained = offer
            cost = (
                float(max(run.key[0] for run in taken)),
                sum(run.key[1] for run in taken) / gained,
                sum(run.gpus for run in taken) / gained,
                n,
            )
            offers.append((cost, taken, gained))
        offers.sort(key=lambda offer: offer[0])

        hostable = self._hostable_ranks(gpr)
        taken_from: dict[int, int] = defaultdict(int)
        chosen: dict[int, _Run] = {}
        for _, runs, gained in offers:
            new = [run for run in runs if id(run) not in chosen]
            extra: dict[int, int] = defaultdict(int)
            eligible = True
            for run in new:
                for x in chains[run.queue]:
                    left = usage[x] - waiting[x] - taken_from[x] - extra[x]
                    if r3_guarantee_overshoot(left, guarantee[x], run.gpus) is None:
                        eligible = False
                        break
                    extra[x] += run.gpus
                if not eligible:
                    break
            if not eligible:
                continue
            for x, g in extra.items():
                taken_from[x] += g
            for run in new:
                chosen[id(run)] = run
            hostable += gained
            if hostable >= ranks:
                return self._preempt_for(job, ((run, RECLAIM) for run in chosen.values()))
        return None

    def _consolidate(
        self, job: _Job
    ) -> tuple[list[tuple[_Run, str]], list[tuple[int, int]], list[tuple[int, int]]] | None:
        """R10 when free GPUs are scattered: move small jobs so that ``job`` fits.

        Only for a gang inside its queue's guarantee, and only while enough GPUs are
        free in total. A job may move when it is preemptible, sits on one node, is
        smaller than one rank of the gang and has run long enough; it is requeued and
        restarts at once on GPUs free elsewhere (its "hole", kept for it in this plan),
        so its queue loses only the restart. Nodes are cleared fewest moved GPUs per
        rank first. Returns the victims, the gang's placement and the holes, or None.
        """
        w = job.workload
        gpr = w.gpus_per_rank
        ranks = w.ranks
        free = self.free
        releasing = self.releasing
        movable: dict[int, list[_Run]] = defaultdict(list)
        for runs in self.candidates:
            for run in runs:
                if (
                    run.victim
                    or run.planned
                    or len(run.nodes) != 1
                    or run.gpus >= gpr
                    or run.runtime
                    < max(_CONSOLIDATE_MIN_RUNTIME_SECONDS, run.cls.min_runtime_seconds)
                ):
                    continue
                movable[run.nodes[0][0]].append(run)
        offers: list[tuple[tuple[float, float, int], list[_Run], int, int]] = []
        for n, runs in movable.items():
            offer = self._room_on(n, runs, gpr, ranks, lambda run: True)
            if offer is None:
                continue
            taken, gained = offer
            moved = sum(run.gpus for run in taken)
            offers.append(
                ((moved / gained, sum(run.key[1] for run in taken) / gained, n), taken, gained, n)
            )
        if not offers:
            return None
        offers.sort(key=lambda offer: offer[0])

        # The free GPUs the moved jobs may restart on: nodes with free GPUs, by node.
        spare = {n: g for n, g in enumerate(free) if g > 0}
        hostable = self._hostable_ranks(gpr)
        cleared: set[int] = set()
        victims: list[_Run] = []
        hole_of: dict[int, tuple[int, int]] = {}
        hosting: set[int] = set()
        for _, runs, gained, n in offers:
            if n in hosting:
                # Moved jobs restart there: it cannot be cleared as well.
                continue
            filled: dict[int, int] = {}
            found: dict[int, tuple[int, int]] = {}
            for run in sorted(runs, key=lambda run: -run.gpus):
                best = min(
                    (m for m, g in spare.items() if m != n and g - filled.get(m, 0) >= run.gpus),
                    key=lambda m: (spare[m] - filled.get(m, 0), m),
                    default=None,
                )
                if best is None:
                    break
                filled[best] = filled.get(best, 0) + run.gpus
                found[id(run)] = (best, run.gpus)
            if len(found) < len(runs):
                continue
            for m, g in filled.items():
                spare[m] -= g
            spare.pop(n, None)
            hosting.update(filled)
            cleared.add(n)
            victims.extend(runs)
            hole_of.update(found)
            hostable += gained
            if hostable >= ranks:
                break
        if hostable < ranks:
            return None
        potential = {
            n: free[n] + releasing[n] + sum(run.gpus for run in victims if run.nodes[0][0] == n)
            for n in cleared
        }
        placement = self._place_on(ranks, gpr, potential)
        if placement is None:
            return None
        used = {n for n, _ in placement}
        # Jobs on a cleared node the placement does not use stay where they are.
        kept = [run for run in victims if run.nodes[0][0] in used]
        if not kept:
            return None
        holes = [hole_of[id(run)] for run in kept]
        return [(run, CONSOLIDATE) for run in kept], placement, holes

    # The cycle -------------------------------------------------------------------------

    def run(self) -> None:
        """Plan every pending workload of this flavor.

        Decisions land in ``admissions``, ``waits`` and ``preempt``. A pass that admitted
        work (new candidate victims) or withdrew an admission (free GPUs) changed what the
        workloads planned before could do, so those still waiting get up to three more
        passes.
        """
        self._pass(self.pending)
        for _ in range(3):
            if not self.changed:
                break
            self.changed = False
            retry: list[list[_Job]] = [[] for _ in self.pending]
            everyone = self.freed
            self.freed = False
            for workload_id in self.waits:
                tried_at = self.tried.get(workload_id)
                if workload_id not in self.claimed and (
                    everyone or (tried_at is not None and tried_at != self.generation)
                ):
                    job = self.job_by_id[workload_id]
                    retry[job.queue].append(job)
            for jobs in retry:
                jobs.sort(
                    key=lambda job: (-job.cls.value, job.workload.submitted_at, job.workload.id)
                )
            self._pass(retry)

    def _pass(self, pending: list[list[_Job]]) -> None:
        heap: list[tuple[bool, float, float, str, int]] = []
        position = [0] * len(pending)
        for q, jobs in enumerate(pending):
            if jobs:
                heap.append(self._queue_key(q, jobs[0]))
        heapq.heapify(heap)
        heappop = heapq.heappop
        heappush = heapq.heappush
        usage = self.usage
        guarantee = self.guarantee
        fair_share = self.fair_share
        names = self.tree.names
        plan_job = self._plan_job
        preempt = self.preempt
        while heap:
            q = heappop(heap)[4]
            jobs = pending[q]
            at = position[q]
            plan_job(jobs[at], preempt)
            at += 1
            position[q] = at
            if at < len(jobs):
                # The key of _queue_key, spelled out: this loop runs once per workload.
                head = jobs[at]
                used = usage[q]
                heappush(
                    heap,
                    (
                        used + head.gpus > guarantee[q],
                        used - fair_share[q],
                        head.workload.submitted_at,
                        names[q],
                        q,
                    ),
                )

    def _queue_key(self, q: int, head: _Job) -> tuple[bool, float, float, str, int]:
        # Work that fits inside its queue's guarantee goes before any borrowing: otherwise
        # a borrower would take GPUs that the guarantee reclaims in the next cycle. Then
        # the queue furthest below its fair share goes first; ties by older submission.
        usage = self.usage[q]
        return (
            usage + head.gpus > self.guarantee[q],
            usage - self.fair_share[q],
            head.workload.submitted_at,
            self.tree.names[q],
            q,
        )

    def _plan_job(self, job: _Job, preempt: list[Preemption]) -> None:
        w = job.workload
        q = job.queue
        gpus = job.gpus
        gpr = w.gpus_per_rank
        ranks = w.ranks
        cls = job.cls
        quota_reason = self._quota_reason(q, gpus, cls)
        if quota_reason is None:
            # The cheap tests of _place_free first: on a full cluster most jobs stop here.
            failed = self.free_fail.get(gpr)
            if (
                gpus <= self.free_total
                and gpr <= self.max_node_gpus
                and (failed is None or ranks < failed)
            ):
                placement = self._place_free(ranks, gpr)
                if placement is not None:
                    self._admit(job, placement)
                    return
            if self.releasing_nodes:
                failed = self.release_fail.get(gpr)
                if failed is None or ranks < failed:
                    if self._hostable_ranks(gpr) >= ranks:
                        placement = self._place_on(ranks, gpr, {})
                        if placement is not None:
                            self._wait_on(job, placement)
                            return
                    self.release_fail[gpr] = min(ranks, failed if failed is not None else ranks)
        modes = self._modes(job)
        if modes:
            self.tried[w.id] = self.generation
        attempt_fail = self.attempt_fail
        for mode in modes:
            # Reclaim and fair-share moves do not depend on the preemptor's priority.
            value = cls.value if mode == PRIORITY else 0
            key = (q, mode, gpr, value, cls.preemptible)
            cached = attempt_fail.get(key)
            if cached is not None and cached[1] == self.generation and ranks >= cached[0]:
                continue
            if mode == RECLAIM:
                candidates = self._reclaim_candidates(q)
            elif mode == PRIORITY:
                candidates = self._priority_candidates(job)
            else:
                candidates = self._fair_share_candidates(job)
            result = self._preempt_for(job, candidates)
            if result is None and mode == RECLAIM and self.node_searches_left > 0:
                # Cheap victims scattered over many nodes can use up the donors'
                # budget above their guarantee lines before any node frees enough;
                # clearing whole nodes finds the victims that do make room. It
                # costs a pass over the running work, so a plan does it a few times.
                self.node_searches_left -= 1
                result = self._reclaim_by_node(job)
            if result is None:
                self.attempt_fail[key] = (ranks, self.generation)
                continue
            victims, placement = result
            self._take(job, victims, placement, preempt)
            return
        if (
            quota_reason is None
            and self.consolidations_left > 0
            and gpus <= self.free_total
            and all(self.usage[x] + gpus <= self.guarantee[x] for x in self.tree.path[q])
        ):
            # Enough GPUs are free, just not together, and the gang fits inside its
            # guarantee: move small jobs off a few nodes to the free GPUs elsewhere.
            self.consolidations_left -= 1
            moved = self._consolidate(job)
            if moved is not None:
                victims, placement, holes = moved
                for n, g in holes:
                    # Kept for the moved jobs: nothing else in this plan takes them.
                    self._set_free(n, self.free[n] - g)
                self.free_fail.clear()
                self._take(job, victims, placement, preempt)
                return
        if quota_reason is None:
            # The sentence depends on the gang's shape only; many jobs share a shape.
            shape = (ranks, gpr)
            quota_reason = self.physical_reasons.get(shape)
            if quota_reason is None:
                quota_reason = self._physical_reason(ranks, gpr)
                self.physical_reasons[shape] = quota_reason
        waits = self.waits
        known = waits.get(w.id)
        if known is None or known.reason != quota_reason:
            waits[w.id] = Waiting(w.id, quota_reason)

    def _take(
        self,
        job: _Job,
        victims: list[tuple[_Run, str]],
        placement: list[tuple[int, int]],
        preempt: list[Preemption],
    ) -> None:
        """Make ``victims`` give way to ``job``, which starts or waits on ``placement``."""
        w = job.workload
        gpr = w.gpus_per_rank
        running_victims = False
        for run, reason in victims:
            run.victim = True
            self.shield_epoch[run.queue] += 1
            if run.planned:
                # Admitted earlier in this same plan: it never starts, and its GPUs
                # are free at once rather than after a grace window.
                del self.admitted[run.workload.id]
                del self.admissions[run.workload.id]
                if not run.cls.preemptible:
                    self.pinned_usage[run.queue] -= run.gpus
                for n, g in run.nodes:
                    self._set_free(n, self.free[n] + g)
                self.free_fail.clear()
                self.changed = True
                self.freed = True
                self.waits[run.workload.id] = Waiting(
                    run.workload.id, f"gives way to job {w.id} ({reason})"
                )
                continue
            running_victims = True
            preempt.append(Preemption(run.workload.id, reason, w.id, run.cls.grace_seconds))
            for n, g in run.nodes:
                self.releasing[n] += g
                self.releasing_by[n].append(run.workload.id)
                self.releasing_nodes[n] = None
        self.release_fail.clear()
        if not running_victims and all(self.free[n] >= r * gpr for n, r in placement):
            self._admit(job, placement)
        else:
            self._wait_on(job, placement, tuple(run.workload.id for run, _ in victims))

    def _admit(self, job: _Job, placement: list[tuple[int, int]]) -> None:
        """Start ``job`` on ``placement`` now; it becomes a candidate victim for later jobs.

        A later job of this same plan may still take it back (R6-R8); the plan then
        withdraws the admission instead of preempting, so the final plan is one that
        the next cycle would not undo.
        """
        w = job.workload
        q = job.queue
        gpus = w.gpus
        borrowed = 0
        if job.cls.preemptible:
            borrowed = max(0, self.usage[q] + gpus - self.guarantee[q]) - max(
                0, self.usage[q] - self.guarantee[q]
            )
        else:
            self.pinned_usage[q] += gpus
        self._claim(placement, w.gpus_per_rank)
        self._add_usage(q, gpus)
        self.admitted[w.id] = (q, gpus)
        names = tuple((self.node_names[n], r) for n, r in placement)
        self.admissions[w.id] = Admission(w.id, names, borrowed)
        self.waits.pop(w.id, None)
        if job.cls.preemptible:
            # A new candidate victim can make a failed attempt succeed: forget cached
            # failures, and give the workloads that already wait another pass.
            if self.usage[q] > min(self.guarantee[q], self.fair_share[q]):
                self.generation += 1
                self.changed = True
            started = dataclasses.replace(w, state="running", placement=names, admitted_at=self.now)
            nodes = tuple((n, r * w.gpus_per_rank) for n, r in placement)
            run = _Run(started, q, job.cls, nodes, self.now, planned=True)
            runs = self.candidates[q]
            if not runs:
                self.min_candidate_gpus[q] = gpus
            else:
                self.min_candidate_gpus[q] = min(self.min_candidate_gpus[q], gpus)
            at = bisect.bisect_left([r.key for r in runs], run.key) if runs else 0
            runs.insert(at, run)
            self.shield_epoch[q] += 1
            if at < self.head[q]:
                self.head[q] = at

    def _modes(self, job: _Job) -> list[str]:
        """The kinds of preemption that could let ``job`` in: reclaim, priority, fair share."""
        q = job.queue
        gpus = job.gpus
        modes: list[str] = []
        # Victims of other queues never lower this queue's own borrowing, so a
        # non-preemptible job beyond its guarantee can only gain from priority (R5).
        within_guarantee = self.pinned_usage[q] + gpus <= self.guarantee[q]
        if r6_may_reclaim(self.usage[q], gpus, self.guarantee[q]):
            modes.append(RECLAIM)
        runs = self.candidates[q]
        head = self._first_candidate(q)
        if (
            job.cls.preemption_policy == PREEMPT_LOWER_PRIORITY
            and head < len(runs)
            and runs[head].cls.value < job.cls.value
        ):
            modes.append(PRIORITY)
        if self.usage[q] < self.fair_share[q] and (job.cls.preemptible or within_guarantee):
            modes.append(FAIR_SHARE)
        return modes

    def _wait_on(
        self, job: _Job, placement: list[tuple[int, int]], victims: tuple[str, ...] = ()
    ) -> None:
        w = job.workload
        from_releasing, released_by = self._claim(placement, w.gpus_per_rank)
        self._add_usage(job.queue, w.gpus)
        for x in self.tree.path[job.queue]:
            self.waiting_usage[x] += w.gpus
        if not job.cls.preemptible:
            self.pinned_usage[job.queue] += w.gpus
        if from_releasing:
            reason = (
                f"waiting for {from_releasing} GPUs being released by {_jobs_phrase(released_by)}"
            )
        elif victims:
            # The victims free quota rather than GPUs on the chosen nodes.
            reason = f"waiting for {_jobs_phrase(list(victims))} to exit and return quota"
        else:
            reason = "waiting for its reserved GPUs"
        self.waits[w.id] = Waiting(w.id, reason)
        self.claimed.add(w.id)

    def _physical_reason(self, ranks: int, gpr: int) -> str:
        flavor = self.flavor
        if not self.node_names:
            return f"no node of flavor {flavor} exists"
        if gpr > self.max_node_gpus:
            return f"no node of flavor {flavor} has {gpr} GPUs"
        if ranks * gpr > self.capacity:
            return f"flavor {flavor} has only {self.capacity} GPUs"
        if ranks * gpr <= self.max_node_gpus:
            return f"no node of flavor {flavor} has {ranks * gpr} free GPUs"
        return f"{ranks} ranks of {gpr} GPUs do not fit on the free {flavor} GPUs"

    # Status ----------------------------------------------------------------------------

    def statuses(self, workloads: list[Workload]) -> dict[int, QueueStatus]:
        """Every queue's guarantee, usage, fair share, borrowed and lent GPUs after the plan."""
        tree = self.tree
        count = len(tree.names)
        held = [0] * count
        for w in workloads:
            if w.state != PENDING:
                held[tree.index[w.queue]] += w.gpus
        for q, gpus in self.admitted.values():
            held[q] += gpus
        for q in tree.bottom_up:
            p = tree.parent[q]
            if p != -1:
                held[p] += held[q]
        lent = [0.0] * count

        def lend_among(siblings: list[int], spare: float, outward: float) -> None:
            # Borrowers among the siblings use the parent's unassigned guarantee first,
            # then the siblings' idle guarantees; what the parent lends outward comes
            # from its children's idle guarantees too.
            borrowed = sum(max(0, held[s] - self.guarantee[s]) for s in siblings)
            need = max(0.0, borrowed - spare) + outward
            idle = [
                float(r4_lendable_idle(self.guarantee[s], held[s], self.lend_limit[s]))
                for s in siblings
            ]
            total_idle = sum(idle)
            for s, spare_s in zip(siblings, idle, strict=True):
                lent[s] = 0.0 if total_idle <= 0 else min(spare_s, need * spare_s / total_idle)
            for s in siblings:
                if tree.children[s]:
                    inner = max(
                        0, self.guarantee[s] - sum(self.guarantee[c] for c in tree.children[s])
                    )
                    lend_among(tree.children[s], float(inner), lent[s])

        top_spare = max(0, self.capacity - sum(self.guarantee[t] for t in tree.top))
        lend_among(tree.top, float(top_spare), 0.0)
        return {
            q: QueueStatus(
                guarantee=self.guarantee[q],
                usage=held[q],
                fair_share=round(self.fair_share[q], 6),
                borrowed=max(0, held[q] - self.guarantee[q]),
                lent=round(lent[q]),
            )
            for q in range(count)
        }


def _prepare(snapshot: Snapshot) -> tuple[_Tree, dict[str, PriorityClass], dict[str, str]]:
    tree = _build_tree(snapshot)
    classes: dict[str, PriorityClass] = {}
    for i, cls in enumerate(snapshot.priority_classes):
        if cls.name in classes:
            raise ScenarioError(f"priority_classes[{i}].name: duplicate class {cls.name!r}")
        classes[cls.name] = cls
    node_flavor: dict[str, str] = {}
    node_gpus: dict[str, int] = {}
    for i, node in enumerate(snapshot.nodes):
        if node.name in node_flavor:
            raise ScenarioError(f"nodes[{i}].name: duplicate node {node.name!r}")
        if node.gpus < 0:
            raise ScenarioError(f"nodes[{i}].gpus: must not be negative, got {node.gpus}")
        node_flavor[node.name] = node.flavor
        node_gpus[node.name] = node.gpus
    _validate_workloads(snapshot, tree, classes, node_flavor, node_gpus)
    return tree, classes, node_flavor


def check_snapshot(snapshot: Snapshot) -> None:
    """Raise ``ScenarioError`` naming the field when ``snapshot`` breaks the model."""
    _prepare(snapshot)


def plan(snapshot: Snapshot) -> Plan:
    """Plan every pending workload of ``snapshot``: admissions, preemptions, waiting list, status.

    Raises ``ScenarioError`` for a snapshot that breaks the model (an unknown queue,
    class or node, a workload on a non-leaf queue, a placement that does not match).
    """
    tree, classes, node_flavor = _prepare(snapshot)

    by_flavor: dict[str, list[Workload]] = {}
    for w in snapshot.workloads:
        by_flavor.setdefault(w.flavor, []).append(w)
    flavors = set(node_flavor.values()) | set(by_flavor)
    for queue in snapshot.queues:
        flavors.update(queue.quotas)

    admit: list[Admission] = []
    preempt: list[Preemption] = []
    waiting: list[Waiting] = []
    status: dict[str, dict[str, QueueStatus]] = {name: {} for name in tree.names}
    for flavor in sorted(flavors):
        workloads = by_flavor.get(flavor, [])
        planner = _FlavorPlanner(snapshot, tree, classes, flavor, workloads)
        planner.run()
        preempt.extend(planner.preempt)
        admit.extend(planner.admissions.values())
        waiting.extend(planner.waits.values())
        for q, queue_status in planner.statuses(workloads).items():
            status[tree.names[q]][flavor] = queue_status
    return Plan(
        admit=tuple(admit),
        preempt=tuple(preempt),
        waiting=tuple(waiting),
        queues=FrozenMap({name: FrozenMap(flavors_) for name, flavors_ in status.items()}),
    )
