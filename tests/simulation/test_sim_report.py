"""The command line and the JSON report: every documented name is there and means what it says."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from simulation import main, run_simulation
from simulation.report import percentile

FIXTURES = Path(__file__).parent / "fixtures"
README = Path(__file__).parents[2] / "simulation" / "README.md"

TOP_LEVEL = {
    "run",
    "simulated_seconds",
    "allocation",
    "completion_time_seconds",
    "queueing_delay_seconds",
    "gang_queueing_delay_seconds",
    "preemptions",
    "lost_gpu_hours",
    "longest_below_guarantee_line_seconds",
    "longest_inside_guarantee_wait_seconds",
    "longest_inside_guarantee_waits",
    "teams",
}
ALLOCATION = {
    "overall",
    "until_last_submission",
    "while_jobs_wait",
    "seconds_jobs_wait",
    "while_demand_exceeds_capacity",
    "seconds_demand_exceeds_capacity",
    "seconds_demand_exceeds_capacity_below_goal",
}
TEAM = {
    "guarantee",
    "jobs",
    "jobs_completed",
    "gpu_hours_used",
    "gpu_hours_borrowed",
    "gpu_hours_lent",
    "seconds_below_guarantee_line",
    "longest_below_guarantee_line_seconds",
    "inside_guarantee_wait_seconds",
    "seconds_wanting_surplus",
    "preemptions",
    "lost_gpu_hours",
    "completion_time_seconds",
    "queueing_delay_seconds",
}
SUMMARY = {"mean", "p50", "p99", "max"}


def write_trace(path: Path) -> Path:
    # Two teams on 2 nodes of 4 GPUs; vision asks for more than its guarantee at first.
    path.write_text(
        "submit_time,duration,gpus,team\n"
        "0,300,4,vision\n"
        "0,300,4,vision\n"
        "60,120,4,speech\n"
        "61,30,1,speech\n"
    )
    return path


def test_cli_writes_the_documented_json_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "trace.csv")
    quotas = tmp_path / "quotas.csv"
    quotas.write_text("team,guarantee\nvision,4\nspeech,4\n")
    out = tmp_path / "report.json"
    argv = [
        "--trace", str(trace), "--format", "generic", "--nodes", "2", "--gpus-per-node", "4",
        "--quotas", str(quotas), "--policy", "fairshare", "--checkpoint-interval", "100",
        "--save-seconds", "10", "--restart-seconds", "15", "--cycle-seconds", "2",
        "--json", str(out), "--seed", "3",
    ]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "GPU allocation" in captured.out
    assert re.search(r"\[#+\] 100\.0% 4/4 jobs", captured.err)  # the progress bar

    report = json.loads(out.read_text())
    assert set(report) == TOP_LEVEL
    assert set(report["allocation"]) == ALLOCATION
    assert set(report["completion_time_seconds"]) == SUMMARY
    assert set(report["queueing_delay_seconds"]) == SUMMARY
    assert set(report["teams"]) == {"vision", "speech"}
    for team in report["teams"].values():
        assert set(team) == TEAM
    run = report["run"]
    assert run["policy"] == "fairshare"
    assert run["capacity_gpus"] == 8
    assert run["cycle_seconds"] == 2
    assert run["seed"] == 3
    assert run["jobs_completed"] == 4
    # speech reclaims its guarantee from vision's borrowed gang: one graceful preemption.
    assert report["preemptions"] == 1
    assert report["teams"]["vision"]["preemptions"] == 1
    assert report["teams"]["vision"]["gpu_hours_borrowed"] > 0
    assert report["teams"]["speech"]["gpu_hours_lent"] > 0
    assert report["longest_below_guarantee_line_seconds"] <= 2 + 10
    # Each job's wait inside its guarantee, beside the stretches: speech's jobs fitted.
    assert set(report["teams"]["speech"]["inside_guarantee_wait_seconds"]) == {"jobs", *SUMMARY}
    assert report["teams"]["speech"]["inside_guarantee_wait_seconds"]["jobs"] >= 1
    assert 0 <= report["longest_inside_guarantee_wait_seconds"] <= 2 + 10
    assert "wait of a job inside its team's unused guarantee until it starts" in captured.out


def test_every_report_name_is_documented_in_the_readme() -> None:
    text = README.read_text()
    documented = (
        {f"`{name}`" for name in TOP_LEVEL | SUMMARY}
        | {f"`allocation.{name}`" for name in ALLOCATION}
        | {f"`teams.*.{name}`" for name in TEAM}
    )
    for name in documented:
        assert name in text, name


def test_run_simulation_takes_django_style_options(tmp_path: Path) -> None:
    # The options of a Django command arrive as a dict with underscores and extra keys.
    options = {
        "trace": str(FIXTURES / "openb_pod_list_slice.csv"),
        "format": "openb",
        "quotas_from_helios": "2020-04-01",
        "helios_file": str(FIXTURES / "helios_venus_slice.csv"),
        "gpus_per_node": 8,
        "policy": "static",
        "arrival_scale": 0.001,
        "json": str(tmp_path / "static.json"),
        "progress": False,
        "verbosity": 1,
    }
    report = run_simulation(options)
    # The nodes default to the quotas' sum: 968 GPUs on 121 nodes of 8.
    assert report.run["capacity_gpus"] == 968
    assert report.run["nodes"] == 121
    assert report.run["jobs"] == 89
    assert report.run["jobs_completed"] + report.run["jobs_unfinished"] == 89
    assert json.loads((tmp_path / "static.json").read_text())["run"]["policy"] == "static"
    assert all(team["gpu_hours_borrowed"] == 0 for team in report.teams.values())


def test_bad_input_exits_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "trace.csv")
    with pytest.raises(SystemExit) as exit_info:
        main(["--trace", str(trace), "--no-progress"])
    assert exit_info.value.code == 2
    assert "give --nodes or --cluster" in capsys.readouterr().err


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.99) == 99
    assert percentile(values, 0.5) == 50
    assert percentile([7.0], 0.99) == 7
    assert percentile([], 0.5) == 0
