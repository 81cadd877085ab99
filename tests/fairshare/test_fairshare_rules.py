"""Each rule R1-R11 as a small function, tested by its name; and the what-if diff."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from fairshare_builders import CLASSES, cluster, nodes, run_plan, team
from fairshare_builders import workload as w
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fairshare import Node, QuotaChange, consequences_to_dict, diff
from fairshare.consolidation import restart_in_any_order
from fairshare.elastic import may_grow, shrink_costs_less
from fairshare.nodes import NodeMap
from fairshare.rules import (
    r1_capacity_free_gpus,
    r3_guarantee_line,
    r3_guarantee_overshoot,
    r4_lendable_idle,
    r4_within_borrow_limit,
    r5_may_use_borrowed,
    r6_may_reclaim,
    r7_may_preempt_by_priority,
    r8_may_preempt_for_fair_share,
    r8_share,
    r8_water_fill,
    r9_lost_gpu_seconds,
    r9_victim_order,
    r10_place,
    r11_releasing_first,
)
from fairshare.work import PendingJob, in_queue_order

CLS = {c.name: c for c in CLASSES}


def test_r1_capacity_counts_victims_until_they_exit() -> None:
    assert r1_capacity_free_gpus(8, 3) == 5
    assert r1_capacity_free_gpus(8, 8) == 0
    assert r1_capacity_free_gpus(8, 10) == 0  # an over-full snapshot never goes negative


def _hostable(free: list[int], gpus_per_rank: int, releasing: int = 0) -> int:
    node_map = NodeMap([Node(f"n{i}", "h100", 8) for i in range(len(free))])
    terminating = [("t", ((0, releasing),))] if releasing else []
    node_map.occupy([8 - gpus for gpus in free], terminating)
    return node_map.hostable_ranks(gpus_per_rank)


def test_r2_gang_counts_whole_ranks_only() -> None:
    # R2 is counted by the node map the planner places on.
    assert _hostable([8, 7, 3], 4) == 3
    assert _hostable([3, 3, 3], 4) == 0  # nine free GPUs, no whole rank
    assert _hostable([3, 3, 3], 4, releasing=1) == 1  # releasing GPUs complete a rank


def test_r3_guarantee_line_and_straddling_overshoot() -> None:
    assert r3_guarantee_line(8, 20) == 8
    assert r3_guarantee_line(8, 3) == 3
    assert r3_guarantee_overshoot(12, 8, 4) == 0  # lands on the line
    assert r3_guarantee_overshoot(12, 8, 8) == 4  # straddles: goes whole, overshoots 4
    assert r3_guarantee_overshoot(8, 8, 1) is None  # at the line: never reclaimed


def test_r4_lending_and_borrow_limits() -> None:
    assert r4_lendable_idle(8, 2, None) == 6
    assert r4_lendable_idle(8, 2, 4) == 4
    assert r4_lendable_idle(8, 10, None) == 0
    assert r4_within_borrow_limit(8, 8, 4, 4)
    assert not r4_within_borrow_limit(8, 8, 4, 5)
    assert r4_within_borrow_limit(100, 8, None, 100)


def test_r5_only_preemptible_work_borrows() -> None:
    assert r5_may_use_borrowed(CLS["normal"], 8)
    assert not r5_may_use_borrowed(CLS["critical"], 1)
    assert r5_may_use_borrowed(CLS["critical"], 0)


def test_r6_reclaim_needs_room_in_the_guarantee() -> None:
    assert r6_may_reclaim(0, 8, 8)
    assert not r6_may_reclaim(4, 8, 8)


def test_r7_priority_strictly_lower_preemptible_and_past_min_runtime() -> None:
    assert r7_may_preempt_by_priority(CLS["high"], CLS["low"], 0.0)
    assert not r7_may_preempt_by_priority(CLS["normal"], CLS["polite"], 1e6)  # equal value
    assert not r7_may_preempt_by_priority(CLS["polite"], CLS["low"], 1e6)  # policy Never
    assert not r7_may_preempt_by_priority(CLS["critical"], CLS["pinned"], 1e6)  # not preemptible
    assert not r7_may_preempt_by_priority(CLS["high"], CLS["fresh"], 599.0)
    assert r7_may_preempt_by_priority(CLS["high"], CLS["fresh"], 600.0)


def test_r8_share_and_the_anti_flap_test() -> None:
    assert r8_share(4, 8) == 0.5
    assert r8_share(1, 0) == float("inf")
    # Preemptor 0 -> 8 of fair share 8; victim 16 -> 8 of fair share 8: equal, allowed.
    assert r8_may_preempt_for_fair_share(0, 8, 8, 16, 8, 8)
    # The victim would drop below its own fair share.
    assert not r8_may_preempt_for_fair_share(0, 8, 8, 12, 8, 8)
    # The preemptor would end with a larger share than the victim.
    assert not r8_may_preempt_for_fair_share(4, 8, 8, 12, 8, 4)


def test_r8_water_fill_guarantees_then_weights_capped_by_demand() -> None:
    assert r8_water_fill(24, [0, 0], [24, 24], [0, 0], [2, 1]) == [16, 8]
    assert r8_water_fill(24, [0, 0], [4, 24], [0, 0], [1, 1]) == [4, 20]
    assert r8_water_fill(16, [8, 0], [2, 16], [0, 0], [1, 1]) == [2, 14]
    # A lend limit holds 6 of an idle guarantee of 8 back from the pool.
    assert r8_water_fill(16, [8, 0], [0, 16], [6, 0], [1, 1]) == [0, 10]
    # Guarantees beyond capacity shrink proportionally.
    assert r8_water_fill(8, [8, 8], [8, 8], [0, 0], [1, 1]) == [4, 4]


def test_r9_lost_work_and_victim_order() -> None:
    assert r9_lost_gpu_seconds(8, 1000.0, 100.0, None) == 8 * 900.0
    assert r9_lost_gpu_seconds(8, 1000.0, 100.0, 990.0) == 80.0
    assert r9_lost_gpu_seconds(8, 1000.0, None, None) == 0.0
    keys = sorted(
        [
            r9_victim_order(0, 10.0, 50.0, "a"),
            r9_victim_order(-1, 99.0, 50.0, "b"),
            r9_victim_order(0, 10.0, 60.0, "c"),
            r9_victim_order(0, 5.0, 10.0, "d"),
        ]
    )
    assert [k[3] for k in keys] == ["b", "d", "c", "a"]


def test_r10_place_best_fit_and_packing() -> None:
    assert r10_place(1, 4, {"a": 8, "b": 4, "c": 6}) == (("b", 1),)
    assert r10_place(3, 4, {"a": 8, "b": 4, "c": 2}) == (("a", 2), ("b", 1))
    assert r10_place(2, 8, {"a": 8, "b": 7}) is None


def _one_rank(*gpus: int) -> list[tuple[int, int]]:
    """Moved jobs of one rank of each of ``gpus``, as restart_in_any_order takes them."""
    return [(1, g) for g in gpus]


def test_r10_moved_jobs_restart_in_any_order() -> None:
    # Largest first fits 2, 2, 1 and 1 into 1, 2 and 3 free GPUs; two 1-GPU jobs first
    # leave a 2-GPU job without room.
    assert not restart_in_any_order(Counter([1, 2, 3]), _one_rank(2, 2, 1, 1), None)
    assert restart_in_any_order(Counter([1, 2, 4]), _one_rank(2, 2, 1, 1), None)
    # The gang goes first and takes the node cleared for it; the moved jobs must then
    # restart, in any order, on what it leaves.
    assert not restart_in_any_order(Counter([8, 1, 2, 3]), _one_rank(2, 2, 1, 1), (1, 8))
    assert restart_in_any_order(Counter([8, 1, 2, 4]), _one_rank(2, 2, 1, 1), (1, 8))
    assert restart_in_any_order(Counter([8, 8, 4]), _one_rank(4), (2, 8))
    assert not restart_in_any_order(Counter([8, 8, 3]), _one_rank(4), (2, 8))
    # A moved gang of two 2-GPU ranks, off the node that then has 5 free: planned before
    # the 4-GPU job it moved for, it would take that node (the one node holding both its
    # ranks); after it, a rank goes to each node with 2 free.
    assert restart_in_any_order(Counter([5, 2, 2]), [(2, 2)], (1, 4))
    assert not restart_in_any_order(Counter([5, 2]), [(2, 2)], (1, 4))
    # Many nodes of a size count as many as the ranks placed: 1,000 nodes with one GPU
    # free do not hold a job of two, and two such jobs need two nodes of two.
    assert not restart_in_any_order({1: 1_000, 2: 1}, _one_rank(2, 2), None)
    assert restart_in_any_order({1: 1_000, 2: 2}, _one_rank(2, 2), None)
    # A gang of two 1-GPU ranks spreads over two nodes of 1 when it must, but packs onto
    # the node of 2 when that holds it: planned first, it leaves the 2-GPU job none.
    assert restart_in_any_order({1: 1_000}, [(2, 1)], None)
    assert not restart_in_any_order({1: 1_000, 2: 1}, [(2, 1), (1, 2)], None)
    # A reclaimed job requeued inside its guarantee may come first and take the room:
    # a 6-GPU moved job and a 2-GPU requeued one need 8 free on one node, or two nodes.
    assert restart_in_any_order(Counter([7]), _one_rank(6), None)
    assert not restart_in_any_order(Counter([7]), _one_rank(6), None, [2])
    assert restart_in_any_order(Counter([8]), _one_rank(6), None, [2])
    assert restart_in_any_order(Counter([7, 2]), _one_rank(6), None, [2])
    # One that finds no room waits and takes nothing.
    assert restart_in_any_order(Counter([7]), _one_rank(6), None, [8])


def _place(left: list[int], ranks: int, gpus_per_rank: int) -> bool:
    """Place a gang on the rooms ``left`` (one per node) as NodeMap.place_free does;
    whether it fit."""
    node_map = NodeMap([Node(f"n{i}", "h100", 8) for i in range(len(left))])
    node_map.occupy([8 - room for room in left], [])
    placement = node_map.place_free(ranks, gpus_per_rank)
    if placement is None:
        return False
    for node, count in placement:
        left[node] -= count * gpus_per_rank
    return True


def _starts_in_every_order(
    rooms: list[int], moved: list[tuple[int, int]], gang: tuple[int, int] | None
) -> bool:
    """restart_in_any_order's question answered by placing the gang first and then the
    moved jobs in every order, one room per node, each as NodeMap.place_free places it."""
    first = list(rooms)
    if gang is not None and not _place(first, *gang):
        return False
    for order in set(itertools.permutations(moved)):
        left = list(first)
        for shape in order:
            if not _place(left, *shape):
                return False
    return True


@settings(max_examples=400, deadline=None)
@given(
    rooms=st.lists(st.integers(0, 8), max_size=12),
    moved=st.lists(
        st.sampled_from(((1, 1), (1, 2), (1, 4), (2, 1), (2, 2))), min_size=1, max_size=4
    ),
    gang=st.none() | st.tuples(st.integers(1, 3), st.sampled_from((4, 8))),
)
def test_r10_restart_in_any_order_tries_every_order(
    rooms: list[int], moved: list[tuple[int, int]], gang: tuple[int, int] | None
) -> None:
    assert restart_in_any_order(Counter(rooms), moved, gang) == _starts_in_every_order(
        rooms, moved, gang
    )


def test_r11_releasing_gpus_counted_first() -> None:
    assert r11_releasing_first(8, 4) == 4
    assert r11_releasing_first(3, 4) == 3
    assert r11_releasing_first(0, 4) == 0


def test_diff_lowering_a_guarantee_shows_reclaimed_jobs_and_fair_shares() -> None:
    snapshot = cluster(
        nodes("n", 2, 8),
        [team("a", guarantee=16), team("b")],
        [
            w("a1").gpus(8).running("n0"),
            w("a2").gpus(8).running("n1", since=60),
            w("b1").queue("b").gpus(8),
        ],
    )
    assert run_plan(snapshot).preempt == ()
    consequences = diff(snapshot, [QuotaChange("a", "h100", guarantee=0)])
    assert [(p.id, p.reason, p.preemptor) for p in consequences.reclaimed] == [
        ("a2", "fair-share", "b1")
    ]
    assert consequences.fair_share["a"]["h100"].before == 16
    assert consequences.fair_share["a"]["h100"].after == 8
    assert consequences.fair_share["b"]["h100"].after == 8
    document = consequences_to_dict(consequences)
    assert document["reclaimed"][0]["id"] == "a2"
    assert document["fair_share"]["b"]["h100"] == {"before": 0.0, "after": 8.0}


def test_diff_unknown_queue_is_named() -> None:
    snapshot = cluster(nodes("n", 1, 8), [team("a")], [])
    with pytest.raises(ValueError, match=r"changes\[0\]\.queue"):
        diff(snapshot, [QuotaChange("zz", "h100", guarantee=1)])


@settings(max_examples=200, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(
            st.sampled_from([c.name for c in CLASSES]),
            st.sampled_from((10.0, 20.0, 20.5)),
            st.text("abc", min_size=1, max_size=3),
        ),
        max_size=30,
    )
)
def test_pending_jobs_go_by_priority_then_submission_then_id(
    jobs: list[tuple[str, float, str]],
) -> None:
    pending = [
        PendingJob(w(job_id).cls(name).submitted(ago).build(), 0, CLS[name])
        for name, ago, job_id in jobs
    ]
    in_queue_order(pending)
    # Submitted ``ago`` seconds before the snapshot: the larger, the older.
    expected = sorted((-CLS[name].value, -ago, job_id) for name, ago, job_id in jobs)
    assert [job.workload.id for job in pending] == [job_id for _, _, job_id in expected]


@st.composite
def _node_maps_with_room(draw: st.DrawFn) -> tuple[NodeMap, dict[int, int], dict[str, int]]:
    """A node map with free and releasing GPUs, a ``room_after`` for some of its nodes,
    and every node's room as ``place_on`` counts it (by name)."""
    count = draw(st.integers(1, 12))
    order = draw(st.permutations(range(count)))
    sizes = [draw(st.sampled_from((4, 8))) for _ in range(count)]
    node_map = NodeMap([Node(f"n{order[i]:02d}", "h100", sizes[i]) for i in range(count)])
    held: list[int] = []
    terminating: list[tuple[str, tuple[tuple[int, int], ...]]] = []
    room: dict[str, int] = {}
    room_after: dict[int, int] = {}
    for i, gpus in enumerate(sizes):
        releasing = draw(st.integers(0, gpus))
        free = draw(st.integers(0, gpus - releasing))
        held.append(gpus - free)
        if releasing:
            terminating.append((f"t{i}", ((i, releasing),)))
        room[node_map.names[i]] = free + releasing
        if draw(st.booleans()):
            room_after[i] = free + releasing + draw(st.integers(0, gpus - free - releasing))
            room[node_map.names[i]] = room_after[i]
    node_map.occupy(held, terminating)
    return node_map, room_after, room


