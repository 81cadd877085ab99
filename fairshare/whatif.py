"""What-if: the consequences of a quota change, computed by planning before and after."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .engine import plan
from .model import (
    Consequences,
    FairShareMove,
    FlavorQuota,
    FrozenMap,
    QuotaChange,
    ScenarioError,
    Snapshot,
    Unset,
)


def apply_changes(snapshot: Snapshot, changes: Sequence[QuotaChange]) -> Snapshot:
    """The snapshot with ``changes`` applied to its queues' quotas and weights."""
    queues = {q.name: q for q in snapshot.queues}
    for i, change in enumerate(changes):
        queue = queues.get(change.queue)
        if queue is None:
            raise ScenarioError(f"changes[{i}].queue: unknown queue {change.queue!r}")
        quota = queue.quota(change.flavor)
        if not isinstance(change.guarantee, Unset):
            quota = dataclasses.replace(quota, guarantee=change.guarantee or 0)
        if not isinstance(change.borrow_limit, Unset):
            quota = dataclasses.replace(quota, borrow_limit=change.borrow_limit)
        if not isinstance(change.lend_limit, Unset):
            quota = dataclasses.replace(quota, lend_limit=change.lend_limit)
        quotas: dict[str, FlavorQuota] = dict(queue.quotas)
        quotas[change.flavor] = quota
        weight = queue.weight if isinstance(change.weight, Unset) else change.weight
        # Everything else about the queue, its recent usage included, stays as it is.
        queues[change.queue] = dataclasses.replace(queue, weight=weight, quotas=FrozenMap(quotas))
    return dataclasses.replace(snapshot, queues=tuple(queues[q.name] for q in snapshot.queues))


def diff(snapshot: Snapshot, changes: Sequence[QuotaChange]) -> Consequences:
    """What ``changes`` would do now: which running jobs would be preempted, what would start.

    Both plans are computed from the same snapshot, so the answer is exactly what the
    next scheduling cycle would do differently after the change is saved.
    """
    before = plan(snapshot)
    after = plan(apply_changes(snapshot, changes))
    preempted_before = {p.id for p in before.preempt}
    preempted_after = {p.id for p in after.preempt}
    admitted_before = {a.id for a in before.admit}
    fair_share = {
        queue: FrozenMap(
            {
                flavor: FairShareMove(
                    before=status.fair_share, after=after.queues[queue][flavor].fair_share
                )
                for flavor, status in flavors.items()
            }
        )
        for queue, flavors in before.queues.items()
    }
    return Consequences(
        reclaimed=tuple(p for p in after.preempt if p.id not in preempted_before),
        released=tuple(sorted(preempted_before - preempted_after)),
        admitted=tuple(a for a in after.admit if a.id not in admitted_before),
        fair_share=FrozenMap(fair_share),
    )
