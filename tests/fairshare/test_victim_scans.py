"""The victim scans of one plan: what a reclaim scan offers when a donor's own work of
this plan was withdrawn and admitted again (looked at from inside), when a queue
whose fair-share search found nothing searches again, a priority search that reads
again what the failed reclaim search before it read, shielded candidates passed over
before they are popped, and donors judged by their parents' standing once per scan."""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator, Sequence

import pytest
from fairshare_builders import (
    WorkloadBuilder,
    cluster,
    nodes,
    plain,
    preempted,
    reasons,
    run_plan,
    team,
)
from fairshare_builders import workload as w

from fairshare import Node, PriorityClass, Snapshot, Workload
from fairshare.cycle import FlavorPlanner
from fairshare.native import python_sources
from fairshare.reclaim_scan import closed_below_lca
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


def _full_nodes(
    rng: random.Random, queues: Sequence[str], classes: Sequence[str]
) -> list[WorkloadBuilder]:
    """24 nodes of 8 GPUs filled with running jobs of 1, 2 or 4 GPUs, each of a queue and
    a class drawn from ``queues`` and ``classes``."""
    work = []
    for node in range(24):
        left = 8
        while left:
            gpus = min(left, rng.choice((1, 2, 4)))
            left -= gpus
            queue = rng.choice(queues)
            cls = rng.choice(classes)
            work.append(w(f"r{len(work)}").queue(queue).cls(cls).gpus(gpus).running(f"n{node}"))
    return work


def _reclaim_scans_and_plan(snapshot: Snapshot, *, kept: bool) -> tuple[int, object]:
    """The engine's sources plan ``snapshot``: how many reclaim scans began, and the plan.
    With ``kept`` False no scan's candidates are read again (every search scans anew)."""
    sources = python_sources()
    candidates = sources.candidates
    scans = 0
    scan = candidates.VictimCandidates.reclaim

    def counted(self: object, queue: int) -> Iterator[object]:
        nonlocal scans
        scans += 1
        yield from scan(self, queue)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(candidates.VictimCandidates, "reclaim", counted)
        if not kept:
            patch.setattr(sources.reclaim_scan.ReclaimStream, "complete", lambda self, cap: False)
        result = sources.plan(snapshot)
    return scans, plain(result)


def test_a_priority_search_after_a_failed_reclaim_search_reads_its_candidates_again() -> None:
    # a (guarantee 10) runs a-low (2 GPUs) beside b's borrowed b1 (6) on n0; c runs at its
    # guarantee on n1 and n2, beside b's b2 (2) on n2. a-high (8 GPUs) may reclaim, but b's
    # jobs alone clear no node: that search fails. Its priority search takes a-low and then
    # the same reclaim candidates, and b1 with a-low clear n0.
    snapshot = cluster(
        nodes("n", 3, 8),
        [team("a", guarantee=10), team("b"), team("c", guarantee=14)],
        [
            w("a-low").queue("a").cls("low").gpus(2).running("n0"),
            w("b1").queue("b").gpus(6).running("n0"),
            w("c1").queue("c").gpus(8).running("n1"),
            w("c2").queue("c").gpus(6).running("n2"),
            w("b2").queue("b").gpus(2).running("n2"),
            w("a-high").queue("a").cls("high").gpus(8).submitted(10),
        ],
    )
    scans, result = _reclaim_scans_and_plan(snapshot, kept=True)
    scans_anew, result_anew = _reclaim_scans_and_plan(snapshot, kept=False)

    assert result == result_anew == plain(run_plan(snapshot))
    assert preempted(run_plan(snapshot)) == {"a-low": "priority", "b1": "reclaim"}
    # The priority search read the failed search's candidates rather than scanning again.
    assert (scans, scans_anew) == (1, 2)


@pytest.mark.parametrize("seed", range(4))
def test_plans_are_the_same_whether_reclaim_candidates_are_read_again_or_scanned_anew(
    seed: int,
) -> None:
    # A full cluster of small jobs over six queues, half of them guaranteed a third of it
    # and half borrowing, and whole-node or half-node jobs waiting: many reclaim searches
    # fail and are followed by priority searches.
    rng = random.Random(seed)
    queues = [team(f"q{i}", guarantee=64 if i % 2 else 0) for i in range(6)]
    work = _full_nodes(rng, [f"q{i}" for i in range(6)], ("low", "normal", "high"))
    for i in range(40):
        queue = f"q{rng.randrange(6)}"
        cls = rng.choice(("normal", "high", "critical"))
        work.append(w(f"p{i}").queue(queue).cls(cls).gpus(rng.choice((4, 8))).submitted(i))
    snapshot = cluster(nodes("n", 24, 8), queues, work)

    scans, result = _reclaim_scans_and_plan(snapshot, kept=True)
    scans_anew, result_anew = _reclaim_scans_and_plan(snapshot, kept=False)

    assert result == result_anew == plain(run_plan(snapshot))
    assert preempted(run_plan(snapshot))
    assert scans < scans_anew


