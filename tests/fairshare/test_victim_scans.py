"""The victim scans of one plan, looked at from inside: what a reclaim scan offers when
a donor's own work of this plan was withdrawn and admitted again."""

from __future__ import annotations

from fairshare_builders import cluster, nodes, team
from fairshare_builders import workload as w

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
