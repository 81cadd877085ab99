"""The quota ledger: one flavor's GPUs per queue as the quota rules count them.

Decides whether a queue may take more GPUs (R4's borrow limits, R5's rule that only
preemptible work runs on borrowed GPUs, and the lend limits that keep part of an idle
guarantee back) and keeps the counts those decisions read: usage per queue (running and
newly planned work; a terminating victim no longer counts), each queue's guarantee line
(R3), its fair share, and which leaf queues stand above their guarantee or their fair
share and so could give GPUs to others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .model import PriorityClass, Snapshot
from .rules import r3_guarantee_line, r4_within_borrow_limit, r5_may_use_borrowed
from .shares import (
    USAGE_RATIO_BOUNDS,
    fair_shares,
    usage_adjusted_weights,
    usage_ratios,
    usage_words,
)
from .tree import QueueTree


class QuotaLedger:
    """Usage, guarantees and limits of every queue for one flavor, kept current by the plan."""

    def __init__(
        self,
        snapshot: Snapshot,
        tree: QueueTree,
        flavor: str,
        capacity: int,
        leaf_usage: Sequence[int],
        leaf_demand: Sequence[int],
        pinned_usage: Sequence[int],
    ) -> None:
        """``leaf_usage`` and ``leaf_demand`` count each leaf queue's own workloads;
        ``pinned_usage`` the part of its usage held by non-preemptible work."""
        self.tree = tree
        self.flavor = flavor
        self.capacity = capacity
        count = len(tree.names)

        # Quotas, with each parent's guarantee at least the sum of its children's.
        quotas = [queue.quota(flavor) for queue in snapshot.queues]
        guarantee = [max(0, quota.guarantee) for quota in quotas]
        for queue in tree.bottom_up:
            children = tree.children[queue]
            if children:
                guarantee[queue] = max(guarantee[queue], sum(guarantee[c] for c in children))
        self.guarantee = guarantee
        self.borrow_limit = [quota.borrow_limit for quota in quotas]
        # The queues on each path that have a borrow limit, bottom up: most have none.
        self.limited_path = [
            tuple(x for x in chain if self.borrow_limit[x] is not None) for chain in tree.path
        ]
        self.lend_limit = [quota.lend_limit for quota in quotas]
        # The part of each guarantee that its lend limit keeps from other queues.
        self.withheld = [
            0 if lend is None else max(0, guarantee[queue] - lend)
            for queue, lend in enumerate(self.lend_limit)
        ]

        self.usage = list(leaf_usage)
        self.demand = list(leaf_demand)
        for queue in tree.bottom_up:
            parent = tree.parent[queue]
            if parent != -1:
                self.usage[parent] += self.usage[queue]
                self.demand[parent] += self.demand[queue]
        # R3: the GPUs each queue keeps whatever happens. Demand does not change during
        # a plan, so the lines are fixed for it.
        self.line = [r3_guarantee_line(guarantee[q], self.demand[q]) for q in range(count)]
        # GPUs that jobs only waiting on reservations add to ``usage``: a queue must not
        # look above its guarantee line because of its own waiting work.
        self.waiting_usage = [0] * count
        # GPUs that jobs admitted in this plan add to ``usage``. A queue that ran at or
        # under its guarantee line must not give running work to others because of its
        # own new work: usage less waiting and planned usage is what it ran before the
        # plan, less the victims taken since.
        self.planned_usage = [0] * count
        self.pinned_usage = list(pinned_usage)
        # A failed preemption search's GPUs to give back per queue, 0 between searches
        # (``preemption.preempt_for``).
        self.given_scratch = [0] * count

        # Lend limits withhold part of an idle guarantee; track it as occupancy.
        self.has_withheld = any(self.withheld)
        self.occupancy = [0] * count
        self.child_occupancy = [0] * count
        if self.has_withheld:
            for queue in tree.bottom_up:
                own = self.usage[queue] if not tree.children[queue] else self.child_occupancy[queue]
                self.occupancy[queue] = max(own, self.withheld[queue])
                parent = tree.parent[queue]
                if parent != -1:
                    self.child_occupancy[parent] += self.occupancy[queue]
        self.total_occupancy = sum(self.occupancy[top] for top in tree.top)

        # Fair shares by weight alone, and (with decayed usage) by weight adjusted for it.
        self.plain_fair_share = fair_shares(
            tree, capacity, guarantee, self.borrow_limit, self.withheld, self.demand
        )
        self.fair_share = self.plain_fair_share
        self.half_life_seconds = snapshot.usage_half_life_seconds
        # Per queue: how much more (above 1) or less than its weight's share of the
        # surplus it used recently, and the factor by which that moves a queue below its
        # fair share ahead (1 everywhere without decayed usage).
        self.usage_ratio = [1.0] * count
        # Per queue: usage_reason's words, or "" where its fair share was not lowered.
        self.usage_reasons: dict[int, str] = {}
        self.order_boost = [1.0] * count
        strength = snapshot.usage_strength
        if strength > 0:
            recent = [float(queue.recent_usage.get(flavor, 0.0)) for queue in snapshot.queues]
            for queue in tree.bottom_up:
                parent = tree.parent[queue]
                if parent != -1 and flavor not in snapshot.queues[parent].recent_usage:
                    recent[parent] += recent[queue]
            self.usage_ratio = usage_ratios(tree, guarantee, recent, self.half_life_seconds)
            self.fair_share = fair_shares(
                tree,
                capacity,
                guarantee,
                self.borrow_limit,
                self.withheld,
                self.demand,
                usage_adjusted_weights(tree, self.usage_ratio, strength),
            )
            low, high = USAGE_RATIO_BOUNDS
            self.order_boost = [
                min(high, max(low, ratio)) ** -strength for ratio in self.usage_ratio
            ]
        leaves = [queue for queue in range(count) if not tree.children[queue]]
        # Leaf queues that could lose GPUs to others (kept current by ``add_usage``).
        self.over_guarantee: dict[int, None] = {
            queue: None for queue in leaves if self.usage[queue] > guarantee[queue]
        }
        self.over_fair_share: dict[int, None] = {
            queue: None for queue in leaves if self.usage[queue] > self.fair_share[queue]
        }
        # Per queue: whether it is in each of them. Read by ``add_usage`` for every
        # candidate victim a search tries: compiled, a list of flags is read without
        # making an int object for the dict's key.
        self.in_over_guarantee = [queue in self.over_guarantee for queue in range(count)]
        self.in_over_fair_share = [queue in self.over_fair_share for queue in range(count)]
        # Called with a leaf queue whenever it enters or leaves ``over_guarantee``.
        self.guarantee_crossed: Callable[[int], None] | None = None

    def plan_usage(self, queue: int, delta: int) -> None:
        """Count ``delta`` GPUs of work admitted in this plan for leaf ``queue`` and its
        ancestors (negative when an admission is withdrawn)."""
        for x in self.tree.path[queue]:
            self.planned_usage[x] += delta

    def add_usage(self, queue: int, delta: int) -> None:
        """Count ``delta`` more GPUs (fewer when negative) for leaf ``queue`` and its ancestors."""
        tree = self.tree
        usage = self.usage
        after = usage[queue] + delta
        # Tested here rather than in a call: this runs for every candidate victim a
        # search tries, and most change neither membership.
        member = after > self.guarantee[queue]
        if member != self.in_over_guarantee[queue]:
            self.in_over_guarantee[queue] = member
            _set_member(self.over_guarantee, queue, member)
            if self.guarantee_crossed is not None:
                self.guarantee_crossed(queue)
        member = after > self.fair_share[queue]
        if member != self.in_over_fair_share[queue]:
            self.in_over_fair_share[queue] = member
            _set_member(self.over_fair_share, queue, member)
        # ``usage[x] = usage[x] + delta`` rather than ``+=``: compiled, the augmented
        # assignment to a list item goes through Python's generic addition.
        if not self.has_withheld:
            for x in tree.path[queue]:
                usage[x] = usage[x] + delta
            return
        change = delta
        for x in tree.path[queue]:
            usage[x] = usage[x] + delta
            if tree.children[x]:
                self.child_occupancy[x] += change
                new = max(self.child_occupancy[x], self.withheld[x])
            else:
                new = max(self.usage[x], self.withheld[x])
            change = new - self.occupancy[x]
            self.occupancy[x] = new
        self.total_occupancy += change

    def quota_reason(self, queue: int, gpus: int, priority_class: PriorityClass) -> str | None:
        """Why ``gpus`` more GPUs for leaf ``queue`` break a quota rule, or None when they do not."""
        tree = self.tree
        usage = self.usage
        guarantee = self.guarantee
        # Borrowed GPUs are counted against the queue's preemptible work first, so a
        # non-preemptible workload needs room beside the queue's other non-preemptible ones.
        pinned = self.pinned_usage[queue]
        if not r5_may_use_borrowed(priority_class, pinned + gpus - guarantee[queue]):
            return (
                "non-preemptible work cannot run on borrowed GPUs: "
                f"team {tree.names[queue]} has {max(0, guarantee[queue] - pinned)} "
                f"of its {guarantee[queue]} guaranteed {self.flavor} GPUs free of "
                "non-preemptible work"
            )
        for x in self.limited_path[queue]:
            limit = self.borrow_limit[x]
            if not r4_within_borrow_limit(usage[x], guarantee[x], limit, gpus):
                return f"team {tree.names[x]} at its borrow limit of {limit} {self.flavor} GPUs"
        if self.has_withheld:
            change = gpus
            for x in tree.path[queue]:
                if tree.children[x]:
                    new = max(self.child_occupancy[x] + change, self.withheld[x])
                else:
                    new = max(usage[x] + gpus, self.withheld[x])
                change = new - self.occupancy[x]
            if self.total_occupancy + change > self.capacity:
                return f"the idle {self.flavor} GPUs are held back by other teams' lend limits"
        return None

    def usage_reason(self, queue: int, gpus: int) -> str | None:
        """Why decayed usage keeps ``gpus`` more GPUs from leaf ``queue``, or None.

        Said when a queue on its path used more than its share of the surplus recently,
        which made its fair share smaller, and the GPUs take it beyond that fair share.
        The fair shares do not change during a plan, so each queue's words are made once.
        """
        for x in self.tree.path[queue]:
            fair = self.fair_share[x]
            if self.usage[x] + gpus > fair + 1e-9 and self.usage_ratio[x] > 1:
                words = self.usage_reasons.get(x)
                if words is None:
                    plain = self.plain_fair_share[x]
                    words = self.usage_reasons[x] = (
                        usage_words(
                            team=self.tree.names[x],
                            flavor=self.flavor,
                            ratio=self.usage_ratio[x],
                            fair_share=fair,
                            weight_fair_share=plain,
                            half_life_seconds=self.half_life_seconds,
                        )
                        if fair < plain - 1e-9
                        else ""
                    )
                if words:
                    return words
        return None


def _set_member(members: dict[int, None], queue: int, member: bool) -> None:
    """Put ``queue`` into ``members`` or take it out, as ``member`` says."""
    if member:
        members[queue] = None
    else:
        del members[queue]
