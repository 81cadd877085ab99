"""Reading the figures Kueue's runner recorded (bench/kueue_side.py), from files laid out as
Kueue v0.17.0's recorder writes them: summary.yaml, wlStates.csv, minimalkueue.stats.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.kueue_side import KueueRunError, parse_results, resolve_config

SUMMARY = """\
clusterQueueClasses:
  cq:
    cpuAverageUsage: 43584
    cpuUsed: 1500000000
    firstEventTime: "2026-12-01T17:11:45.000000000Z"
    lastEventTime: "2026-12-01T17:12:35.123456789Z"
    nominalQuota: 60000
droppedWorkloadEvents: 3
workloadClasses:
  large:
    averageTimeToAdmissionMs: 5815
    averageTimeToFinishMs: 6980
    count: 2
    totalEvictions: 1
  small:
    averageTimeToAdmissionMs: 250
    averageTimeToFinishMs: 500
    count: 4
    totalEvictions: 2
"""
WORKLOADS = """\
id,class name,namespace,name,ms to admitted,ms to finish,num evictions
0,small,cq-0-0-cohort-0,small-0-0-0,100,300,0
1,small,cq-0-0-cohort-0,small-0-1-0,400,700,2
2,small,cq-0-0-cohort-0,small-0-2-0,200,450,0
3,small,cq-0-0-cohort-0,small-0-3-0,300,550,0
4,large,cq-0-0-cohort-0,large-2-0-0,5000,6000,1
5,large,cq-0-0-cohort-0,large-2-1-0,6630,7960,0
"""
STATS = "maxrss: 65404\nsysMs: 323\nuserMs: 2440\nwallMs: 39533\n"


def lay_out(folder: Path) -> Path:
    (folder / "summary.yaml").write_text(SUMMARY)
    (folder / "wlStates.csv").write_text(WORKLOADS)
    (folder / "minimalkueue.stats.yaml").write_text(STATS)
    return folder


def test_figures_are_read_as_the_recorder_wrote_them(tmp_path: Path) -> None:
    result = parse_results(lay_out(tmp_path))
    assert result["total_s"] == pytest.approx(39.533)
    assert result["admission"]["large"]["mean_s"] == pytest.approx(5.815)
    assert result["admission"]["small"]["mean_s"] == pytest.approx(0.25)
    # Nearest rank over 100, 200, 300, 400 ms: p50 is the 2nd, p99 the 4th.
    assert result["admission"]["small"]["p50_s"] == pytest.approx(0.2)
    assert result["admission"]["small"]["p99_s"] == pytest.approx(0.4)
    assert result["admission"]["large"]["p99_s"] == pytest.approx(6.63)
    assert result["preemptions"] == 3
    assert result["workloads"] == 6
    assert result["dropped_workload_events"] == 3
    # Kueue's checker: cpuUsed / (nominalQuota * monitored ms) = 1.5e9 / (60000 * 50123.456789).
    assert result["usage"] == pytest.approx(1.5e9 / (60000 * 50123.456789))
    assert result["minimalkueue"]["cpu_s"] == pytest.approx(2.763)
    assert result["minimalkueue"]["peak_rss_mb"] == pytest.approx(65404 / 1024)


@pytest.mark.parametrize("missing", ["summary.yaml", "wlStates.csv", "minimalkueue.stats.yaml"])
def test_a_run_without_its_recorded_files_is_an_error(tmp_path: Path, missing: str) -> None:
    (lay_out(tmp_path) / missing).unlink()
    with pytest.raises(KueueRunError, match=missing):
        parse_results(tmp_path)


def test_configs_are_found_by_name_in_the_module_or_by_path(tmp_path: Path) -> None:
    configs = tmp_path / "v0.17.0" / "src" / "test" / "performance" / "scheduler" / "configs"
    for name in ("baseline", "tas"):
        (configs / name).mkdir(parents=True)
        (configs / name / "generator.yaml").write_text("cohorts: []\n")
    kueue_dir = tmp_path / "v0.17.0"
    assert resolve_config(kueue_dir, "baseline") == configs / "baseline" / "generator.yaml"
    own = tmp_path / "own.yaml"
    own.write_text("cohorts: []\n")
    assert resolve_config(kueue_dir, str(own)) == own
    with pytest.raises(KueueRunError, match=r"ships no 'large-scale' .*it has: baseline, tas"):
        resolve_config(kueue_dir, "large-scale")
    with pytest.raises(KueueRunError, match="does not exist"):
        resolve_config(kueue_dir, str(tmp_path / "absent.yaml"))


def test_usage_over_several_queue_classes_uses_the_whole_window(tmp_path: Path) -> None:
    # Borrowers hold 80 of the owners' 40 + borrowers' 10 units for 10 s of a 20-s run.
    summary = SUMMARY.replace(
        """  cq:
    cpuAverageUsage: 43584
    cpuUsed: 1500000000
    firstEventTime: "2026-12-01T17:11:45.000000000Z"
    lastEventTime: "2026-12-01T17:12:35.123456789Z"
    nominalQuota: 60000
""",
        """  borrower:
    cpuUsed: 800000000
    firstEventTime: "2026-12-01T17:00:00Z"
    lastEventTime: "2026-12-01T17:00:10Z"
    nominalQuota: 10000
  owner:
    cpuUsed: 400000000
    firstEventTime: "2026-12-01T17:00:00Z"
    lastEventTime: "2026-12-01T17:00:20Z"
    nominalQuota: 40000
""",
    )
    lay_out(tmp_path)
    (tmp_path / "summary.yaml").write_text(summary)
    result = parse_results(tmp_path)
    assert result["usage_by_class"]["borrower"] == pytest.approx(8.0)  # 80 units on a quota of 10
    assert result["usage_by_class"]["owner"] == pytest.approx(0.5)
    # 1.2e9 mCPU·ms over 50 units for 20 s.
    assert result["usage"] == pytest.approx(1.2e9 / (50000 * 20000))
