"""Small traces replayed through the real fair-share engine, with outcomes computed by hand.

Every scenario runs on one node of 4 GPUs with a 1-second cycle.  The expected figures are worked
out in the comments from the rules of the simulation (see simulation/engine.py): a job runs for its
duration plus ``save_seconds`` after each ``checkpoint_interval`` of work, a victim with enough
grace saves and exits ``save_seconds`` later, and a resumed job first restores for
``restart_seconds``.
"""

from __future__ import annotations

import math

import pytest

import fairshare
from simulation.cli import parse_min_runtimes, prepare
from simulation.engine import (
    MAX_PREEMPTIONS_PER_JOB,
    Simulation,
    SimulationConfig,
    SimulationError,
    simulate,
)
from simulation.jobs import gang_fits, gang_shape
from simulation.traces import ClusterNode, TraceError, TraceJob, rack_layout, uniform_cluster

ONE_NODE = (ClusterNode("node-0", 4),)


def job(name: str, submit: float, gpus: int, duration: float, team: str = "a") -> TraceJob:
    return TraceJob(name, submit, duration, gpus, team)


def config(policy: str, **overrides: float) -> SimulationConfig:
    settings: dict[str, float] = {
        "checkpoint_interval": 1000.0,
        "save_seconds": 5.0,
        "restart_seconds": 20.0,
        "cycle_seconds": 1.0,
        "grace_seconds": 120.0,
    }
    settings.update(overrides)
    return SimulationConfig(nodes=ONE_NODE, guarantees={"a": 2, "b": 2}, policy=policy, **settings)


# Team a runs a1 (2 GPUs, 100 s) from t=0 and submits a2 (2 GPUs, 100 s) at t=1; team b submits
# b1 (2 GPUs, 50 s) at t=10.  Guarantees: a 2, b 2; the node has 4 GPUs.
LENDING_TRACE = [
    job("a1", 0, 2, 100),
    job("a2", 1, 2, 100),
    job("b1", 10, 2, 50, team="b"),
]


def test_fifo_keeps_strict_head_of_line() -> None:
    # a1 (2 GPUs) runs 0-100.  big (4 GPUs, t=1) waits for the whole node: 100-110.  small
    # (1 GPU, t=2) would fit beside a1 at once, but may not pass the head: it runs 110-120.
    trace = [job("a1", 0, 2, 100), job("big", 1, 4, 10), job("small", 2, 1, 10)]
    report = simulate(trace, config("fifo")).to_dict()

    assert report["run"]["jobs_completed"] == 3
    assert report["simulated_seconds"] == 120
    # Completion times 100, 109 and 118; time spent pending 0, 99 and 108.
    assert report["completion_time_seconds"]["mean"] == pytest.approx(109)
    assert report["completion_time_seconds"]["max"] == pytest.approx(118)
    assert report["queueing_delay_seconds"]["mean"] == pytest.approx(69)
    assert report["queueing_delay_seconds"]["p99"] == pytest.approx(108)
    # Held GPUs: 2 for 100 s, 4 for 10 s, 1 for 10 s = 250 GPU-s of 4 x 120.
    assert report["allocation"]["overall"] == pytest.approx(250 / 480, abs=1e-4)
    # Until the last submission (t=2): 2 GPUs of 4.
    assert report["allocation"]["until_last_submission"] == pytest.approx(0.5)
    assert report["preemptions"] == 0


def test_static_quotas_never_lend() -> None:
    # a2 cannot borrow b's idle guarantee: it waits for a1 and runs 100-200.  b1 runs 10-60.
    report = simulate(LENDING_TRACE, config("static")).to_dict()

    assert report["run"]["jobs_completed"] == 3
    assert report["simulated_seconds"] == 200
    # Completion 100, 199, 50; pending 0, 99, 0.
    assert report["completion_time_seconds"]["mean"] == pytest.approx(349 / 3, abs=1e-3)
    assert report["queueing_delay_seconds"]["max"] == pytest.approx(99)
    # Held: 2 x 10 s, 4 x 50 s, 2 x 40 s, 2 x 100 s = 500 GPU-s of 4 x 200.
    assert report["allocation"]["overall"] == pytest.approx(0.625)
    teams = report["teams"]
    assert teams["a"]["gpu_hours_borrowed"] == 0
    assert teams["b"]["gpu_hours_lent"] == 0
    assert report["preemptions"] == 0
    # Team b is admitted in the cycle of its arrival; team a always holds its guarantee.
    assert teams["a"]["seconds_below_guarantee_line"] == 0
    assert teams["b"]["seconds_below_guarantee_line"] == 0


