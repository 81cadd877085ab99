"""Trace, quota and cluster loaders on small slices of the real data (tests/simulation/fixtures)."""

from __future__ import annotations

import csv
import itertools
from collections import Counter
from pathlib import Path

import pytest

from simulation.synthetic import generate, make_teams
from simulation.traces import (
    SIA_GPU_HOURS,
    TraceError,
    TraceJob,
    derive_quotas,
    load_cluster,
    load_helios_quotas,
    load_quotas,
    load_trace,
    write_generic,
)

FIXTURES = Path(__file__).parent / "fixtures"
OPENB = FIXTURES / "openb_pod_list_slice.csv"
SIA = FIXTURES / "sia_saturn_slice.csv"
HELIOS = FIXTURES / "helios_venus_slice.csv"


def openb_rows() -> list[dict[str, str]]:
    with OPENB.open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_generic_trace_round_trips_and_sorts_by_submit_time(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("submit_time,duration,gpus,team\n30,600,8,vision\n5,60.5,1,speech\n")
    jobs = load_trace(path, "generic")
    assert [(j.submit_time, j.duration, j.gpus, j.team) for j in jobs] == [
        (5.0, 60.5, 1, "speech"),
        (30.0, 600.0, 8, "vision"),
    ]
    copy = tmp_path / "copy.csv"
    write_generic(copy, jobs)
    assert [(j.submit_time, j.gpus, j.team) for j in load_trace(copy, "generic")] == [
        (5.0, 1, "speech"),
        (30.0, 8, "vision"),
    ]


def test_generic_trace_names_the_bad_row(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("submit_time,duration,gpus,team\n0,10,1,a\n0,10,half,a\n")
    with pytest.raises(TraceError, match=r"trace\.csv:3: column gpus"):
        load_trace(path, "generic")
    path.write_text("submit_time,gpus,team\n0,1,a\n")
    with pytest.raises(TraceError, match="missing column"):
        load_trace(path, "generic")


def test_openb_keeps_scheduled_gpu_pods_with_whole_gpus() -> None:
    rows = openb_rows()
    expected = [
        row
        for row in rows
        if row["scheduled_time"] and (int(row["num_gpu"]) > 0 or int(row["gpu_milli"]) > 0)
    ]
    jobs = load_trace(OPENB, "openb", {"vision": 3, "speech": 1, "idle": 0}, seed=7)
    # The slice holds 6 pods without a GPU and 5 never scheduled, which are dropped.
    assert len(rows) == 100
    assert len(jobs) == len(expected) == 89
    by_name = {j.name: j for j in jobs}
    # openb-pod-0001 asks for 460 milli-GPU of one GPU: it occupies one whole GPU.
    assert by_name["openb-pod-0001"].gpus == 1
    assert by_name["openb-pod-0001"].duration == 12902960 - 427061
    assert by_name["openb-pod-0017"].gpus == 8
    assert by_name["openb-pod-0017"].duration == 10769854 - 9437497
    assert "openb-pod-0061" not in by_name  # pending, never scheduled
    assert "openb-pod-0005" not in by_name  # no GPU
    teams = Counter(j.team for j in jobs)
    assert set(teams) == {"vision", "speech"}  # a zero guarantee draws no job
    assert teams["vision"] > teams["speech"]
    # The same seed gives the same teams; another seed another draw.
    again = load_trace(OPENB, "openb", {"vision": 3, "speech": 1, "idle": 0}, seed=7)
    assert [j.team for j in again] == [j.team for j in jobs]
    other = load_trace(OPENB, "openb", {"vision": 3, "speech": 1, "idle": 0}, seed=8)
    assert [j.team for j in other] != [j.team for j in jobs]


def test_openb_without_quotas_puts_every_job_in_one_team() -> None:
    assert {j.team for j in load_trace(OPENB, "openb")} == {"default"}


def test_sia_durations_come_from_the_application_work() -> None:
    jobs = load_trace(SIA, "sia", {"a": 1}, seed=0)
    assert len(jobs) == 12
    yolo = next(j for j in jobs if j.name == "yolov3-7")
    assert yolo.gpus == 4
    assert yolo.submit_time == 1448.0
    assert yolo.duration == pytest.approx(SIA_GPU_HOURS["yolov3"] * 3600 / 4)
    cifar = next(j for j in jobs if j.name == "cifar10-0")
    assert cifar.duration == pytest.approx(SIA_GPU_HOURS["cifar10"] * 3600 / 12)
    assert {j.team for j in jobs} == {"a"}


def test_helios_day_gives_every_virtual_cluster_as_a_team() -> None:
    quotas = load_helios_quotas(HELIOS, "2020-04-01")
    assert len(quotas) == 25
    assert sum(quotas.values()) == 968
    assert quotas["vcEwI"] == 72
    assert quotas["vcKeu"] == 0
    with pytest.raises(TraceError, match="no row for date"):
        load_helios_quotas(HELIOS, "1999-01-01")


def test_quota_and_cluster_files(tmp_path: Path) -> None:
    quotas = tmp_path / "quotas.csv"
    quotas.write_text("team,guarantee\nvision,24\nspeech,8\n")
    assert load_quotas(quotas) == {"vision": 24, "speech": 8}
    cluster = tmp_path / "nodes.csv"
    cluster.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,1,1,8,V100\nn2,1,1,0,\nn3,1,1,2,T4\n")
    assert [(n.name, n.gpus) for n in load_cluster(cluster)] == [("n1", 8), ("n3", 2)]


def test_derived_quotas_follow_gpu_time_and_fill_the_cluster() -> None:
    jobs = [
        TraceJob("1", 0, 100, 1, "small"),
        TraceJob("2", 0, 100, 2, "mid"),
        TraceJob("3", 0, 100, 7, "big"),
    ]
    # GPU-seconds 100, 200, 700 of 1,000: on 32 GPUs that is 3.2, 6.4 and 22.4.
    assert derive_quotas(jobs, 32) == {"big": 22, "mid": 7, "small": 3}
    assert sum(derive_quotas(jobs, 33).values()) == 33


def test_synthetic_trace_matches_the_published_facts() -> None:
    teams = make_teams(12, seed=1)
    jobs = generate(20000, 1000, teams=teams, load=1.0, seed=1)
    assert len(jobs) == 20000
    assert generate(50, 1000, teams=teams, seed=1) == generate(50, 1000, teams=teams, seed=1)
    assert all(b.submit_time >= a.submit_time for a, b in itertools.pairwise(jobs))
    one_gpu = sum(1 for j in jobs if j.gpus == 1) / len(jobs)
    assert one_gpu > 0.5  # most jobs use one GPU
    gpu_time = sum(j.gpus * j.duration for j in jobs)
    large_time = sum(j.gpus * j.duration for j in jobs if j.gpus >= 8)
    assert large_time / gpu_time > 0.5  # jobs of 8 GPUs or more use most of the GPU time
    durations = sorted(j.duration for j in jobs)
    assert 15 * 60 < durations[len(durations) // 2] < 25 * 60  # median about 20 minutes
    longer_than_70h = sum(1 for d in durations if d > 70 * 3600) / len(durations)
    assert 0.005 < longer_than_70h < 0.02  # about 1% longer than 70 hours
    per_team = Counter(j.team for j in jobs)
    assert max(per_team.values()) > 10 * min(per_team.values())  # teams differ a lot


def test_synthetic_trace_with_the_real_traces_size_mix() -> None:
    # Every team draws from the real traces' mix: 93% of jobs on one GPU, gangs of 8 GPUs
    # or more holding most of the GPU time.
    teams = make_teams(15, seed=2, kind="trace")
    assert {team.kind for team in teams} == {"trace"}
    jobs = generate(20000, 512, teams=teams, load=1.0, seed=2)
    one_gpu = sum(1 for j in jobs if j.gpus == 1) / len(jobs)
    assert 0.92 < one_gpu < 0.94
    gpu_time = sum(j.gpus * j.duration for j in jobs)
    assert sum(j.gpus * j.duration for j in jobs if j.gpus >= 8) / gpu_time > 0.5
    with pytest.raises(ValueError, match="unknown team kind"):
        make_teams(3, kind="huge")
