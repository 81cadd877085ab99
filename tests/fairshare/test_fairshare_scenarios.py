"""The scenario table: one named case per line, covering every rule R1-R11.

Each case builds a small cluster, plans it and states the exact admissions and
preemptions (with reasons) and, for waiting workloads, words their reason must contain.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pytest
from fairshare_builders import (
    WorkloadBuilder,
    admitted,
    cluster,
    nodes,
    plain,
    preempted,
    racks,
    reasons,
    resized,
    run_plan,
    team,
)
from fairshare_builders import workload as w

from fairshare import Node, Queue
from fairshare.native import python_sources, running_compiled

N2 = nodes("n", 2, 8)
N3 = nodes("n", 3, 8)
N4 = nodes("n", 4, 8)
AB = [team("a", guarantee=8), team("b", guarantee=8)]
AB0 = [team("a"), team("b")]
# A three-level tree: org -> ml -> (vision, nlp) beside the top-level team ops.
TREE = [
    team("org", guarantee=16),
    team("ml", "org", guarantee=16),
    team("vision", "ml", guarantee=8),
    team("nlp", "ml", guarantee=8),
    team("ops", guarantee=8),
]

# Two cases found by random scenarios run from outside (../shared/cases/), with the classes
# mapped to this table's: prod -> critical, batch-high -> high, batch -> polite. Times are
# seconds before the snapshot, as in the original files (now = 1000).
N1_4 = [Node(f"n{i}", "h100", 8) for i in range(1, 5)]
N1_6 = [Node(f"n{i}", "h100", 8) for i in range(1, 7)]
# q2 runs r4 and r5 (r2 terminates) under its guarantee of 5 while its pending p11 reserves
# 8 GPUs that r1 releases. q1 (r1 terminating, borrow limit 2) reserves the rest and is
# left with p12 and no free GPU: r5 must not go "for fair share" because q2's own
# reservation made it look above its fair share.
BORROWER_QUEUES = [
    team("q0", guarantee=9),
    team("q1", guarantee=11, weight=2, borrow_limit=2),
    team("q2", guarantee=5, weight=3),
]
BORROWER = [
    w("r1").queue("q1").cls("critical").gang(4, 4).terminating("n1", "n2"),
    w("r2").queue("q2").cls("polite").terminating("n4"),
    w("r3").queue("q0").cls("polite").gpus(2).running("n3", since=242, checkpoint=100),
    w("r4").queue("q2").cls("critical").running("n4", since=101),
    w("r5").queue("q2").cls("polite").running("n3", since=403, checkpoint=153),
    w("r6").queue("q0").cls("polite").gang(2, 2).running("n3", since=559),
    w("p7").queue("q1").cls("polite").gang(4, 1).submitted(242),
    w("p8").queue("q1").cls("polite").gang(2, 8).submitted(858),
    w("p9").queue("q0").cls("critical").gang(2, 1).submitted(633),
    w("p10").queue("q2").cls("polite").gang(2, 1).submitted(277),
    w("p11").queue("q2").cls("polite").gang(4, 2).submitted(228),
    w("p12").queue("q1").cls("polite").submitted(45),
    w("p13").queue("q1").cls("high").gpus(8).submitted(823),
    w("p14").queue("q1").cls("high").gpus(8).submitted(144),
]
# q1 runs 13 of its 17 guaranteed GPUs; this plan admits its non-preemptible p12 (8 GPUs on
# the free n6). q0's p13 (non-preemptible, 8 GPUs) could fit on n5 only by preempting q0's
# own r7 and reclaiming q1's r1: q1 must not lose r1, since only its new p12 puts it
# above its line. p13 waits (the next plan may take r1, once q1 runs above its line).
RECLAIM_QUEUES = [team("q0", guarantee=19), team("q1", guarantee=17)]
RECLAIM = [
    w("r1").queue("q1").cls("polite").running("n5", since=181, checkpoint=147),
    w("r2").queue("q0").cls("critical").gpus(8).running("n1", since=722),
    w("r3").queue("q1").cls("polite").running("n4", since=769),
    w("r4").queue("q0").cls("critical").gpus(2).terminating("n2"),
    w("r5").queue("q1").cls("high").running("n2", since=959, checkpoint=84),
    w("r6").queue("q1").cls("high").gang(2, 1).running("n4", since=277),
    w("r7").queue("q0").cls("polite").gang(2, 4).running("n5", "n2", since=431, checkpoint=15),
    w("r8").queue("q1").cls("polite").gpus(8).running("n3", since=989),
    w("p9").queue("q1").cls("high").gang(2, 4).submitted(310),
    w("p10").queue("q1").cls("high").gpus(8).submitted(918),
    w("p11").queue("q0").cls("critical").submitted(734),
    w("p12").queue("q1").cls("critical").gang(2, 4).submitted(435),
    w("p13").queue("q0").cls("critical").gpus(8).submitted(268),
    w("p14").queue("q0").cls("polite").gang(4, 2).submitted(466),
    w("p15").queue("q1").cls("polite").submitted(408),
    w("p16").queue("q0").cls("high").gpus(4).submitted(77),
    w("p17").queue("q0").cls("high").submitted(862),
]

# Found by test_no_flapping (shrunk): t1k0g1 runs w1 on the GPUs of its sibling t1k0g0's
# idle guarantee; w3 terminates. t1k0g0's w8 fits inside its own guarantee but takes t1
# beyond its guarantee, while t0k0g0's w6 fits inside every guarantee on its path. Planned
# first (t1k0g0 is furthest below its fair share), w8 took n1's free GPUs and w3's; w6 then
# found none and could not reclaim w1 in this plan (t1 ran only its guarantee before it),
# so the next plan reclaimed w1 for w6 after all. Planned after w6, w8 reclaims w1 itself.
N_4_16 = [Node("n0", "h100", 4), Node("n1", "h100", 16)]
PARENT_OVER_LINE_QUEUES = [
    team("t0"),
    team("t0k0", "t0"),
    team("t0k0g0", "t0k0", guarantee=5),
    team("t0k0g1", "t0k0"),
    team("t0k1", "t0"),
    team("t0k2", "t0"),
    team("t1"),
    team("t1k0", "t1"),
    team("t1k0g0", "t1k0", guarantee=8),
    team("t1k0g1", "t1k0"),
]
PARENT_OVER_LINE = [
    w("w0").queue("t0k0g0").cls("critical").submitted(1).running("n0", since=0),
    w("w1").queue("t1k0g1").cls("high").gpus(8).submitted(1).running("n1", since=0),
    w("w2").queue("t0k0g0").cls("critical").submitted(1),
    w("w3").queue("t0k0g0").cls("critical").gpus(4).submitted(1).terminating("n1"),
    *(w(f"w{i}").queue("t0k0g0").cls("critical").submitted(1) for i in (4, 5, 6, 7)),
    w("w8").queue("t1k0g0").cls("critical").gpus(8).submitted(1),
]


@dataclass(frozen=True)
class Case:
    name: str
    nodes: Sequence[Node]
    queues: Sequence[Queue]
    workloads: Sequence[WorkloadBuilder]
    admit: set[str] = field(default_factory=set)
    preempt: Mapping[str, str] = field(default_factory=dict)
    wait: Mapping[str, str] = field(default_factory=dict)
    fair_share: Mapping[str, float] = field(default_factory=dict)
    placement: Mapping[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    borrowed: Mapping[str, int] = field(default_factory=dict)
    # The size each admitted workload starts at (an elastic one's among its sizes).
    ranks: Mapping[str, int] = field(default_factory=dict)
    usage_strength: float = 0.0
    # Running elastic gangs resized: the ranks each runs at after the plan, and where.
    resize: Mapping[str, int] = field(default_factory=dict)
    resized_on: Mapping[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    # Each queue's h100 GPUs in use after the plan (a resized gang at its new size).
    usage: Mapping[str, int] = field(default_factory=dict)


# Decayed usage: a used the spare node for three days of the last week, b nothing; both
# wait for the one free node with equal demand, a's job submitted first.
WEEK = 7 * 86_400
N1 = nodes("n", 1, 8)
HEAVY_A = [team("a", recent=8 * 3 * 86_400), team("b")]
BOTH_WAIT = [w("a1").gpus(8).submitted(900), w("b1").queue("b").gpus(8).submitted(10)]
# Guaranteed GPUs used all week do not count as borrowing: a's 4 GPUs held for the week
# (in decayed GPU-seconds) are its own, so it keeps its place.
OWN_A = [team("a", guarantee=4, recent=4 * WEEK / math.log(2)), team("b", guarantee=4)]

# Kueue #10815: b borrows a's guarantee with one job on each of four nodes in two racks;
# a's gang needs one whole rack. Its cheapest victims (least work lost) are b0 and b2, one
# in each rack; the fix clears one rack instead.
RACKS = racks(2, 2, 8)
KUEUE_10815 = [
    w("b0").queue("b").gpus(8).running("n0", since=100),
    w("b1").queue("b").gpus(8).running("n1", since=3000),
    w("b2").queue("b").gpus(8).running("n2", since=200),
    w("b3").queue("b").gpus(8).running("n3", since=300),
    w("gang").gang(2, 8).within("rack"),
]

# A full cluster of small jobs (found replaying the openb trace): b borrows 11 GPUs on both
# nodes, but each node also runs work of c, which is under its guarantee. Reclaim alone
# clears no node for a's 8-GPU job, and consolidation finds no free GPU to move c0 to:
# reclaim b0 on n0 and b1 on n1, where c0 restarts, so a's job gets n0 in one grace window.
AC_B = [team("a", guarantee=8), team("b"), team("c", guarantee=8)]
NO_HOLE = [
    w("b0").queue("b").gpus(7).running("n0"),
    w("c0").queue("c").gpus(1).running("n0"),
    w("b1").queue("b").gpus(4).running("n1"),
    w("c1").queue("c").gpus(4).running("n1"),
    w("a1").gpus(8),
]

# Moving n0's four small jobs would give a's 8-GPU job n0, and holes for them exist (1, 2
# and 3 GPUs free on n1-n3, the 2-GPU jobs first). But the next plan restarts them in queue
# order, each on the node with the least room that holds it: with b2 and b3 (1 GPU each)
# first, b3 takes n2's 2 GPUs and one 2-GPU job has no room. No move, then; with 4 GPUs
# free on n3, every order restarts them all.
# No node can be cleared by reclaim alone (each runs one of c's jobs, c at its line) and
# no GPU is free to move to. Clearing n0 moves c0 (1 GPU) into the hole of one of b's
# jobs on another node: the smallest one large enough, b2 (2 GPUs), not b3 (3) or b1 (4).
SMALLEST_HOLE = [
    *NO_HOLE[:4],
    w("b2").queue("b").gpus(2).running("n2"),
    w("b3").queue("b").gpus(3).running("n2"),
    w("c2").queue("c").gpus(3).running("n2"),
    w("a1").gpus(8),
]

# Clearing n1 for a's gang would reclaim b2 there and move a3 to n0, where reclaiming b0
# makes room. But b falls to 1 GPU, under its guarantee of 3: requeued, b2 is work inside
# its guarantee, older than the gang, and takes 2 of the 7 GPUs on n0 first in the next
# plan; a3 (6 GPUs) would find no room and preempt in turn. No move, then.
REQUEUED_FIRST = [
    w("b0").queue("b").cls("low").gpus(6).running("n0", since=0),
    w("c0").queue("c").gpus(1).running("n0", since=0),
    w("b2").queue("b").cls("low").gpus(2).running("n1", since=1).submitted(11),
    w("a3").cls("low").gpus(6).running("n1", since=600),
    w("b4").queue("b").gpus(1).running("n2", since=0),
    w("c5").queue("c").gpus(1).running("n2", since=0),
    w("c6").queue("c").gpus(1).running("n2", since=599),
    *(w(f"c{i}").queue("c").gpus(2).running("n2", since=599) for i in (7, 8)),
    w("gang").gpus(8).submitted(5),
]

B_AT_LINE = [team("a", guarantee=8), team("b", guarantee=24)]
# b's jobs that started a minute ago (too young to move), as (node, GPUs).
YOUNG = [("n1", 1), ("n1", 2), ("n1", 2), ("n1", 2), ("n2", 4), ("n2", 1), ("n2", 1), ("n3", 1)]
ORDER_BOUND = [
    w("b0").queue("b").gpus(2).running("n0", since=3000),
    w("b1").queue("b").gpus(2).running("n0", since=3000),
    w("b2").queue("b").gpus(1).running("n0", since=3000).submitted(4000),
    w("b3").queue("b").gpus(1).running("n0", since=3000).submitted(4000),
    *(w(f"y{i}").queue("b").gpus(g).running(n, since=60) for i, (n, g) in enumerate(YOUNG)),
    w("y8").queue("b").gpus(4).running("n3", since=60),
    w("a1").gpus(8),
]

# Team c (no guarantee) holds n0 and seven of n1's GPUs, c5 and c6 the youngest (the
# cheapest victims). a (guarantee 6, two jobs: 2 GPUs below its fair share) and b
# (guarantee 2, one older job: 1 below) wait inside their guarantees for the one free GPU:
# the oldest job takes it, the others reclaim (../shared/cases/guarantee-handoff/ over many
# cycles: by fair share, a's jobs took every GPU freed for b's).
HANDOFF_QUEUES = [team("a", guarantee=6), team("b", guarantee=2), team("c")]
HANDOFF = [
    w("c_n0").queue("c").gpus(8).running("n0"),
    *(w(f"c{i}").queue("c").gpus(1).running("n1") for i in range(5)),
    w("c5").queue("c").gpus(1).running("n1", since=10),
    w("c6").queue("c").gpus(1).running("n1", since=20),
    w("a1").gpus(1).submitted(10),
    w("a2").gpus(1).submitted(5),
    w("b1").queue("b").gpus(1).submitted(50),
]

# Team a (guarantee 16) runs a0 on n0 and waits with a1, inside its guarantee and older
# than b's b1, for whose sake c's v is being preempted on n1. By age a1 goes first; the
# GPUs v frees stay with b1, which found nothing else to take (a0 is inside a's line),
# rather than go to a1 and leave v's work lost for a job that still waits.
KEPT_QUEUES = [team("a", guarantee=16), team("b", guarantee=8), team("c")]
KEPT = [
    w("a0").gpus(8).running("n0"),
    w("a1").gpus(8).submitted(50),
    w("b1").queue("b").gpus(8).submitted(10),
]

# One line per case, as in a table.
# fmt: off
CASES = [
    Case("releasing_gpus_stay_with_the_job_they_are_freed_for", N2, KEPT_QUEUES, [*KEPT, w("v").queue("c").gpus(8).terminating("n1", freed_for="b1")], wait={"b1": "waiting for 8 GPUs being released by job v", "a1": "no node of flavor h100 has 8 free GPUs"}),
    Case("releasing_gpus_go_to_all_once_their_job_is_gone", N2, KEPT_QUEUES, [*KEPT[:2], w("v").queue("c").gpus(8).terminating("n1", freed_for="b9")], wait={"a1": "waiting for 8 GPUs being released by job v"}),
    Case("releasing_gpus_go_to_the_next_job_when_theirs_starts_elsewhere", N3, KEPT_QUEUES, [w("a0").gpus(8).running("n0"), w("a1").gpus(8).submitted(10), w("b1").queue("b").gpus(8).submitted(50), w("v").queue("c").gpus(8).terminating("n1", freed_for="b1")], admit={"b1"}, placement={"b1": (("n2", 1),)}, wait={"a1": "waiting for 8 GPUs being released by job v"}),
    Case("free_gpus_beside_the_victims_stay_with_their_job", N2, KEPT_QUEUES, [w("a0").gpus(8).running("n0"), w("a1").gpus(2).submitted(50), w("b1").queue("b").gpus(8).submitted(10), w("v").queue("c").gpus(6).terminating("n1", freed_for="b1")], wait={"b1": "waiting for 6 GPUs being released by job v", "a1": "no node of flavor h100 has 2 free GPUs"}),
    Case("admit_on_free_gpus", N2, AB, [w("a1").gpus(4)], admit={"a1"}, placement={"a1": (("n0", 1),)}),
    Case("borrow_idle_guarantee", N2, AB, [w("b1").queue("b").gpus(8).running("n0"), w("b2").queue("b").gpus(8)], admit={"b2"}, borrowed={"b2": 8}),
    Case("lend_then_reclaim", N2, AB, [w("b1").queue("b").gpus(8).running("n0"), w("b2").queue("b").gpus(8).running("n1", since=60), w("a1").gpus(8)], preempt={"b2": "reclaim"}, wait={"a1": "waiting for 8 GPUs being released by job b2"}),
    Case("reclaim_whatever_priority", N2, AB, [w("b1").queue("b").priority(100).gpus(8).running("n0"), w("b2").queue("b").priority(100).gpus(8).running("n1", since=60), w("a1").priority(-1).gpus(8)], preempt={"b2": "reclaim"}),
    Case("reclaim_whatever_policy", N2, AB, [w("b1").queue("b").priority(100).gpus(8).running("n0"), w("b2").queue("b").priority(100).gpus(8).running("n1", since=60), w("a1").cls("polite").gpus(8)], preempt={"b2": "reclaim"}),
    Case("guarantee_protects_queue_at_its_line", N2, [*AB, team("c")], [w("a1").gpus(8).running("n0"), w("b1").queue("b").gpus(8).running("n1"), w("c1").queue("c").priority(100).gpus(8)], wait={"c1": "no node of flavor h100 has 8 free GPUs"}),
    Case("no_reclaim_beyond_own_guarantee", N2, AB, [w("a1").gpus(8).running("n0"), w("b1").queue("b").gpus(8).running("n1"), w("a2").gpus(8)], wait={"a2": "free GPUs"}),
    Case("priority_preemption_inside_queue", N2, [team("a", guarantee=16)], [w("lo").priority(-1).gpus(8).running("n0"), w("x").gpus(8).running("n1"), w("hi").priority(100).gpus(8)], preempt={"lo": "priority"}, wait={"hi": "released by job lo"}),
    Case("priority_policy_never_does_not_preempt", N2, [team("a", guarantee=16)], [w("lo").priority(-1).gpus(8).running("n0"), w("x").gpus(8).running("n1"), w("p").cls("polite").gpus(8)], wait={"p": "free GPUs"}),
    Case("priority_needs_strictly_lower_class", N2, [team("a", guarantee=16)], [w("x").gpus(8).running("n0"), w("y").gpus(8).running("n1"), w("z").gpus(8)], wait={"z": "free GPUs"}),
    Case("non_preemptible_never_a_victim", N2, [team("a", guarantee=16)], [w("pin").priority(-5).gpus(8).running("n0"), w("x").priority(100).gpus(8).running("n1"), w("hi").priority(100).gpus(8)], wait={"hi": "free GPUs"}),
    Case("non_preemptible_never_on_borrowed_gpus", N2, AB, [w("crit").queue("b").cls("critical").gpus(8).running("n0"), w("crit2").queue("b").cls("critical").gpus(8)], wait={"crit2": "non-preemptible work cannot run on borrowed GPUs"}),
    Case("non_preemptible_within_guarantee_admitted", N2, AB, [w("crit").cls("critical").gpus(8)], admit={"crit"}, borrowed={"crit": 0}),
    Case("borrow_limit_blocks", N3, [team("a", guarantee=8), team("b", guarantee=8, borrow_limit=4)], [w("b1").queue("b").gpus(8).running("n0"), w("b2").queue("b").gpus(8)], wait={"b2": "team b at its borrow limit of 4 h100 GPUs"}),
    Case("borrow_limit_allows_up_to_it", N3, [team("a", guarantee=8), team("b", guarantee=8, borrow_limit=8)], [w("b1").queue("b").gpus(8).running("n0"), w("b2").queue("b").gpus(8)], admit={"b2"}, borrowed={"b2": 8}),
    Case("lend_limit_holds_idle_guarantee_back", N2, [team("a", guarantee=8, lend_limit=0), team("b", guarantee=8)], [w("b1").queue("b").gpus(8).running("n0"), w("b2").queue("b").gpus(8)], wait={"b2": "lend limits"}),
    Case("lend_limit_lends_part", N2, [team("a", guarantee=8, lend_limit=4), team("b", guarantee=8)], [w("b1").queue("b").gpus(8).running("n0"), w("b2").queue("b").gpus(4).submitted(50), w("b3").queue("b").gpus(4).submitted(10)], admit={"b2"}, wait={"b3": "lend limits"}),
    Case("three_level_tree_lends_to_siblings_first", N3, TREE, [w("n1").queue("nlp").gpus(8).running("n0"), w("o1").queue("ops").gpus(8).running("n1"), w("o2").queue("ops").gpus(8).submitted(500), w("n2").queue("nlp").gpus(8)], admit={"n2"}, wait={"o2": "free GPUs"}, fair_share={"nlp": 16, "ops": 8, "vision": 0}),
    Case("three_level_tree_reclaims_from_other_branch", N3, TREE, [w("o1").queue("ops").gpus(8).running("n0"), w("o2").queue("ops").gpus(8).running("n1", since=10), w("o3").queue("ops").gpus(8).running("n2", since=20), w("v1").queue("vision").gpus(8)], preempt={"o2": "reclaim"}),
    Case("parent_guarantee_shared_by_weight", N2, [team("p", guarantee=16), team("x", "p", weight=3), team("y", "p", weight=1)], [w("x1").queue("x").gpus(8), w("x2").queue("x").gpus(8), w("y1").queue("y").gpus(8).submitted(500), w("y2").queue("y").gpus(8).submitted(500)], admit={"x1", "y1"}, wait={"x2": "free GPUs", "y2": "free GPUs"}, fair_share={"x": 12, "y": 4, "p": 16}),
    Case("weighted_division_of_the_surplus", N3, [team("a", weight=2), team("b", weight=1)], [w("a1").gpus(24), w("b1").queue("b").gpus(24)], fair_share={"a": 16, "b": 8}, wait={"a1": "no node of flavor h100 has 24 GPUs"}),
    Case("fair_share_capped_by_demand", N3, AB0, [w("a1").gpus(4), w("b1").queue("b").gpus(8), w("b2").queue("b").gpus(8), w("b3").queue("b").gpus(8)], fair_share={"a": 4, "b": 20}, admit={"a1", "b1", "b2"}, wait={"b3": "free GPUs"}),
    Case("fair_share_preemption_between_borrowers", N2, AB0, [w("a1").gpus(8).running("n0"), w("a2").gpus(8).running("n1", since=60), w("b1").queue("b").gpus(8)], preempt={"a2": "fair-share"}, wait={"b1": "released by job a2"}),
    Case("anti_flap_no_preemption_at_equal_shares", N2, AB0, [w("a1").gpus(8).running("n0"), w("b1").queue("b").gpus(8).running("n1"), w("b2").queue("b").gpus(8)], wait={"b2": "free GPUs"}, fair_share={"a": 8, "b": 8}),
    Case("anti_flap_victim_must_stay_at_its_fair_share", N2, AB0, [w("cheap").gpus(8).running("n0", since=10), w("dear").gpus(4).running("n1"), w("b1").queue("b").gpus(8)], preempt={"dear": "fair-share"}),
    Case("anti_flap_between_borrowers_unequal_costs", N3, [*AB0, team("c")], [w("a1").gpus(8).running("n0"), w("a2").gpus(8).running("n1", checkpoint=5), w("b1").queue("b").gpus(8).running("n2", checkpoint=1), w("c1").queue("c").gpus(8)], preempt={"a2": "fair-share"}),
    Case("node_aware_frees_one_whole_node", N3, [team("a", guarantee=24), team("b")], [w("b_n0a").queue("b").gpus(4).running("n0", since=50), w("b_n0b").queue("b").gpus(4).running("n0", since=50), w("spread").queue("b").gang(2, 4).running("n1", "n2", since=100), w("b_n1").queue("b").gpus(4).running("n1", since=10), w("b_n2").queue("b").gpus(4).running("n2", since=10), w("a1").gpus(8)], preempt={"b_n0a": "reclaim", "b_n0b": "reclaim"}),
    Case("node_aware_drops_useless_cheap_victim", N2, [team("a", guarantee=16), team("b")], [w("cheap").queue("b").gpus(4).running("n1", since=50), w("pin").queue("b").gpus(4).running("n1", since=5000), w("whole").queue("b").gpus(8).running("n0", since=100), w("a1").gpus(8)], preempt={"whole": "reclaim"}),
    Case("node_aware_clears_whole_nodes_for_a_gang", N4, [team("a", guarantee=16), team("b", guarantee=8), team("c", guarantee=8)], [w("c0").queue("c").gpus(4).running("n0"), w("c1").queue("c").gpus(4).running("n1"), *(w(f"b{n}_{i}").queue("b").gpus(1).running(f"n{n}", since=10) for n in (0, 1) for i in range(4)), w("b2").queue("b").gpus(8).running("n2", since=3600), w("b3").queue("b").gpus(8).running("n3", since=3600), w("a1").gang(2, 8)], preempt={"b2": "reclaim", "b3": "reclaim"}, wait={"a1": "released by job"}),
    Case("consolidate_moves_the_smallest_job_for_a_gang_inside_its_guarantee", N2, AB, [w("b1").queue("b").gpus(4).running("n0"), w("b2").queue("b").gpus(2).running("n1"), w("a1").gpus(8)], preempt={"b2": "consolidate"}, wait={"a1": "released by job b2"}),
    Case("consolidate_never_moves_a_job_that_just_started", N2, AB, [w("b1").queue("b").gpus(4).running("n0", since=300), w("b2").queue("b").gpus(2).running("n1", since=300), w("a1").gpus(8)], wait={"a1": "no node of flavor h100 has 8 free GPUs"}),
    Case("consolidate_only_inside_the_guarantee", N2, [team("a", guarantee=4), team("b", guarantee=12)], [w("b1").queue("b").gpus(4).running("n0"), w("b2").queue("b").gpus(2).running("n1"), w("a1").gpus(8)], wait={"a1": "no node of flavor h100 has 8 free GPUs"}),
    Case("consolidate_only_when_every_moved_job_restarts_in_any_order", N4, B_AT_LINE, ORDER_BOUND, wait={"a1": "no node of flavor h100 has 8 free GPUs"}),
    Case("consolidate_moves_when_every_order_restarts_the_moved_jobs", N4, B_AT_LINE, [*ORDER_BOUND[:-2], w("y8").queue("b").gpus(3).running("n3", since=60), w("a1").gpus(8)], preempt={"b0": "consolidate", "b1": "consolidate", "b2": "consolidate", "b3": "consolidate"}, wait={"a1": "released by jobs"}),
    Case("consolidate_keeps_the_hole_for_the_moved_job", N2, AB, [w("b1").queue("b").gpus(4).running("n0"), w("b2").queue("b").gpus(2).running("n1"), w("a1").gpus(8), w("b3").queue("b").gpus(4).submitted(50)], preempt={"b2": "consolidate"}, wait={"a1": "released by job b2", "b3": "4 free GPUs"}),
    Case("consolidate_spreads_a_gang_of_small_ranks_over_the_holes", N3, [team("a", guarantee=5), team("b", guarantee=19)], [w("b1").queue("b").gpus(6).running("n0"), w("b2").queue("b").gpus(6).running("n1"), w("bm").queue("b").gang(2, 2).running("n2"), w("b3").queue("b").gpus(3).running("n2", since=300), w("a1").gpus(4)], preempt={"bm": "consolidate"}, wait={"a1": "released by job bm"}),
    Case("consolidate_moves_no_gang_whose_ranks_find_no_holes", N3, [team("a", guarantee=5), team("b", guarantee=19)], [w("b1").queue("b").gpus(7).running("n0"), w("b2").queue("b").gpus(6).running("n1"), w("bm").queue("b").gang(2, 2).running("n2"), w("b3").queue("b").gpus(2).running("n2", since=300), w("a1").gpus(4)], wait={"a1": "no node of flavor h100 has 4 free GPUs"}),
    Case("a_requeued_victim_is_planned_after_the_job_it_gave_way_to", N1, [team("a", guarantee=4), team("b", guarantee=4), team("c")], [w("c1").queue("c").cls("critical").gpus(4).running("n0"), w("bv").queue("a").gpus(4).submitted(500).gave_way_to("a2"), w("a2").queue("b").gpus(4).submitted(50)], admit={"a2"}, wait={"bv": "no node of flavor h100 has 4 free GPUs"}),
    Case("a_requeued_victim_goes_in_its_turn_once_that_job_is_not_pending", N1, [team("a", guarantee=4), team("b", guarantee=4), team("c")], [w("c1").queue("c").cls("critical").gpus(4).running("n0"), w("bv").queue("a").gpus(4).submitted(500).gave_way_to("gone"), w("a2").queue("b").gpus(4).submitted(50)], admit={"bv"}, wait={"a2": "no node of flavor h100 has 4 free GPUs"}),
    Case("terminating_victims_counted_first", N2, AB, [w("b1").queue("b").gpus(8).terminating("n0"), w("b2").queue("b").gpus(8).running("n1"), w("a1").gpus(8)], wait={"a1": "waiting for 8 GPUs being released by job b1"}),
    Case("releasing_gpus_never_promised_twice", N3, [team("a", guarantee=16), team("b", guarantee=8)], [w("b1").queue("b").gpus(8).terminating("n0"), w("b2").queue("b").gpus(8).running("n1"), w("b3").queue("b").gpus(8).running("n2", since=60), w("a1").gpus(8).submitted(50), w("a2").gpus(8).submitted(40)], preempt={"b3": "reclaim"}, wait={"a1": "released by job b1", "a2": "released by job b3"}),
    Case("gang_admitted_whole_or_not_at_all", N2, AB0, [w("x").gpus(4).running("n1"), w("g").gang(3, 4)], admit={"g"}, placement={"g": (("n0", 2), ("n1", 1))}),
    Case("gang_waits_whole_when_one_rank_misses", N2, AB0, [w("x").gpus(6).running("n1"), w("g").gang(3, 4)], wait={"g": "3 ranks of 4 GPUs do not fit"}),
    Case("gang_preempted_whole", N2, [team("a", guarantee=8), team("b")], [w("bg").queue("b").gang(2, 4).running("n0", "n1"), w("b2").queue("b").gpus(4).running("n0", since=7200), w("b3").queue("b").gpus(4).running("n1", since=7200), w("a1").gpus(4)], preempt={"bg": "reclaim"}, wait={"a1": "released by job bg"}),
    Case("gang_straddling_guarantee_line_goes_whole", N2, [team("a", guarantee=12), team("b", guarantee=4)], [w("a0").gpus(4).running("n1"), w("bg").queue("b").gpus(8).running("n0"), w("a1").gpus(8)], preempt={"bg": "reclaim"}),
    Case("straddlers_last_smallest_overshoot_first", N2, [team("a", guarantee=8), team("b", guarantee=8)], [w("a0").gpus(4).running("n1"), w("b1").queue("b").gpus(8).running("n0", since=10), w("b2").queue("b").gpus(4).running("n1"), w("a1").gpus(4)], preempt={"b2": "reclaim"}),
    Case("min_runtime_protects_from_priority", N2, [team("a", guarantee=16)], [w("f").cls("fresh").gpus(8).running("n0", since=60), w("x").priority(100).gpus(8).running("n1"), w("hi").priority(100).gpus(8)], wait={"hi": "free GPUs"}),
    Case("min_runtime_expired_allows_priority", N2, [team("a", guarantee=16)], [w("f").cls("fresh").gpus(8).running("n0", since=3600), w("x").gpus(8).running("n1"), w("hi").priority(100).gpus(8)], preempt={"f": "priority"}),
    Case("min_runtime_never_protects_borrowed_gpus", N2, AB, [w("b1").queue("b").gpus(8).running("n0"), w("f").queue("b").cls("fresh").gpus(8).running("n1", since=60), w("a1").gpus(8)], preempt={"f": "reclaim"}),
    Case("min_runtime_per_class_protects_from_reclaim", N2, AB, [w("b1").queue("b").cls("low").gpus(8).running("n0"), w("s").queue("b").cls("steady").gpus(8).running("n1", since=60), w("a1").gpus(8)], preempt={"b1": "reclaim"}),
    Case("min_runtime_reclaim_protected_says_until_when", N2, AB, [w("s0").queue("b").cls("steady").gpus(8).running("n0", since=60), w("s1").queue("b").cls("steady").gpus(8).running("n1", since=300), w("a1").gpus(8)], wait={"a1": "job s0 may be preempted (reclaim) only after their minimum runtime, at 1970-01-01 03:00:40 UTC (in 840 s)"}),
    Case("min_runtime_shielded_victim_waits_for_protected_lower_work", N2, AB, [w("b1").queue("b").gpus(8).running("n0"), w("s").queue("b").cls("steady").gpus(8).running("n1", since=60), w("a1").gpus(8)], wait={"a1": "job s may be preempted (reclaim) only after their minimum runtime"}),
    Case("min_runtime_reclaim_expired_allows_reclaim", N2, AB, [w("s0").queue("b").cls("steady").gpus(8).running("n0", since=900), w("s1").queue("b").cls("steady").gpus(8).running("n1", since=300), w("a1").gpus(8)], preempt={"s0": "reclaim"}),
    Case("min_runtime_per_class_never_below_the_anti_flap_margin", N2, AB0, [w("f0").cls("nimble").gpus(8).running("n0", since=30), w("f1").cls("nimble").gpus(8).running("n1", since=30), w("b1").queue("b").gpus(8)], wait={"b1": "job f0 may be preempted (fair-share) only after their minimum runtime"}),
    Case("min_runtime_per_class_raises_fair_share", N2, AB0, [w("f0").cls("steady").gpus(8).running("n0", since=300), w("f1").cls("steady").gpus(8).running("n1", since=300), w("b1").queue("b").gpus(8)], wait={"b1": "(in 600 s)"}),
    Case("min_runtime_fair_share_says_until_when", N2, AB0, [w("f0").cls("low").gpus(8).running("n0", since=30), w("f1").cls("low").gpus(8).running("n1", since=20), w("b1").queue("b").gpus(8)], wait={"b1": "no node of flavor h100 has 8 free GPUs; job f1 may be preempted (fair-share) only after their minimum runtime"}),
    Case("min_runtime_priority_says_until_when", N2, [team("a", guarantee=16)], [w("f").cls("fresh").gpus(8).running("n0", since=60), w("g").cls("fresh").gpus(8).running("n1", since=120), w("hi").priority(100).gpus(8)], wait={"hi": "job f may be preempted (priority) only after their minimum runtime, at 1970-01-01 02:55:40 UTC (in 540 s)"}),
    Case("min_runtime_protects_from_fair_share", N2, AB0, [w("f0").cls("fresh").gpus(8).running("n0", since=60), w("f1").cls("fresh").gpus(8).running("n1", since=60), w("b1").queue("b").gpus(8)], wait={"b1": "free GPUs"}),
    Case("blocked_job_does_not_block_others", N2, AB, [w("big").gpus(16).submitted(500), w("small").gpus(4)], admit={"small"}, wait={"big": "no node of flavor h100 has 16 GPUs"}),
    Case("no_node_has_enough_free_gpus", [Node("m0", "h100", 16)], [team("a", guarantee=16)], [w("x").gpus(4).running("m0"), w("big").gpus(16)], wait={"big": "no node of flavor h100 has 16 free GPUs"}),
    Case("queue_furthest_below_fair_share_first", N3, [team("a", guarantee=16), team("b")], [w("a0").gpus(8).running("n0"), w("b0").queue("b").gpus(8).running("n1"), w("b1").queue("b").gpus(8).submitted(900), w("a1").gpus(8).submitted(10)], admit={"a1"}, wait={"b1": "free GPUs"}),
    Case("inside_own_guarantee_oldest_first_across_queues", N2, HANDOFF_QUEUES, HANDOFF, admit={"b1"}, preempt={"c5": "reclaim", "c6": "reclaim"}, wait={"a1": "released by job c5", "a2": "released by job c6"}),
    Case("ties_go_to_older_submission", N3, AB0, [w("a0").gpus(8).running("n0"), w("b0").queue("b").gpus(8).running("n1"), w("a1").gpus(8).submitted(10), w("b1").queue("b").gpus(8).submitted(900)], admit={"b1"}, wait={"a1": "free GPUs"}),
    Case("inside_queue_priority_then_age", N2, AB, [w("x").gpus(8).running("n0"), w("old").gpus(8).submitted(900), w("hi").priority(100).gpus(8).submitted(5)], admit={"hi"}, wait={"old": "free GPUs"}),
    Case("cheapest_victim_lower_priority_first", N3, AB, [w("b0").queue("b").gpus(8).running("n0"), w("b_low").queue("b").priority(-1).gpus(8).running("n1", since=7200), w("b_norm").queue("b").gpus(8).running("n2", since=60), w("a1").gpus(8)], preempt={"b_low": "reclaim"}),
    Case("cheapest_victim_least_lost_work", N3, AB, [w("b0").queue("b").gpus(8).running("n0"), w("b_old").queue("b").gpus(8).running("n1", since=7200, checkpoint=30), w("b_new").queue("b").gpus(8).running("n2", since=600), w("a1").gpus(8)], preempt={"b_old": "reclaim"}),
    Case("priority_victim_returns_quota_held_by_lend_limit", [Node("big", "h100", 16), Node("small", "h100", 8)], [team("a"), team("lender", guarantee=16, lend_limit=0)], [w("lo").priority(-1).gpus(8).running("big"), w("hi").priority(100).gpus(8)], preempt={"lo": "priority"}, wait={"hi": "waiting for job lo to exit and return quota"}),
    Case("guarantee_no_fair_share_victim_because_of_own_reservation", N1_4, BORROWER_QUEUES, BORROWER, admit={"p9", "p10"}, wait={"p13": "released by job r1", "p11": "released by job r1", "p14": "team q1 at its borrow limit of 2", "p8": "team q1 at its borrow limit of 2", "p7": "waiting for 1 GPUs being released by job r2", "p12": "no node of flavor h100 has 1 free GPUs"}, fair_share={"q0": 8, "q1": 13, "q2": 11}),
    Case("guarantee_no_reclaim_because_of_own_new_admission", N1_6, RECLAIM_QUEUES, RECLAIM, admit={"p11", "p12", "p15", "p16", "p17"}, preempt={"r8": "priority"}, wait={"p13": "no node of flavor h100 has 8 free GPUs", "p14": "no node of flavor h100 has 8 free GPUs", "p9": "no node of flavor h100 has 8 free GPUs", "p10": "waiting for 8 GPUs being released by job r8"}, fair_share={"q0": 25, "q1": 23}),
    Case("decayed_usage_orders_teams_below_fair_share", N1, HEAVY_A, BOTH_WAIT, admit={"b1"}, wait={"a1": "team a used 2.0× its share of the spare h100 GPUs over the last week: its fair share is 0.5 GPUs instead of 4.0"}, fair_share={"a": 0.5 / 8.5 * 8, "b": 8 / 8.5 * 8}, usage_strength=1.0),
    Case("decayed_usage_strength_zero_is_weight_alone", N1, HEAVY_A, BOTH_WAIT, admit={"a1"}, wait={"b1": "no node of flavor h100 has 8 free GPUs"}, fair_share={"a": 4, "b": 4}),
    Case("decayed_usage_of_the_own_guarantee_is_not_borrowing", N1, OWN_A, BOTH_WAIT, admit={"a1"}, wait={"b1": "no node of flavor h100 has 8 free GPUs"}, fair_share={"a": 4, "b": 4}, usage_strength=1.0),
    Case("reclaim_and_move_when_no_node_can_be_cleared_by_either", N2, AC_B, NO_HOLE, preempt={"b0": "reclaim", "c0": "consolidate", "b1": "reclaim"}, wait={"a1": "waiting for 8 GPUs being released"}),
    Case("reclaim_and_move_clears_the_other_node_when_one_small_job_is_young", N2, AC_B, [NO_HOLE[0], w("c0").queue("c").gpus(1).running("n0", since=60), *NO_HOLE[2:]], preempt={"b1": "reclaim", "c1": "consolidate", "b0": "reclaim"}, wait={"a1": "waiting for 8 GPUs being released"}),
    Case("reclaim_and_move_takes_the_smallest_hole_large_enough", N3, AC_B, SMALLEST_HOLE, preempt={"b0": "reclaim", "c0": "consolidate", "b2": "reclaim"}, wait={"a1": "waiting for 8 GPUs being released"}),
    Case("reclaim_and_move_keeps_no_room_a_reclaimed_job_may_take_first", N3, [team("a", guarantee=14), team("b", guarantee=3), team("c", guarantee=7)], REQUEUED_FIRST, wait={"gang": "no node of flavor h100 has 8 free GPUs"}),
    Case("reclaim_and_move_spares_young_small_jobs", N2, AC_B, [NO_HOLE[0], w("c0").queue("c").gpus(1).running("n0", since=60), NO_HOLE[2], w("c1").queue("c").gpus(4).running("n1", since=60), NO_HOLE[4]], wait={"a1": "no node of flavor h100 has 8 free GPUs"}),
    Case("topology_reclaim_clears_one_whole_rack", RACKS, [team("a", guarantee=16), team("b", guarantee=16)], KUEUE_10815, admit=set(), preempt={"b2": "reclaim", "b3": "reclaim"}, wait={"gang": "waiting for"}),
    Case("topology_blind_reclaim_scatters_victims", RACKS, [team("a", guarantee=16), team("b", guarantee=16)], [*KUEUE_10815[:-1], w("gang").gang(2, 8)], preempt={"b0": "reclaim", "b2": "reclaim"}),
    Case("topology_reclaim_never_takes_a_donor_below_its_guarantee", RACKS, [team("a", guarantee=16), team("b", guarantee=8), team("c", guarantee=8)], [w("b0").queue("b").gpus(8).running("n0", since=100), w("b1").queue("b").gpus(8).running("n1", since=200), w("c0").queue("c").gpus(8).running("n2", since=100), w("c1").queue("c").gpus(8).running("n3", since=200), w("gang").gang(2, 8).within("rack")], wait={"gang": "no rack of flavor h100 has room for 2 ranks of 8 GPUs together"}),
    Case("topology_free_gpus_tightest_rack_first", RACKS, AB, [w("x").queue("b").gpus(4).running("n0"), w("g").gang(2, 4).within("rack")], admit={"g"}, placement={"g": (("n1", 2),)}),
    Case("topology_required_waits_when_no_rack_has_room", RACKS, AB, [w("x").queue("b").gpus(4).running("n0"), w("y").queue("b").gpus(4).running("n2"), w("g").gang(3, 8).within("rack")], wait={"g": "no rack of flavor h100 has room for 3 ranks of 8 GPUs together"}),
    Case("topology_preferred_falls_back_to_any_nodes", RACKS, AB, [w("x").queue("b").gpus(8).running("n0"), w("y").queue("b").gpus(8).running("n2"), w("g").gang(2, 8).within("rack", required=False)], admit={"g"}, placement={"g": (("n1", 1), ("n3", 1))}),
    Case("inside_parent_guarantee_before_borrowing", N1, [team("a", guarantee=4), team("b", guarantee=4), team("bx", "b", guarantee=2), team("by", "b")], [w("hi").cls("high").gpus(1).running("n0", since=60), w("pin").cls("critical").gpus(4), w("bx0").queue("bx").cls("critical").gpus(2).running("n0"), w("x").queue("bx").cls("high").gpus(2)], admit={"x"}, preempt={"hi": "priority"}, wait={"pin": "waiting for 1 GPUs being released by job hi"}),
    Case("inside_own_guarantee_beyond_parents_goes_after_work_inside_every_guarantee", N_4_16, PARENT_OVER_LINE_QUEUES, PARENT_OVER_LINE, admit={"w2", "w4", "w5", "w6"}, preempt={"w1": "reclaim"}, wait={"w8": "being released by job w1", "w7": "non-preemptible work cannot run on borrowed GPUs"}),
    Case("elastic_admitted_at_its_full_size_when_it_fits", N2, AB0, [w("x").queue("b").gpus(4).running("n1"), w("e").gang(8, 1).elastic(2, 4, 8)], admit={"e"}, placement={"e": (("n0", 8),)}, ranks={"e": 8}),
    Case("elastic_admitted_at_the_largest_size_free_gpus_hold", N2, AB0, [w("x").queue("b").gpus(8).running("n0"), w("y").queue("b").gpus(4).running("n1"), w("e").gang(8, 1).elastic(2, 4, 8)], admit={"e"}, placement={"e": (("n1", 4),)}, ranks={"e": 4}),
    Case("elastic_skips_a_size_it_does_not_allow", N2, AB0, [w("x").queue("b").gpus(8).running("n0"), w("y").queue("b").gpus(5).running("n1"), w("e").gang(8, 1).elastic(2, 4, 8)], admit={"e"}, placement={"e": (("n1", 2),)}, ranks={"e": 2}),
    Case("elastic_admitted_at_the_largest_size_its_quota_allows", N3, [team("a", guarantee=8, borrow_limit=0), team("b", guarantee=8)], [w("e").gang(4, 4).elastic(1, 2, 4)], admit={"e"}, placement={"e": (("n0", 2),)}, ranks={"e": 2}, borrowed={"e": 0}),
    Case("elastic_preempts_only_for_its_smallest_size", N2, AB, [w("b0").queue("b").gpus(8).running("n0", since=3600), w("b1").queue("b").gpus(8).running("n1", since=600), w("e").gang(4, 4).elastic(2, 4)], preempt={"b1": "reclaim"}, wait={"e": "waiting for 8 GPUs being released by job b1"}),
    Case("elastic_waits_when_its_smallest_size_does_not_fit", N1, AB0, [w("x").queue("b").gpus(8).running("n0"), w("e").gang(4, 2).elastic(2, 4)], wait={"e": "no node of flavor h100 has 4 free GPUs"}),
    Case("elastic_admitted_smaller_leaves_room_for_the_next_job", N2, AB0, [w("x").queue("b").gpus(4).running("n0"), w("e").gang(16, 1).elastic(4, 8, 16).submitted(900), w("f").gpus(4).submitted(10)], admit={"e", "f"}, ranks={"e": 8, "f": 1}),
    Case("elastic_borrows_no_gpu_that_another_teams_guarantee_waits_for", N1, [team("a", guarantee=4), team("b", guarantee=4)], [w("e").gang(8, 1).elastic(2, 4, 8).submitted(900), w("f").queue("b").gang(8, 1).elastic(1, 4, 8).submitted(10)], admit={"e", "f"}, ranks={"e": 4, "f": 4}),
    Case("elastic_shrunk_for_reclaim", N2, AB, [w("e").queue("b").cls("elastic").gang(8, 1).elastic(2, 4, 8).running("n0"), w("x").queue("b").cls("critical").gpus(8).running("n1"), w("a1").gpus(4)], resize={"e": 4}, resized_on={"e": (("n0", 4),)}, wait={"a1": "waiting for 4 GPUs being released by job e"}, usage={"a": 0, "b": 12}),
    Case("elastic_shrunk_for_priority", N2, AB0, [w("e").cls("elastic-low").gang(8, 1).elastic(2, 4, 8).running("n0"), w("x").queue("b").cls("critical").gpus(8).running("n1"), w("hi").priority(100).gpus(4)], resize={"e": 4}, wait={"hi": "waiting for 4 GPUs being released by job e"}),
    Case("elastic_shrunk_for_fair_share", N2, AB0, [w("e").queue("b").cls("elastic").gang(8, 1).elastic(2, 4, 8).running("n0"), w("y").queue("b").gpus(8).running("n1"), w("a1").gpus(4)], resize={"e": 4}, wait={"a1": "waiting for 4 GPUs being released by job e"}, usage={"a": 0, "b": 12}),
    Case("elastic_shrink_gives_the_ranks_on_the_node_the_job_goes_to", N2, [team("a", guarantee=8), team("b", guarantee=4)], [w("e").queue("b").cls("elastic").gang(8, 1).elastic(2, 4, 8).running("n0", "n1"), w("x").cls("critical").gpus(2).running("n1"), w("a1").gpus(6)], resize={"e": 4}, resized_on={"e": (("n1", 4),)}, wait={"a1": "released by job e"}),
    Case("elastic_shrunk_when_it_loses_less_than_an_eviction", N2, [team("a", guarantee=8), team("b", guarantee=8)], [w("e").queue("b").cls("elastic").gang(8, 1).elastic(2, 4, 8).running("n0", since=600), w("z").queue("b").gpus(4).running("n1", since=3600), w("x").cls("critical").gpus(4).running("n1"), w("a1").gpus(4)], resize={"e": 4}, wait={"a1": "released by job e"}),
    Case("elastic_kept_whole_when_an_eviction_loses_less", N2, [team("a", guarantee=8), team("b", guarantee=8)], [w("e").queue("b").cls("elastic").gang(8, 1).elastic(2, 4, 8).running("n0", since=600), w("z").queue("b").gpus(4).running("n1", since=300), w("x").cls("critical").gpus(4).running("n1"), w("a1").gpus(4)], preempt={"z": "reclaim"}, wait={"a1": "released by job z"}),
    Case("elastic_shrunk_to_return_quota_held_by_lend_limit", [Node("big", "h100", 16), Node("small", "h100", 8)], [team("a"), team("lender", guarantee=16, lend_limit=0)], [w("lo").cls("elastic-low").gang(8, 1).elastic(4, 8).running("big"), w("hi").priority(100).gpus(4)], resize={"lo": 4}, wait={"hi": "waiting for job lo to shrink and return quota"}),
    Case("elastic_never_shrunk_below_its_smallest_size", N2, AB, [w("e").queue("b").cls("elastic").gang(8, 1).elastic(4, 8).running("n0"), w("x").queue("b").cls("critical").gpus(8).running("n1"), w("a1").gpus(6)], preempt={"e": "reclaim"}, wait={"a1": "released by job e"}),
    Case("elastic_at_its_smallest_size_is_evicted", N2, AB, [w("e").queue("b").cls("elastic").gang(16, 1).elastic(8, 16).at(8).running("n0"), w("x").queue("b").cls("critical").gpus(8).running("n1"), w("a1").gpus(4)], preempt={"e": "reclaim"}),
    Case("elastic_of_a_class_that_does_not_shrink_is_evicted", N2, AB, [w("e").queue("b").gang(8, 1).elastic(2, 4, 8).running("n0"), w("x").queue("b").cls("critical").gpus(8).running("n1"), w("a1").gpus(4)], preempt={"e": "reclaim"}, wait={"a1": "released by job e"}),
    Case("elastic_shrink_waits_for_the_minimum_runtime", N2, AB0, [w("e").queue("b").cls("elastic").gang(8, 1).elastic(2, 4, 8).running("n0", since=30), w("y").queue("b").gpus(8).running("n1"), w("a1").gpus(4)], wait={"a1": "no node of flavor h100 has 4 free GPUs"}),
    Case("elastic_shrink_waits_for_the_class_minimum_runtime", N2, AB0, [w("e").cls("elastic-fresh").gang(8, 1).elastic(2, 4, 8).running("n0", since=300), w("x").queue("b").cls("critical").gpus(8).running("n1"), w("hi").priority(100).gpus(4)], wait={"hi": "no node of flavor h100 has 4 free GPUs"}),
    Case("elastic_grows_when_its_team_has_room", N2, AB0, [w("e").cls("elastic").gang(8, 1).elastic(2, 4, 8).at(4).running("n0")], resize={"e": 8}, resized_on={"e": (("n0", 8),)}, usage={"a": 8}),
    Case("elastic_grows_onto_other_nodes_after_its_own", N2, AB0, [w("e").cls("elastic").gang(8, 1).elastic(2, 4, 8).at(4).running("n0"), w("x").queue("b").cls("critical").gpus(4).running("n0")], resize={"e": 8}, resized_on={"e": (("n0", 4), ("n1", 4))}),
    Case("elastic_grows_only_to_a_size_its_quota_allows", N2, [team("a", borrow_limit=4), team("b")], [w("e").cls("elastic").gang(8, 1).elastic(2, 4, 8).at(2).running("n0")], resize={"e": 4}, usage={"a": 4}),
    Case("elastic_does_not_grow_before_its_minimum_runtime", N2, AB0, [w("e").cls("elastic").gang(8, 1).elastic(2, 4, 8).at(4).running("n0", since=30)]),
    Case("elastic_does_not_grow_by_borrowing_what_another_team_waits_for", N2, AB0, [w("e").cls("elastic").gang(8, 1).elastic(4, 8).at(4).running("n0"), w("x").queue("b").cls("critical").gpus(4).running("n1"), w("b1").queue("b").gpus(8)], wait={"b1": "no node of flavor h100 has 8 free GPUs"}),
    Case("elastic_grows_inside_its_guarantee_while_another_team_waits", N2, [team("a", guarantee=8), team("b")], [w("e").cls("elastic").gang(8, 1).elastic(4, 8).at(4).running("n0"), w("x").queue("b").cls("critical").gpus(4).running("n1"), w("b1").queue("b").gpus(8)], resize={"e": 8}, wait={"b1": "no node of flavor h100 has 8 free GPUs"}),
    Case("elastic_does_not_grow_while_higher_work_of_its_team_waits", N2, AB0, [w("e").cls("elastic-low").gang(8, 1).elastic(4, 8).at(4).running("n0"), w("x").queue("b").cls("critical").gpus(4).running("n1"), w("hi").cls("polite").gpus(8)], wait={"hi": "no node of flavor h100 has 8 free GPUs"}),
    Case("unknown_flavor_waits_with_reason", N2, AB, [w("x").flavor("a100").gpus(1)], wait={"x": "no node of flavor a100 exists"}),
]
# fmt: on


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_scenario(case: Case) -> None:
    snapshot = cluster(case.nodes, case.queues, case.workloads)
    p = run_plan(dataclasses.replace(snapshot, usage_strength=case.usage_strength))
    assert admitted(p) == case.admit
    assert preempted(p) == dict(case.preempt)
    waiting = reasons(p)
    for workload_id, words in case.wait.items():
        assert words in waiting[workload_id], waiting
    for queue, share in case.fair_share.items():
        assert p.queues[queue]["h100"].fair_share == pytest.approx(share)
    placements = {a.id: a.placement for a in p.admit}
    for workload_id, placement in case.placement.items():
        assert placements[workload_id] == placement
    sizes = {a.id: a.ranks for a in p.admit}
    for workload_id, ranks in case.ranks.items():
        assert sizes[workload_id] == ranks
    borrowed = {a.id: a.borrowed for a in p.admit}
    for workload_id, gpus in case.borrowed.items():
        assert borrowed[workload_id] == gpus
    assert resized(p) == dict(case.resize)
    resizes = {r.workload: r.placement for r in p.resize}
    for workload_id, placement in case.resized_on.items():
        assert resizes[workload_id] == placement
    for queue, gpus in case.usage.items():
        assert p.queues[queue]["h100"].usage == gpus
    # Every pending workload gets exactly one decision: admitted or waiting.
    pending = {x.build().id for x in case.workloads if x.build().state == "pending"}
    assert admitted(p) | set(waiting) == pending
    assert not admitted(p) & set(waiting)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_compiled_engine_plans_the_scenario_as_its_sources_do(case: Case) -> None:
    snapshot = cluster(case.nodes, case.queues, case.workloads)
    snapshot = dataclasses.replace(snapshot, usage_strength=case.usage_strength)
    compiled = run_plan(snapshot)
    assert running_compiled(), "the engine is not compiled here: run `make engine`"
    assert plain(compiled) == plain(python_sources().plan(snapshot))


def test_the_table_is_large_enough() -> None:
    assert len(CASES) >= 30
    assert len({c.name for c in CASES}) == len(CASES)