def test_fairshare_lends_and_reclaims_with_a_graceful_save() -> None:
    # a2 borrows b's idle guarantee at t=1.  b1 arrives at t=10: the engine reclaims a2 (it lost
    # less work than a1: R9).  The grace (120 s) covers the save (5 s): a2 commits its 9 s of work
    # and exits at 15, when b1 starts (15-65).  a2 restarts at 65, restores until 85 and does its
    # remaining 91 s: it ends at 176.
    report = simulate(LENDING_TRACE, config("fairshare")).to_dict()

    assert report["run"]["jobs_completed"] == 3
    assert report["simulated_seconds"] == 176
    # Completion 100, 175, 55; pending 0, 50, 5.
    assert report["completion_time_seconds"]["mean"] == pytest.approx(110)
    assert report["completion_time_seconds"]["max"] == pytest.approx(175)
    assert report["queueing_delay_seconds"]["mean"] == pytest.approx(55 / 3, abs=1e-3)
    # All 4 GPUs are held 0-100 except for 0-1 (2 GPUs); then a2 alone 100-176.
    assert report["allocation"]["overall"] == pytest.approx(550 / (4 * 176), abs=1e-4)
    assert report["preemptions"] == 1
    assert report["lost_gpu_hours"] == 0
    teams = report["teams"]
    assert teams["a"]["preemptions"] == 1
    # a holds 4 GPUs (2 borrowed) during 1-15 and 65-100: 2 x 49 GPU-s, lent by b.
    assert teams["a"]["gpu_hours_borrowed"] == pytest.approx(98 / 3600, abs=1e-3)
    assert teams["b"]["gpu_hours_lent"] == pytest.approx(98 / 3600, abs=1e-3)
    # b waits for its guarantee from 10 until a2 has exited at 15: within cycle + grace.
    assert teams["b"]["seconds_below_guarantee_line"] == pytest.approx(5)
    assert report["longest_below_guarantee_line_seconds"] == pytest.approx(5)


def test_fairshare_victim_without_enough_grace_loses_work_since_its_checkpoint() -> None:
    # Checkpoint every 3 s of work, a save takes 5 s, the grace is only 2 s.  a2 starts at 1:
    # works 1-4, saves 4-9 (3 s committed at 9), works 9-10.  Reclaimed at 10 it cannot save:
    # it exits at once, losing 1 s of work on 2 GPUs, and b1 starts at 10.
    settings = {"checkpoint_interval": 3.0, "grace_seconds": 2.0}
    report = simulate(LENDING_TRACE, config("fairshare", **settings)).to_dict()

    assert report["preemptions"] == 1
    assert report["lost_gpu_hours"] == pytest.approx(2 / 3600, abs=1e-3)
    assert report["teams"]["a"]["lost_gpu_hours"] == pytest.approx(2 / 3600, abs=1e-3)
    assert report["teams"]["b"]["seconds_below_guarantee_line"] == 0
    # b1 needs 50 s of work and 16 saves (after 3, 6, ... 48 s): 130 s, so it ends at 140.
    # a1 needs 100 s and 33 saves: 265 s, ending at 265.  a2 restarts at 140, restores until
    # 160 and needs its remaining 97 s with 32 saves: 257 s, ending at 417.
    assert report["run"]["jobs_completed"] == 3
    assert report["simulated_seconds"] == pytest.approx(417)
    assert report["completion_time_seconds"]["max"] == pytest.approx(416)


def test_static_never_runs_a_gang_larger_than_its_team_guarantee() -> None:
    # Team a is guaranteed 2 GPUs and may not borrow: its 4-GPU job waits forever on an idle
    # node, while fifo runs it at once.
    trace = [job("wide", 0, 4, 10)]
    static = simulate(trace, config("static")).to_dict()
    assert static["run"]["jobs_completed"] == 0
    assert static["run"]["jobs_unfinished"] == 1
    assert list(static["run"]["unfinished_examples"]) == ["wide"]
    assert static["run"]["unfinished_examples"]["wide"]
    fifo = simulate(trace, config("fifo")).to_dict()
    assert fifo["run"]["jobs_completed"] == 1
    assert fifo["completion_time_seconds"]["max"] == 10


def test_jobs_larger_than_the_cluster_are_counted_and_left_out() -> None:
    trace = [job("fits", 0, 4, 10), job("too-big", 0, 8, 10)]
    report = simulate(trace, config("fairshare")).to_dict()

    assert report["run"]["jobs"] == 2
    assert report["run"]["jobs_unfit"] == 1
    assert report["run"]["jobs_completed"] == 1
    assert report["run"]["jobs_unfinished"] == 0


