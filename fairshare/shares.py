"""Fair shares (R4, R8): how much of one flavor each queue deserves right now.

Decides every queue's demand-capped fair share by hierarchical water-filling: the
flavor's capacity is divided between the top-level queues, each share between the
children of that queue, and so on down. Guarantees come first (capped by demand and
borrow limit), a lend limit keeps part of an idle guarantee out of the pool, and the
rest is divided by weight (``rules.r8_water_fill``).
"""

from __future__ import annotations

from collections.abc import Sequence

from .rules import r8_water_fill
from .tree import QueueTree


def fair_shares(
    tree: QueueTree,
    capacity: int,
    guarantee: Sequence[int],
    borrow_limit: Sequence[int | None],
    withheld_by_lend_limit: Sequence[int],
    demand: Sequence[int],
) -> list[float]:
    """Every queue's fair share of ``capacity`` GPUs, indexed like ``tree.names``.

    ``demand`` counts the GPUs of all of a leaf queue's workloads (pending, running and
    terminating); ``withheld_by_lend_limit`` is the part of each guarantee that its lend
    limit keeps from other queues.
    """
    count = len(tree.names)
    # The most a queue can use: its demand, capped by its borrow limit.
    cap = [0.0] * count
    # What a queue keeps out of its siblings' pool: its capped guarantee, the part its
    # lend limit withholds, or what its children keep, whichever is largest.
    kept_back = [0.0] * count
    for queue in tree.bottom_up:
        children = tree.children[queue]
        if children:
            wanted = float(sum(cap[child] for child in children))
        else:
            wanted = float(demand[queue])
        limit = borrow_limit[queue]
        if limit is not None:
            wanted = min(wanted, float(guarantee[queue] + limit))
        cap[queue] = wanted
        kept_back[queue] = max(
            min(float(guarantee[queue]), wanted),
            float(withheld_by_lend_limit[queue]),
            float(sum(kept_back[child] for child in children)),
        )
    shares = [0.0] * count

    def divide(amount: float, siblings: list[int]) -> None:
        if not siblings:
            return
        given = r8_water_fill(
            amount,
            [float(guarantee[sibling]) for sibling in siblings],
            [cap[sibling] for sibling in siblings],
            [kept_back[sibling] for sibling in siblings],
            [tree.weight[sibling] for sibling in siblings],
        )
        for sibling, share in zip(siblings, given, strict=True):
            shares[sibling] = share
            if tree.children[sibling]:
                withheld = max(
                    0.0, kept_back[sibling] - min(float(guarantee[sibling]), cap[sibling])
                )
                divide(share + withheld, tree.children[sibling])

    divide(float(capacity), tree.top)
    return shares
