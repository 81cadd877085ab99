"""The victim scans of one plan: what a reclaim scan offers when a donor's own work of
this plan was withdrawn and admitted again (looked at from inside), and when a queue
whose fair-share search found nothing searches again."""

from __future__ import annotations

from fairshare_builders import cluster, nodes, preempted, reasons, run_plan, team
from fairshare_builders import workload as w

from fairshare import Node
from fairshare.cycle import FlavorPlanner
from fairshare.tree import prepare


def test_a_job_admitted_again_after_giving_way_is_offered_to_reclaim_once() -> None:
    # b runs r1 (2 GPUs) under its line of 4; the plan's admissions take b above its
    # guarantee, so reclaim may take b's work of this plan, and only that.
    snapshot = cluster(
        nodes("n", 2, 8),
        [team("a", guarantee=8), team("b", guarantee=4)],
        [
            w("r1").queue("b").gpus(2).running("n0"),
            w("b1").queue("b").gpus(4),
            w("b2").queue("b").cls("high").gpus(4),
        ],
    )
    tree, classes, _ = prepare(snapshot)
    planner = FlavorPlanner(snapshot, tree, classes, "h100", list(snapshot.workloads))
    pending = {job.workload.id: job for jobs in planner.pending for job in jobs}
    b = tree.index["b"]
    # b1 is admitted, gives way to b2 (the search that took it gave its usage back),
    # and is admitted again: both its admissions have the same place in the order.
    planner._admit(pending["b1"], [(1, 1)])
    (first,) = planner.victims.by_queue[b][:1]
    planner.ledger.add_usage(b, -first.gpus)
    planner._take(pending["b2"], [(first, "priority")], [(1, 1)])
    planner._admit(pending["b1"], [(0, 1)])
    live = [run for run in planner.victims.by_queue[b] if not run.victim]
    assert first.victim
    assert first.order in [run.order for run in live]
    assert sorted(planner.admissions) == ["b1", "b2"]

    offered = [run.workload.id for run, _ in planner.victims.reclaim(tree.index["a"])]

    # b1 once; b2 is shielded (taken, it would take b1's place by priority), r1 runs
    # under b's line.
    assert offered == ["b1"]


def test_a_queue_dry_for_fair_share_searches_again_once_new_candidates_come() -> None:
    # a0 (4 GPUs) finds the free GPUs scattered (3 on n0, 2 on n1) and no queue above
    # its fair share: its search finds nothing. c3 is admitted on n1, which takes c
    # above its fair share of 2; in the next pass a0 searches again, and c1 on n0
    # goes, leaving n0 whole for a0.
    snapshot = cluster(
        nodes("n", 2, 4),
        [team("a", weight=3), team("c"), team("d", guarantee=2)],
        [
            w("c1").queue("c").gpus(1).running("n0"),
            w("d1").queue("d").gpus(2).running("n1"),
            w("a0").queue("a").gpus(4).submitted(30),
            w("c3").queue("c").gpus(2).submitted(20),
        ],
    )
    result = run_plan(snapshot)
    assert preempted(result) == {"c1": "fair-share"}
    assert reasons(result) == {"a0": "waiting for 1 GPUs being released by job c1"}


def test_a_queue_whose_fair_share_candidates_are_all_protected_is_not_dry() -> None:
    # b's work started 10 s ago, inside its minimum runtime for fair share: a1's
    # search passes it over, and a2 (more GPUs) still searches, so its reason names
    # the protected jobs too.
    snapshot = cluster(
        nodes("n", 1, 8),
        [team("a"), team("b")],
        [
            *(w(f"b{i}").queue("b").gpus(1).running("n0", since=10) for i in range(8)),
            w("a1").queue("a").gpus(1).submitted(20),
            w("a2").queue("a").gpus(2).submitted(10),
        ],
    )
    result = run_plan(snapshot)
    assert preempted(result) == {}
    assert reasons(result)["a1"].startswith("no node of flavor h100 has 1 free GPUs; job b0 ")
    assert reasons(result)["a2"].startswith(
        "no node of flavor h100 has 2 free GPUs; jobs b0, b1 may be preempted (fair-share)"
        " only after their minimum runtime"
    )


def test_a_domain_search_that_passed_candidates_over_leaves_its_queue_searching() -> None:
    # b runs above its fair share (4 of 12) on the unracked nodes n1 and n2; its jobs on
    # rack r0 are non-preemptible. a0 needs one rack: the fair-share scan offers it b's
    # jobs, none of them in r0, and a0 waits. That scan was not dry, so a1 (as many GPUs,
    # any node) still searches, and b's jobs on one node go for it.
    snapshot = cluster(
        [
            Node("n0", "h100", 4, topology={"rack": "r0"}),
            Node("n1", "h100", 4),
            Node("n2", "h100", 4),
        ],
        [team("a", weight=3), team("b")],
        [
            *(w(f"p{i}").queue("b").cls("critical").gpus(1).running("n0") for i in range(4)),
            *(w(f"b{i}").queue("b").gpus(1).running(f"n{1 + i // 4}") for i in range(8)),
            w("a0").queue("a").gpus(4).within("rack").submitted(30),
            w("a1").queue("a").gpus(4).submitted(20),
        ],
    )
    result = run_plan(snapshot)
    assert set(preempted(result)) in ({"b0", "b1", "b2", "b3"}, {"b4", "b5", "b6", "b7"})
    assert set(preempted(result).values()) == {"fair-share"}
    assert reasons(result)["a0"].startswith("no rack of flavor h100 has room")
    assert reasons(result)["a1"].startswith("waiting for 4 GPUs being released")