def test_gangs_split_into_whole_node_ranks() -> None:
    assert gang_shape(4, 8) == (1, 4)
    assert gang_shape(16, 8) == (2, 8)
    assert gang_shape(12, 8) == (2, 6)
    assert gang_shape(13, 8) == (13, 1)
    nodes = [ClusterNode("x", 8), ClusterNode("y", 8)]
    assert gang_fits(2, 8, nodes)
    assert not gang_fits(3, 8, nodes)
    assert gang_fits(4, 4, nodes)


def test_a_flapping_engine_stops_the_replay_with_an_error() -> None:
    # A plan that always admits the pending job and preempts the running one undoes itself every
    # cycle; the replay must fail loudly rather than run forever in simulated time.
    def flapping_plan(snapshot: fairshare.Snapshot) -> fairshare.Plan:
        admit = tuple(
            fairshare.Admission(w.id, (("node-0", 1),), 0)
            for w in snapshot.workloads
            if w.state == "pending"
        )
        preempt = tuple(
            fairshare.Preemption(w.id, "fair-share", admit[0].id, 120.0)
            for w in snapshot.workloads
            if w.state == "running" and admit
        )
        return fairshare.Plan(admit, preempt, (), {})

    trace = [job("x", 0, 4, 1000), job("y", 5, 4, 1000)]
    replay = Simulation(trace, config("fairshare"), plan=flapping_plan)
    with pytest.raises(SimulationError, match=f"preempted {MAX_PREEMPTIONS_PER_JOB} times"):
        replay.run()


def test_a_reclaim_minimum_runtime_delays_the_guarantee_by_that_long() -> None:
    # As above, but no job may be reclaimed before it has run 20 s. b1 arrives at 10 and
    # waits; a1 (admitted at 0) is the first to pass its minimum, so the cycle at t=20
    # (planned for that moment) reclaims it, and it saves 5 s and exits at 25, when b1
    # starts: 15 s below the line instead of 5.
    minimums = {"reclaim": 20.0}
    report = simulate(LENDING_TRACE, config("fairshare", min_runtimes=minimums)).to_dict()  # type: ignore[arg-type]

    assert report["run"]["jobs_completed"] == 3
    assert report["preemptions"] == 1
    assert report["teams"]["b"]["seconds_below_guarantee_line"] == pytest.approx(15)
    baseline = simulate(LENDING_TRACE, config("fairshare")).to_dict()
    assert baseline["teams"]["b"]["seconds_below_guarantee_line"] == pytest.approx(5)


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ("eviction=30", "reason must be one of"),
        ("reclaim=soon", "a number"),
        ("reclaim=-1", "0 or more"),
    ],
)
def test_a_bad_minimum_runtime_option_is_refused(entry: str, words: str) -> None:
    with pytest.raises(TraceError, match=words):
        parse_min_runtimes([entry])
    assert parse_min_runtimes(["reclaim=20", "priority=0"]) == {"reclaim": 20.0, "priority": 0.0}


def test_decayed_usage_gives_the_freed_node_to_the_team_that_used_less() -> None:
    # a runs a1 on the whole node 0-1000; a2 (t=500) and b1 (t=600) wait for it. By weight
    # alone the older a2 goes first (1000-1100, b1 1100-1200); with decayed usage a has
    # used all the spare GPUs of the last hour and b none, so b1 goes first.
    trace = [job("a1", 0, 4, 1000), job("a2", 500, 4, 100), job("b1", 600, 4, 100, team="b")]

    def waits(strength: float) -> dict[str, float]:
        settings = SimulationConfig(
            nodes=ONE_NODE,
            guarantees={"a": 0, "b": 0},
            checkpoint_interval=1000.0,
            usage_strength=strength,
            half_life_seconds=3600.0,
        )
        teams = simulate(trace, settings).to_dict()["teams"]
        return {team: teams[team]["queueing_delay_seconds"]["max"] for team in ("a", "b")}

    assert waits(0.0) == {"a": pytest.approx(500), "b": pytest.approx(500)}
    assert waits(1.0) == {"a": pytest.approx(600), "b": pytest.approx(400)}


def test_bad_decayed_usage_options_are_refused() -> None:
    with pytest.raises(TraceError, match="--usage-strength"):
        prepare({"format": "openb", "usage_strength": -1})
    with pytest.raises(TraceError, match="--half-life"):
        prepare({"format": "openb", "half_life": 0})


