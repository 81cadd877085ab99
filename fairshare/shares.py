"""Fair shares (R4, R8): how much of one flavor each queue deserves right now.

Decides every queue's demand-capped fair share by hierarchical water-filling: the
flavor's capacity is divided between the top-level queues, each share between the
children of that queue, and so on down. Guarantees come first (capped by demand and
borrow limit), a lend limit keeps part of an idle guarantee out of the pool, and the
rest is divided by weight (``rules.r8_water_fill``).
"""

from __future__ import annotations

import math
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
    weights: Sequence[float] | None = None,
) -> list[float]:
    """Every queue's fair share of ``capacity`` GPUs, indexed like ``tree.names``.

    ``demand`` counts the GPUs of all of a leaf queue's workloads (pending, running and
    terminating); ``withheld_by_lend_limit`` is the part of each guarantee that its lend
    limit keeps from other queues. ``weights`` replace the tree's weights for the
    surplus (see ``usage_adjusted_weights``).
    """
    weight = tree.weight if weights is None else weights
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
    # Each group of siblings with the amount it divides, parents before children: a
    # list of work rather than a recursive inner function, which would hold itself
    # (and through it the tree) in a reference cycle that only the cyclic collector
    # frees, after the plan.
    groups: list[tuple[float, list[int]]] = [(float(capacity), tree.top)]
    while groups:
        amount, siblings = groups.pop()
        if not siblings:
            continue
        given = r8_water_fill(
            amount,
            [float(guarantee[sibling]) for sibling in siblings],
            [cap[sibling] for sibling in siblings],
            [kept_back[sibling] for sibling in siblings],
            [weight[sibling] for sibling in siblings],
        )
        for sibling, share in zip(siblings, given, strict=True):
            shares[sibling] = share
            if tree.children[sibling]:
                withheld = max(
                    0.0, kept_back[sibling] - min(float(guarantee[sibling]), cap[sibling])
                )
                groups.append((share + withheld, tree.children[sibling]))
    return shares


# Usage ratios beyond these bounds change the weight no further: a team idle for a week
# gets at most 8 times its weight, and one that took everything keeps an eighth of it.
USAGE_RATIO_BOUNDS = (0.125, 8.0)


def usage_ratios(
    tree: QueueTree,
    guarantee: Sequence[int],
    recent: Sequence[float],
    half_life_seconds: float,
) -> list[float]:
    """Every queue's recent use of GPUs beyond its guarantee, relative to its weight's
    share of what its siblings used beyond theirs (1: exactly its share).

    ``recent`` is each queue's decayed GPU-seconds. A guarantee held all the time adds
    ``guarantee * half_life / ln 2`` decayed GPU-seconds (the integral of the decay), so
    that part counts as the queue's own; only the rest was borrowed. Siblings that
    borrowed nothing all have ratio 1.
    """
    horizon = half_life_seconds / math.log(2)
    beyond = [max(0.0, recent[q] - guarantee[q] * horizon) for q in range(len(tree.names))]
    ratios = [1.0] * len(tree.names)
    groups = [tree.top] + [children for children in tree.children if children]
    for siblings in groups:
        total = sum(beyond[q] for q in siblings)
        weight_total = sum(tree.weight[q] for q in siblings)
        if total <= 0 or weight_total <= 0:
            continue
        for q in siblings:
            expected = total * tree.weight[q] / weight_total
            ratios[q] = beyond[q] / expected if expected > 0 else 1.0
    return ratios


def usage_words(
    *,
    team: str,
    flavor: str,
    ratio: float,
    fair_share: float,
    weight_fair_share: float,
    half_life_seconds: float,
) -> str:
    """Decayed usage as the reason a team's fair share is smaller, in one sentence
    (lower case, no full stop): the engine's waiting reasons and the portal's pages
    both word it here, so the figures read the same everywhere."""
    days = half_life_seconds / 86_400
    period = "the last week" if days == 7 else f"a half-life of {days:g} days"
    return (
        f"team {team} used {ratio:.1f}× its share of the spare {flavor} GPUs over "
        f"{period}: its fair share is {fair_share:.1f} GPUs instead of {weight_fair_share:.1f}"
    )


def usage_adjusted_weights(
    tree: QueueTree, ratios: Sequence[float], strength: float
) -> list[float]:
    """Each queue's weight divided by its usage ratio to the power ``strength``.

    Strength 0 returns the weights unchanged, so plans are those of weight alone.
    """
    if strength == 0:
        return list(tree.weight)
    low, high = USAGE_RATIO_BOUNDS
    return [
        weight * min(high, max(low, ratio)) ** -strength
        for weight, ratio in zip(tree.weight, ratios, strict=True)
    ]
