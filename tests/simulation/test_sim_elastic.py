"""Elastic jobs in the replay (issue 47): which jobs are elastic, how a shrink and a grow are
carried out, that a run without them is today's, and what they change for a returning owner.

Expectations are computed by hand from the work model of simulation/README.md: 2 nodes of 8
GPUs, checkpoints every 1800 s of work, saves of 30 s, restores of 60 s, cycles of 1 s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import fairshare
from simulation.cli import run_simulation
from simulation.elastic import compare_elastic, comparison_lines, owner_waits
from simulation.engine import Simulation, SimulationConfig, simulate
from simulation.jobs import elastic_jobs, elastic_shape
from simulation.traces import ClusterNode, TraceError, TraceJob, load_trace

FIXTURES = Path(__file__).parent / "fixtures"
TWO_NODES = [ClusterNode("n0", 8), ClusterNode("n1", 8)]


def trace_of(gpus: list[int]) -> list[TraceJob]:
    return [TraceJob(f"j{i}", float(i), 600.0, count, "a") for i, count in enumerate(gpus)]


@pytest.mark.parametrize(
    ("gpus", "shape"),
    [
        (8, (2, 4, (1, 2))),  # one rank of 8 on a node: two of 4
        (16, (2, 8, (1, 2))),  # two ranks of 8 already
        (12, (2, 6, (1, 2))),
        (24, (6, 4, (3, 4, 5, 6))),  # three ranks of 8: six of 4
        (3, (3, 1, (2, 3))),  # odd on one node: ranks of one GPU
        (64, (8, 8, (4, 5, 6, 7, 8))),
    ],
)
def test_an_elastic_job_runs_from_half_its_ranks_to_all(
    gpus: int, shape: tuple[int, int, tuple[int, ...]]
) -> None:
    assert elastic_shape(gpus, 8) == shape


def test_the_share_of_the_multi_gpu_jobs_is_drawn_from_the_seed() -> None:
    trace = trace_of([1, 2, 8, 1, 4, 16, 1, 8, 2, 1, 12, 4])
    multi = {i for i, job in enumerate(trace) if job.gpus > 1}
    half = elastic_jobs(trace, 0.5, 0)
    assert len(half) == 4 and half <= multi
    assert elastic_jobs(trace, 0.5, 0) == half
    assert any(elastic_jobs(trace, 0.5, seed) != half for seed in (1, 2, 3))
    assert elastic_jobs(trace, 1.0, 7) == multi
    assert elastic_jobs(trace, 0.0, 0) == set()
    # 0.3 of 8 multi-GPU jobs is 2.4: two jobs.
    assert len(elastic_jobs(trace, 0.3, 0)) == 2
    with pytest.raises(ValueError, match="between 0 and 1"):
        elastic_jobs(trace, 1.5, 0)


def reclaim_case(grace_seconds: float, owner_duration: float) -> Any:
    # Team b (guarantee 8) runs a gang of 16 GPUs from t = 0, 3600 s of work at its full size;
    # team a (guarantee 8) sends eight 1-GPU jobs at t = 600. The gang, the only multi-GPU
    # job, is elastic: 2 ranks of 8, and runs on one.
    trace = [
        TraceJob("gang", 0.0, 3600.0, 16, "b"),
        *(TraceJob(f"a{i}", 600.0, owner_duration, 1, "a") for i in range(8)),
    ]
    config = SimulationConfig(
        nodes=TWO_NODES,
        guarantees={"a": 8, "b": 8},
        grace_seconds=grace_seconds,
        elastic_share=1.0,
    )
    return simulate(trace, config)


def test_a_shrunk_gang_keeps_running_on_fewer_gpus_and_loses_only_work_since_its_checkpoint() -> (
    None
):
    # Grace 10 s < save 30 s: at t = 600 the gang stops at once, losing its 600 s of work (no
    # checkpoint yet) on 16 GPUs, and relaunches on 8 GPUs right away (nothing to restore).
    # Its 3600 s of work at half the rate take 7200 s, plus one checkpoint's save: it ends
    # at 600 + 7200 + 30 = 7830. Its 8 GPUs are free at once, so a's jobs start at t = 600.
    report = reclaim_case(grace_seconds=10.0, owner_duration=100_000.0)
    assert report.resizes == {"shrinks": 1, "grows": 0}
    assert report.preemptions == 0
    assert report.lost_gpu_hours == pytest.approx(600 * 16 / 3600, abs=1e-3)
    gang = report.teams["b"]
    assert gang["completion_time_seconds"]["max"] == pytest.approx(7830.0)
    assert gang["queueing_delay_seconds"]["max"] == 0.0  # never requeued
    assert report.teams["a"]["inside_guarantee_wait_seconds"]["max"] == 0.0
    assert report.teams["a"]["jobs_completed"] == 8


def test_a_shrunk_gang_grows_back_when_the_gpus_come_back() -> None:
    # Grace 120 s: the shrink at t = 600 saves (600 s of work kept), the freed GPUs come back
    # at 630 and a's jobs start then (30 s); the gang restores until 690 and runs at half
    # rate. a's jobs end at 1630: the gang (past its 60 s fair-share minimum) grows, saving
    # at 600 + 940 / 2 = 1070 s of work, relaunches at 1660, restores until 1720, and does
    # its last 2530 s at full rate with one checkpoint: it ends at 1720 + 2530 + 30 = 4280.
    report = reclaim_case(grace_seconds=120.0, owner_duration=1000.0)
    assert report.resizes == {"shrinks": 1, "grows": 1}
    assert report.lost_gpu_hours == 0.0
    assert report.teams["b"]["completion_time_seconds"]["max"] == pytest.approx(4280.0)
    assert report.teams["a"]["inside_guarantee_wait_seconds"]["max"] == pytest.approx(30.0)
    assert report.to_dict()["resizes"] == {"shrinks": 1, "grows": 1}
    assert report.run["elastic_jobs"] == 1
    assert "elastic jobs 1 (share 1.0 of the multi-GPU jobs): 1 shrinks, 1 grows" in (
        report.summary_lines()
    )


def sia_options(**more: object) -> dict[str, object]:
    return {
        "trace": str(FIXTURES / "sia_saturn_slice.csv"),
        "format": "sia",
        "nodes": 2,
        "gpus_per_node": 8,
        "derive_quotas": True,
        "progress": False,
        **more,
    }


def without_timings(report: dict[str, Any]) -> dict[str, Any]:
    for key in ("plan_wall_seconds", "wall_seconds", "cpu_seconds"):
        report["run"].pop(key)
    return report


def test_a_share_of_zero_hands_the_engine_todays_snapshots_and_reports_as_before(
    tmp_path: Path,
) -> None:
    default = without_timings(run_simulation(sia_options()).to_dict())
    run_simulation(sia_options(elastic_share=0.0, json=str(tmp_path / "zero.json")))
    zero = without_timings(json.loads((tmp_path / "zero.json").read_text()))
    assert zero == default
    assert "resizes" not in zero and "elastic_share" not in zero["run"]
    # Not one elastic workload nor a class that may shrink reaches the engine, which then
    # plans exactly as it did before elastic gangs (fairshare/README.md).
    seen: list[Any] = []

    def plan(snapshot: Any) -> Any:
        seen.append(snapshot)
        return fairshare.plan(snapshot)

    trace = [TraceJob("gang", 0.0, 600.0, 16, "b"), TraceJob("one", 5.0, 60.0, 1, "a")]
    config = SimulationConfig(nodes=TWO_NODES, guarantees={"a": 8, "b": 8})
    Simulation(trace, config, plan=plan).run()
    assert seen
    assert not any(c.shrink_elastic for s in seen for c in s.priority_classes)
    assert not any(w.sizes for s in seen for w in s.workloads)


def test_an_elastic_owner_starts_on_what_is_free_instead_of_waiting_for_the_borrower() -> None:
    # Team c (no guarantee) borrows one node with an 8-GPU job from t = 0; team a, whose
    # guarantee is the whole cluster, comes back at t = 100 with a 16-GPU gang. Whole: the
    # borrower is evicted and a waits for its 30 s save. Elastic: a starts at once on the
    # free node at half its size and grows when the borrower ends, at 3630 (3600 s and a
    # save): 3530 s at half rate did 1765 s of work; it saves, restores until 3720, and does
    # the 1835 s left at full rate with one more save, ending at 5585.
    trace = [
        TraceJob("borrower", 0.0, 3600.0, 8, "c"),
        TraceJob("owner", 100.0, 3600.0, 16, "a"),
    ]
    config = SimulationConfig(nodes=TWO_NODES, guarantees={"a": 16, "c": 0})
    comparison = compare_elastic(trace, config, 1.0)
    assert comparison.whole_gang.inside_guarantee_wait_by_job == {"owner#1": 30.0}
    assert comparison.elastic.inside_guarantee_wait_by_job == {"owner#1": 0.0}
    assert owner_waits(comparison.whole_gang) == {"jobs": 1, "mean": 30.0, "p90": 30.0, "max": 30.0}
    assert owner_waits(comparison.elastic)["jobs"] == 0
    assert comparison.whole_gang.preemptions == 1 and comparison.elastic.preemptions == 0
    assert comparison.elastic.resizes == {"shrinks": 0, "grows": 1}
    assert comparison.elastic.teams["a"]["completion_time_seconds"]["max"] == pytest.approx(
        5585 - 100
    )
    lines = comparison_lines(comparison)
    assert (
        "goal: a returning owner waits at least 2x less: mean infx, longest infx shorter -> met"
        in lines
    )
    assert any(line.startswith("longest below line s (bound 121)") for line in lines)


def test_the_command_line_compares_whole_gangs_with_elastic_jobs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from simulation.cli import main

    out = tmp_path / "both.json"
    argv = ["--format", "sia", "--trace", str(FIXTURES / "sia_saturn_slice.csv"), "--nodes", "2",
            "--derive-quotas", "--no-progress", "--compare-elastic", "0.5", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "whole-gang eviction  elastic share 0.5" in printed
    assert "goal: mean completion time at most 80% of whole-gang eviction's" in printed
    both = json.loads(out.read_text())
    assert both["elastic"]["run"]["elastic_share"] == 0.5
    assert both["elastic"]["run"]["elastic_jobs"] == 6
    assert "resizes" not in both["whole_gang"]
    with pytest.raises(SystemExit):
        main([*argv[:-4], "--compare-elastic", "0"])
    # One report is what run_simulation gives (and manage.py simulate stores): it refuses.
    with pytest.raises(TraceError, match="python -m simulation"):
        run_simulation(sia_options(compare_elastic=0.5))


@pytest.mark.parametrize("policy", ["fairshare", "fifo"])
@pytest.mark.parametrize("grace_seconds", [120.0, 20.0])
def test_every_gpu_a_resize_moves_is_given_back(policy: str, grace_seconds: float) -> None:
    # The Sia slice, every multi-GPU job elastic, on 2 nodes shared by 4 teams: gangs start
    # small, shrink, grow and are evicted (with grace 20 s the trap cannot save, and resizes
    # lose work too). Whatever happens, no more GPUs are held than the cluster has, every job
    # ends, and at the end nothing is held, pending or being released.
    teams = {"a": 4, "b": 4, "c": 4, "d": 4}
    trace = load_trace(FIXTURES / "sia_saturn_slice.csv", "sia", teams, 0)
    config = SimulationConfig(
        nodes=TWO_NODES,
        guarantees=teams,
        policy=policy,
        grace_seconds=grace_seconds,
        checkpoint_interval=600.0,
        elastic_share=1.0,
    )
    simulation = Simulation(trace, config)
    ledger = simulation.ledger
    most = 0
    advance = ledger.advance

    def watch(now: float) -> None:
        nonlocal most
        most = max(most, ledger.held)
        advance(now)

    ledger.advance = watch  # type: ignore[method-assign]
    report = simulation.run()
    assert report.run["jobs_completed"] == 12
    assert report.resizes is not None and report.resizes["grows"] > 0
    assert most <= 16
    assert (ledger.held, ledger.demand, ledger.pending_jobs) == (0, 0, 0)
    assert not simulation.running and not simulation.releasing
    assert all(team.used == 0 for team in ledger.teams.values())
    if policy == "fairshare":
        assert report.resizes["shrinks"] > 0
    if grace_seconds < config.save_seconds:
        assert report.lost_gpu_hours > 0
