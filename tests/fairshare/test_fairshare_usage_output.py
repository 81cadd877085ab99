"""Decayed usage in the engine's output and its what-if: a queue's status carries its
usage ratio and its fair share by weight alone, and a quota change leaves the queue's
recent usage as it was, so that the preview of a change plans with the same usage."""

from __future__ import annotations

import math

from fairshare import (
    FlavorQuota,
    Node,
    PriorityClass,
    Queue,
    QuotaChange,
    Snapshot,
    Workload,
    apply_changes,
    plan,
    usage_words,
)

DAY = 86_400.0


def _snapshot() -> Snapshot:
    # 16 GPUs, a and b guarantee none and each want 16. a used 8 GPUs for a whole
    # half-life (8 · h/ln 2 · 1/2 decayed GPU-seconds), b nothing: a's ratio is 2 (its
    # share of what both borrowed is half), b's 0, bounded to 1/8. At strength 1 the
    # weights become 1/2 and 8: b's share 16 · 8/8.5 = 15.06, a's 16 · 0.5/8.5 = 0.94.
    h = 7 * DAY
    return Snapshot(
        now=1_000_000.0,
        nodes=(Node("n0", "h100", 8), Node("n1", "h100", 8)),
        queues=(
            Queue(
                "a",
                None,
                quotas={"h100": FlavorQuota()},
                recent_usage={"h100": 4 * h / math.log(2)},
            ),
            Queue("b", None, quotas={"h100": FlavorQuota()}),
        ),
        priority_classes=(PriorityClass("batch", 0, "Never", True, 30.0),),
        workloads=tuple(
            Workload(f"{queue}{i}", queue, "batch", "h100", 1, 8, "pending", submitted_at=float(i))
            for queue in "ab"
            for i in range(2)
        ),
        usage_strength=1.0,
        usage_half_life_seconds=h,
    )


def test_a_queue_status_carries_its_usage_ratio_and_fair_share_by_weight() -> None:
    status = plan(_snapshot()).queues
    a, b = status["a"]["h100"], status["b"]["h100"]
    assert a.usage_ratio == 2.0 and b.usage_ratio == 0.0
    assert math.isclose(a.fair_share, 16 * 0.5 / 8.5, abs_tol=1e-5)
    assert math.isclose(b.fair_share, 16 * 8 / 8.5, abs_tol=1e-5)
    assert a.weight_fair_share == b.weight_fair_share == 8.0
    assert (
        usage_words(
            team="a",
            flavor="h100",
            ratio=a.usage_ratio,
            fair_share=a.fair_share,
            weight_fair_share=a.weight_fair_share,
            half_life_seconds=7 * DAY,
        )
        == "team a used 2.0× its share of the spare h100 GPUs over the last week: its fair share is 0.9 GPUs instead of 8.0"
    )


def test_a_quota_change_keeps_the_queues_recent_usage() -> None:
    snapshot = _snapshot()
    changed = apply_changes(snapshot, [QuotaChange(queue="a", flavor="h100", guarantee=2)])
    assert changed.queues[0].recent_usage == snapshot.queues[0].recent_usage
    assert changed.queues[0].quota("h100").guarantee == 2
    # a still borrowed 2 · h/ln 2 beyond its new guarantee against b's none: ratio 2, so
    # of the 14 spare GPUs it gets 0.5/8.5 beyond its 2 (9 by weight alone).
    status = plan(changed).queues["a"]["h100"]
    assert status.usage_ratio == 2.0
    assert math.isclose(status.fair_share, 2 + 14 * 0.5 / 8.5, abs_tol=1e-5)
    assert status.weight_fair_share == 9.0
