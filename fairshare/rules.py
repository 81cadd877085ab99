"""The rules R1-R11 of the fair-share engine, one small pure function each.

The planner (``engine.py`` and the modules it lists) calls these functions by name; each
is named after the rule in ARCHITECTURE.md ("The fair-share engine") and tested by that
name, so the rule that is tested is the rule the engine applies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .model import PREEMPT_LOWER_PRIORITY, PriorityClass


def r1_capacity_free_gpus(node_gpus: int, held: int) -> int:
    """R1: GPUs of a node that nobody holds; a victim's GPUs stay held until it exits.

    ``held`` counts running and terminating ranks alike. A snapshot that is already over
    capacity (a race in the database) yields zero, never a negative number.
    """
    return max(0, node_gpus - held)


def r3_guarantee_line(guarantee: int, demand: int) -> int:
    """R3: the GPUs a queue keeps whatever happens, min(guarantee, demand)."""
    return min(guarantee, demand)


def r3_guarantee_overshoot(usage: int, line: int, victim_gpus: int) -> int | None:
    """R3: how far taking a victim of ``victim_gpus`` pushes its queue below its line.

    ``None`` when the queue is at or below the line already (it must not be reclaimed
    from); 0 when the victim fits above the line; a positive number for a gang that
    straddles the line (it goes whole, and the smallest overshoot is preferred).
    """
    if usage <= line:
        return None
    return max(0, line - (usage - victim_gpus))


def r4_lendable_idle(guarantee: int, usage: int, lend_limit: int | None) -> int:
    """R4: the part of a queue's idle guarantee that other queues may borrow."""
    idle = max(0, guarantee - usage)
    return idle if lend_limit is None else min(idle, lend_limit)


def r4_within_borrow_limit(
    usage: int, guarantee: int, borrow_limit: int | None, extra_gpus: int
) -> bool:
    """R4: whether ``extra_gpus`` more keep the queue within ``borrow_limit`` beyond its guarantee."""
    if borrow_limit is None:
        return True
    return usage + extra_gpus - guarantee <= borrow_limit


def r5_may_use_borrowed(priority_class: PriorityClass, borrowed_gpus: int) -> bool:
    """R5: only a preemptible workload may run on borrowed GPUs."""
    return borrowed_gpus <= 0 or priority_class.preemptible


def r6_may_reclaim(usage: int, gpus: int, guarantee: int) -> bool:
    """R6: a workload reclaims when its queue, with it, stays within its guarantee."""
    return gpus > 0 and usage + gpus <= guarantee


def r7_may_preempt_by_priority(
    preemptor: PriorityClass,
    victim: PriorityClass,
    victim_runtime: float,
    min_runtime: float | None = None,
) -> bool:
    """R7: inside one queue, PreemptLowerPriority preempts strictly lower, preemptible classes.

    A victim younger than ``min_runtime`` (its minimum runtime for priority preemption,
    see ``model.minimum_runtimes``; by default its class's ``min_runtime_seconds``) is
    protected.
    """
    if min_runtime is None:
        min_runtime = victim.min_runtime_seconds
    return (
        preemptor.preemption_policy == PREEMPT_LOWER_PRIORITY
        and victim.preemptible
        and victim.value < preemptor.value
        and victim_runtime >= min_runtime
    )


def r8_share(usage: float, fair_share: float) -> float:
    """R8: a queue's share, usage relative to its fair share (infinite when it deserves none)."""
    if fair_share <= 0:
        return 0.0 if usage <= 0 else float("inf")
    return usage / fair_share


def r8_may_preempt_for_fair_share(
    preemptor_usage: float,
    preemptor_fair_share: float,
    gpus: int,
    victim_usage: float,
    victim_fair_share: float,
    victim_gpus: int,
) -> bool:
    """R8: the anti-flap test between two queues.

    Preempt only when the preemptor's share after the move stays at most the victim's
    share after it, and the victim's queue stays at or above its own fair share. Then
    the victim's queue can never take the GPUs back by the same rule, so plans do not flap.
    """
    victim_after = victim_usage - victim_gpus
    if victim_after < victim_fair_share:
        return False
    preemptor_after = r8_share(preemptor_usage + gpus, preemptor_fair_share)
    return preemptor_after <= r8_share(victim_after, victim_fair_share)