def _multi_level_cluster(seed: int) -> Snapshot:
    """A full cluster under a two-level tree (three departments of three teams, some
    departments guaranteed more than their teams' sum, some less), each team running a
    mix of low, normal and high work, and whole-node or smaller jobs waiting: many donors
    run above their own line under a department at or under its line, and much of the
    normal work is shielded by low work of its own team."""
    rng = random.Random(seed)
    queues = []
    leaves = []
    for d in range(3):
        queues.append(team(f"d{d}", guarantee=rng.choice((0, 40, 80))))
        for t in range(3):
            name = f"d{d}t{t}"
            queues.append(team(name, f"d{d}", guarantee=rng.choice((0, 8, 16, 32))))
            leaves.append(name)
    work = _full_nodes(rng, leaves, ("low", "normal", "normal", "high"))
    for i in range(40):
        cls = rng.choice(("normal", "high", "critical"))
        gpus = rng.choice((2, 4, 8))
        work.append(w(f"p{i}").queue(rng.choice(leaves)).cls(cls).gpus(gpus).submitted(i))
    return cluster(nodes("n", 24, 8), queues, work)


def _record_pops(patch: pytest.MonkeyPatch, popped: list[str]) -> None:
    """Make the victim scans of the engine's sources append to ``popped`` the id of
    every candidate they pop from their heaps."""
    candidates = python_sources().candidates
    position = candidates._scan_position

    def recorded(entry: object) -> tuple[int, int, list[object]]:
        donor, at, runs = position(entry)
        popped.append(runs[at].workload.id)
        return donor, at, runs

    patch.setattr(candidates, "_scan_position", recorded)


def _pops_and_plan(snapshot: Snapshot, *, pass_over_shielded: bool) -> tuple[int, object]:
    """The engine's sources plan ``snapshot``: how many candidates the victim scans
    popped, and the plan. With ``pass_over_shielded`` False a scan pops shielded
    candidates and steps past them, as it did before they were passed over."""
    sources = python_sources()
    candidates = sources.candidates
    popped: list[str] = []

    def entry_of_first_live(self: object, donor: int, runs: list[object], start: int) -> object:
        start = candidates.next_live(runs, start)
        if start < len(runs):
            return candidates.ScanEntry(runs[start], donor, start, runs)
        return None

    with pytest.MonkeyPatch.context() as patch:
        _record_pops(patch, popped)
        if not pass_over_shielded:
            patch.setattr(candidates.VictimCandidates, "_entry_from", entry_of_first_live)
        result = sources.plan(snapshot)
    return len(popped), plain(result)


@pytest.mark.parametrize("seed", range(4))
def test_plans_are_the_same_whether_scans_pop_shielded_candidates_or_pass_them_over(
    seed: int,
) -> None:
    snapshot = _multi_level_cluster(seed)

    pops, result = _pops_and_plan(snapshot, pass_over_shielded=True)
    pops_before, result_before = _pops_and_plan(snapshot, pass_over_shielded=False)

    assert result == result_before == plain(run_plan(snapshot))
    assert preempted(run_plan(snapshot))
    assert pops < pops_before


def test_a_scan_passes_over_a_shielded_candidate_without_popping_it() -> None:
    # b borrows with b-low (2 GPUs), b-normal (1) and b-big (4), cheapest first in that
    # order; b-normal is shielded by b-low (requeued, it would take b-low's place by
    # priority), b-big is not (b-low is too small for it). a's reclaim scan offers b-low
    # and then b-big, and no longer pops b-normal on the way.
    snapshot = cluster(
        nodes("n", 1, 8),
        [team("a", guarantee=8), team("b")],
        [
            w("b-low").queue("b").cls("low").gpus(2).running("n0"),
            w("b-normal").queue("b").gpus(1).running("n0"),
            w("b-big").queue("b").gpus(4).running("n0"),
        ],
    )
    tree, classes, _ = prepare(snapshot)
    sources = python_sources()
    pops: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        _record_pops(patch, pops)
        planner = sources.cycle.FlavorPlanner(
            snapshot, tree, classes, "h100", list(snapshot.workloads)
        )
        offered = [run.workload.id for run, _ in planner.victims.reclaim(tree.index["a"])]

    assert offered == ["b-low", "b-big"]
    assert pops == ["b-low", "b-big"]