def test_racks_follow_the_node_list_models_or_one_block() -> None:
    listed = [
        ClusterNode("p0", 2, model="P100"),
        ClusterNode("g0", 8, model="G2"),
        ClusterNode("p1", 2, model="P100"),
        ClusterNode("g1", 8, model="G2"),
        ClusterNode("p2", 2, model="P100"),
    ]
    racked = {node.name: dict(node.topology) for node in rack_layout(listed, 2)}
    assert racked == {
        "p0": {"block": "block-P100", "rack": "rack-0000"},
        "p1": {"block": "block-P100", "rack": "rack-0000"},
        "p2": {"block": "block-P100", "rack": "rack-0001"},
        "g0": {"block": "block-G2", "rack": "rack-0002"},
        "g1": {"block": "block-G2", "rack": "rack-0002"},
    }
    uniform = rack_layout(uniform_cluster(3, 8), 2)
    assert [node.topology["rack"] for node in uniform] == ["rack-0000", "rack-0000", "rack-0001"]
    assert {node.topology["block"] for node in uniform} == {"block-0"}
    with pytest.raises(TraceError, match="--rack-size"):
        rack_layout(uniform, 0)


# Two racks of two 4-GPU nodes. s1 (100 s), s2 and s3 (1000 s) start at t=0 on n0, n1, n2
# (the engine fills nodes in order); the gang g (8 GPUs: 2 ranks of 4) arrives at t=1.
# At t=100 s1 ends: n0 and n3 are free, one in each rack. Placed blindly g starts then
# (99 s of waiting); required to sit in one rack it waits until s2 ends at t=1000 and frees
# rack 0 (999 s); preferring one rack it takes the two free nodes at t=100 like a blind gang.
RACKED = tuple(rack_layout([ClusterNode(f"n{i}", 4) for i in range(4)], 2))
GANG_TRACE = [
    job("s1", 0, 4, 100),
    job("s2", 0, 4, 1000),
    job("s3", 0, 4, 1000),
    job("g", 1, 8, 100),
]


@pytest.mark.parametrize(
    ("gang_topology", "wait"), [("none", 99), ("required", 999), ("preferred", 99)]
)
def test_a_gang_that_requires_one_rack_waits_for_a_whole_rack(
    gang_topology: str, wait: float
) -> None:
    settings = SimulationConfig(
        nodes=RACKED, guarantees={"a": 16}, checkpoint_interval=0, gang_topology=gang_topology
    )
    report = simulate(GANG_TRACE, settings).to_dict()

    assert report["run"]["jobs_completed"] == 4
    assert report["run"]["gang_topology"] == gang_topology
    assert report["gang_queueing_delay_seconds"]["max"] == pytest.approx(wait)
    assert report["queueing_delay_seconds"]["max"] == pytest.approx(wait)


def test_a_gang_no_rack_can_hold_is_unfit_only_when_it_requires_one() -> None:
    trace = [job("g", 0, 12, 100)]  # 3 ranks of 4: the cluster holds it, no rack does
    for gang_topology, unfit in (("required", 1), ("preferred", 0), ("none", 0)):
        settings = SimulationConfig(nodes=RACKED, guarantees={"a": 16}, gang_topology=gang_topology)
        assert simulate(trace, settings).to_dict()["run"]["jobs_unfit"] == unfit
    assert gang_fits(3, 4, RACKED)
    assert not gang_fits(3, 4, RACKED, one_rack=True)


def test_bad_topology_options_are_refused() -> None:
    with pytest.raises(TraceError, match="needs --rack-size"):
        prepare({"format": "openb", "gang_topology": "required"})
    with pytest.raises(TraceError, match="--rack-size must be >= 1"):
        prepare({"format": "openb", "nodes": 2, "rack_size": 0})
    with pytest.raises(ValueError, match="need a rack on every node"):
        Simulation([], SimulationConfig(nodes=ONE_NODE, guarantees={}, gang_topology="required"))
    with pytest.raises(ValueError, match="unknown gang topology"):
        Simulation([], SimulationConfig(nodes=RACKED, guarantees={}, gang_topology="block"))


def test_decayed_usage_starts_as_if_every_team_had_held_its_guarantee() -> None:
    # The engine counts only decayed usage beyond guarantee * half-life / ln 2 as borrowing.
    # Teams start exactly there; a team holding its guarantee stays there, one holding
    # nothing for a half-life drops to half of it.
    half_life = 3600.0
    horizon = half_life / math.log(2)
    trace = [job("a1", 0, 2, 10_000)]
    replay = Simulation(
        trace,
        SimulationConfig(
            nodes=ONE_NODE, guarantees={"a": 2, "b": 2}, usage_strength=1.0,
            half_life_seconds=half_life,
        ),
    )  # fmt: skip
    assert replay.recent == {"a": pytest.approx(2 * horizon), "b": pytest.approx(2 * horizon)}
    replay.running["a1"] = fairshare.Workload(
        id="a1", queue="a", priority_class="batch", flavor="gpu", ranks=1, gpus_per_rank=2,
        state="running", submitted_at=0.0, admitted_at=0.0, placement=(("node-0", 1),),
    )  # fmt: skip
    replay._decay_to(half_life)
    assert replay.recent == {"a": pytest.approx(2 * horizon), "b": pytest.approx(horizon)}