def r8_water_fill(
    amount: float,
    guarantees: Sequence[float],
    caps: Sequence[float],
    holds: Sequence[float],
    weights: Sequence[float],
) -> list[float]:
    """R8 (and R4): divide ``amount`` GPUs between siblings.

    Each sibling first gets its guarantee up to its cap (demand and borrow limit); the
    part of an idle guarantee that its lend limit keeps back (``holds``) leaves the pool
    unused; what remains is divided by weight, each sibling capped by its cap. When the
    guarantees exceed ``amount`` (an oversubscribed tree), each gets a part proportional
    to its guaranteed demand.
    """
    count = len(guarantees)
    shares = [min(guarantees[i], caps[i]) for i in range(count)]
    reserved = sum(max(shares[i], holds[i]) for i in range(count))
    if reserved >= amount:
        if reserved <= 0:
            return [0.0] * count
        scale = max(0.0, amount) / reserved
        return [shares[i] * scale for i in range(count)]
    rest = amount - reserved
    # Classic water-filling: raise a common level; a sibling stops at its cap.
    open_siblings = sorted(
        (i for i in range(count) if caps[i] > shares[i] and weights[i] > 0),
        key=lambda i: (caps[i] - shares[i]) / weights[i],
    )
    weight_left = sum(weights[i] for i in open_siblings)
    for i in open_siblings:
        if rest <= 1e-12 or weight_left <= 0:
            break
        room = caps[i] - shares[i]
        portion = rest * weights[i] / weight_left
        given = min(room, portion)
        shares[i] += given
        rest -= given
        weight_left -= weights[i]
    return shares


def r9_lost_gpu_seconds(
    gpus: int, now: float, admitted_at: float | None, last_checkpoint_at: float | None
) -> float:
    """R9: work a victim loses, GPUs x seconds since its last committed checkpoint.

    Without a checkpoint the work since its start is lost.
    """
    since = last_checkpoint_at if last_checkpoint_at is not None else admitted_at
    if since is None:
        return 0.0
    return gpus * max(0.0, now - since)


def r9_victim_order(
    priority: int, lost_gpu_seconds: float, admitted_at: float | None, workload_id: str
) -> tuple[int, float, float, str]:
    """R9: the order in which victims are considered, cheapest first.

    Lower priority first, then the least lost work, then the newest admission. Priority
    leads (rather than lost work) because a higher-priority victim would, once requeued,
    preempt a lower-priority job of its own queue by R7 in the next cycle: the plan
    would flap.
    """
    return (priority, lost_gpu_seconds, -(admitted_at or 0.0), workload_id)


def r10_place(
    ranks: int, gpus_per_rank: int, available: Mapping[str, int]
) -> tuple[tuple[str, int], ...] | None:
    """R10: place a gang on nodes, packing ranks onto as few nodes as possible.

    A gang that fits on one node goes to the node with the least room that holds it
    (best fit, which keeps whole nodes free for large gangs). Otherwise the nodes with
    the most room are filled first and the last ranks go to the best-fitting node.
    Returns (node, ranks) pairs, or ``None`` when the gang does not fit (R2).
    """
    hosts = [(room // gpus_per_rank, name) for name, room in available.items()]
    hosts = [(fit, name) for fit, name in hosts if fit > 0]
    if sum(fit for fit, _ in hosts) < ranks:
        return None
    whole = min(((fit, name) for fit, name in hosts if fit >= ranks), default=None)
    if whole is not None:
        # Most gangs fit one node: the best fit, found without ordering the hosts.
        return ((whole[1], ranks),)
    placement: list[tuple[str, int]] = []
    remaining = ranks
    hosts.sort(key=lambda host: (-host[0], host[1]))
    while remaining > 0:
        best = min(
            ((fit, name) for fit, name in hosts if fit >= remaining),
            default=None,
        )
        if best is not None:
            placement.append((best[1], remaining))
            break
        fit, name = hosts.pop(0)
        placement.append((name, fit))
        remaining -= fit
    return tuple(placement)


def r11_releasing_first(releasing: int, need: int) -> int:
    """R11: GPUs already on their way back that a preemptor counts before picking victims."""
    return min(max(0, releasing), max(0, need))