@pytest.mark.parametrize("seed", range(6))
def test_a_parent_closed_below_the_common_ancestor_is_judged_as_each_donors_chain(
    seed: int,
) -> None:
    # closed_below_lca against the walk it spares: for every asking queue and every donor,
    # the donor's parent is closed exactly when a queue of the donor's chain above the
    # donor holds at most its line (with and without this plan's admissions).
    rng = random.Random(seed)
    queues = [team("top", guarantee=rng.randrange(0, 60))]
    for d in range(3):
        queues.append(team(f"d{d}", "top", guarantee=rng.randrange(0, 30)))
        for t in range(3):
            queues.append(team(f"d{d}t{t}", f"d{d}", guarantee=rng.randrange(0, 12)))
    queues.append(team("other", guarantee=rng.randrange(0, 20)))
    snapshot = cluster(nodes("n", 1, 8), queues)
    tree, classes, _ = prepare(snapshot)
    planner = FlavorPlanner(snapshot, tree, classes, "h100", [])
    ledger = planner.ledger
    count = len(tree.names)
    held = [rng.randrange(0, 60) for _ in range(count)]
    if seed % 2:
        # The top holds nothing: every department under it is closed for "other".
        held[tree.index["top"]] = 0
    ledger.waiting_usage[:] = [rng.randrange(0, 6) for _ in range(count)]
    ledger.planned_usage[:] = [rng.randrange(0, 6) for _ in range(count)]
    ledger.line[:] = [rng.randrange(0, 40) for _ in range(count)]
    leaves = [q for q in range(count) if not tree.children[q]]
    closed_somewhere = 0
    for without_planned in (False, True):
        for queue in leaves:
            closed = closed_below_lca(tree, queue, held, ledger, without_planned)
            for donor in leaves:
                above = tree.parent[donor]
                if donor == queue or above == -1:
                    continue
                chain = tree.lca_chains(queue, donor)[0]
                walked = any(
                    held[x]
                    - ledger.waiting_usage[x]
                    - (ledger.planned_usage[x] if without_planned else 0)
                    <= ledger.line[x]
                    for x in chain[1:]
                )
                assert closed[above] == walked, (tree.names[queue], tree.names[donor])
                closed_somewhere += walked
    assert closed_somewhere


@pytest.mark.parametrize("engine", ["loaded", "sources"])
@pytest.mark.parametrize("seed", range(3))
def test_scan_entries_go_in_the_order_of_the_tuples_they_stand_for(engine: str, seed: int) -> None:
    # A heap entry compares its candidate's R9 order part by part, then its queue and
    # index, as the tuple (order..., queue, index) did: many ties on the priority, on
    # the lost GPU-seconds and on the admission, and an order equal to the last part.
    from fairshare import candidates as loaded_candidates
    from fairshare import work as loaded_work

    rng = random.Random(seed)
    candidates = python_sources().candidates if engine == "sources" else loaded_candidates
    work = python_sources().work if engine == "sources" else loaded_work
    low, normal = (
        PriorityClass("low", -1, "Never", True, 30.0),
        PriorityClass("normal", 0, "PreemptLowerPriority", True, 30.0),
    )
    entries = []
    expected = []
    runs: list[object] = []
    for i in range(300):
        admitted = rng.choice((None, 100.0, 200.0, 300.0))
        workload = Workload(
            f"j{rng.randrange(40)}",
            "q",
            "x",
            "h100",
            1,
            rng.choice((1, 2, 8)),
            "running",
            0.0,
            admitted_at=admitted,
            last_checkpoint_at=rng.choice((None, 250.0, 300.0)),
        )
        run = work.RunningWork(
            workload, 0, rng.choice((low, normal)), ((0, workload.gpus),), 1000.0, {}
        )
        queue = rng.randrange(3)
        at = i % 7
        entries.append(candidates.ScanEntry(run, queue, at, runs))
        expected.append((*run.order, queue, at, i))
    # Entries that tie on everything are never in one heap: the index settles them.
    order = sorted(range(len(entries)), key=lambda k: expected[k])
    heap = list(entries)
    heapq.heapify(heap)
    popped = [heapq.heappop(heap) for _ in range(len(entries))]
    assert [(e.run.order, e.queue, e.at) for e in popped] == [
        (entries[k].run.order, entries[k].queue, entries[k].at) for k in order
    ]


@pytest.mark.parametrize("seed", range(4))
def test_every_search_leaves_its_scratch_lists_as_it_found_them(seed: int) -> None:
    # A search counts each node's room in a list shared by the searches one after
    # another, -1 where no candidate it tried runs: a value left there would count a
    # victim of an earlier search in the next one. A failed search sums the GPUs it
    # gives back per queue in another such list, 0 between searches.
    snapshot = _multi_level_cluster(seed)
    tree, classes, _ = prepare(snapshot)
    planner = FlavorPlanner(snapshot, tree, classes, "h100", list(snapshot.workloads))
    planner.run()
    assert preempted(run_plan(snapshot))
    assert set(planner.nodes.room_scratch) == {-1}
    assert set(planner.ledger.given_scratch) == {0}