@settings(max_examples=300, deadline=None)
@given(
    state=_node_maps_with_room(),
    ranks=st.integers(1, 3),
    gpus_per_rank=st.sampled_from((1, 2, 4)),
)
def test_r10_place_on_gives_a_gang_that_fits_one_node_its_best_fit(
    state: tuple[NodeMap, dict[int, int], dict[str, int]], ranks: int, gpus_per_rank: int
) -> None:
    node_map, room_after, room = state
    assume(any(gpus >= ranks * gpus_per_rank for gpus in room.values()))
    expected = r10_place(ranks, gpus_per_rank, room)
    assert expected is not None and len(expected) == 1
    placement = node_map.place_on(ranks, gpus_per_rank, room_after)
    assert placement is not None
    assert [(node_map.names[node], on_node) for node, on_node in placement] == list(expected)


def test_shrink_costs_less_wins_a_tie_and_goes_by_priority_then_lost_work() -> None:
    """A shrink loses what evicting the same gang loses at once, and an evicted gang
    also waits to come back: a tie goes to the shrink. Otherwise the cheaper wins, the
    lower priority first (R9)."""
    assert shrink_costs_less((0.0, 4800.0), (0.0, 4800.0))
    assert shrink_costs_less((0.0, 4800.0), (0.0, 14400.0))
    assert not shrink_costs_less((0.0, 4800.0), (0.0, 1200.0))
    assert shrink_costs_less((-1.0, 99999.0), (0.0, 1.0))
    assert not shrink_costs_less((100.0, 1.0), (0.0, 99999.0))


def test_may_grow_only_an_elastic_gang_below_its_largest_size_of_a_class_that_allows_it() -> None:
    gang = w("e").gang(8, 1).elastic(2, 4, 8)
    assert may_grow(gang.at(4).running("n0").build(), True)
    assert not may_grow(gang.at(4).running("n0").build(), False)
    assert not may_grow(w("f").gang(8, 1).elastic(2, 4, 8).running("n0").build(), True)
    assert not may_grow(w("g").gang(4, 1).running("n0").build(), True)
