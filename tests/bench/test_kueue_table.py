"""The side-by-side table of bench/bench_kueue.py: pure logic over the two sides' dicts."""

from __future__ import annotations

import math

import pytest

from bench.kueue_qm import Workload, arrival_groups
from bench.kueue_side import percentile
from bench.kueue_table import comparison_rows, format_table, quartermaster_lines

KUEUE = {
    "total_s": 368.0,
    "usage": 0.57,
    "preemptions": 12,
    "admission": {
        "large": {"mean_s": 9.4, "p50_s": 8.0, "p99_s": 30.0},
        "medium": {"mean_s": 81.9, "p50_s": 80.0, "p99_s": 160.0},
        "small": {"mean_s": 223.8, "p50_s": 220.0, "p99_s": 330.0},
    },
}
QUARTERMASTER = {
    "total_s": 120.0,
    "usage": 0.80,
    "preemptions": 3,
    "admission": {
        "large": {"mean_s": 6.0, "p50_s": 5.0, "p99_s": 20.0},
        "medium": {"mean_s": 30.0, "p50_s": 29.0, "p99_s": 70.0},
        "small": {"mean_s": 150.0, "p50_s": 140.0, "p99_s": 200.0},
    },
}


def rows_by_label() -> dict[str, object]:
    return {row.label: row for row in comparison_rows(KUEUE, QUARTERMASTER)}


def test_ratios_are_quartermaster_over_kueue() -> None:
    rows = rows_by_label()
    assert rows["total time"].ratio == pytest.approx(120 / 368)
    assert rows["medium: time to admission, p99"].ratio == pytest.approx(70 / 160)
    assert rows["cluster usage"].kueue == pytest.approx(57.0)
    assert rows["cluster usage"].ratio == pytest.approx(0.80 / 0.57)
    assert rows["preemptions"].ratio == pytest.approx(3 / 12)


def test_goal_verdicts_on_total_and_mean_times_only() -> None:
    rows = rows_by_label()
    assert rows["total time"].verdict == "met"  # 0.33
    assert rows["large: time to admission, mean"].verdict == "missed"  # 0.64
    assert rows["medium: time to admission, mean"].verdict == "met"  # 0.37
    assert rows["small: time to admission, mean"].verdict == "missed"  # 0.67
    assert rows["small: time to admission, p99"].verdict == ""
    assert rows["cluster usage"].verdict == ""


def test_a_class_only_one_side_reports_shows_no_ratio() -> None:
    quartermaster = {
        **QUARTERMASTER,
        "admission": {**QUARTERMASTER["admission"], "owner": {"mean_s": 1.0}},
    }
    rows = {row.label: row for row in comparison_rows(KUEUE, quartermaster)}
    owner = rows["owner: time to admission, mean"]
    assert owner.kueue is None and owner.quartermaster == 1.0
    assert owner.ratio is None and owner.verdict == "no figure"
    # Kueue's classes come first, in Kueue's order.
    labels = [row.label for row in comparison_rows(KUEUE, quartermaster)]
    assert labels.index("small: time to admission, p99") < labels.index(
        "owner: time to admission, mean"
    )


def test_zero_or_missing_kueue_figure_gives_no_ratio() -> None:
    rows = {row.label: row for row in comparison_rows({**KUEUE, "preemptions": 0}, QUARTERMASTER)}
    assert rows["preemptions"].ratio is None
    rows = {
        row.label: row for row in comparison_rows({**KUEUE, "total_s": math.nan}, QUARTERMASTER)
    }
    assert rows["total time"].ratio is None
    assert rows["total time"].verdict == "no figure"


def test_format_table_lines_up_and_names_both_systems() -> None:
    text = format_table(KUEUE, QUARTERMASTER, title="baseline")
    lines = text.splitlines()
    assert lines[0] == "baseline"
    assert lines[1].split()[:3] == ["figure", "Kueue", "Quartermaster"]
    total = next(line for line in lines if line.startswith("total time"))
    assert "368.0 s" in total and "120.0 s" in total and "0.33" in total and "<= 0.50: met" in total
    usage = next(line for line in lines if line.startswith("cluster usage"))
    assert "57.0 %" in usage and "80.0 %" in usage
    # The figure columns are right-aligned under their headers on every row.
    header_end = lines[1].index("Quartermaster") + len("Quartermaster")
    for line in lines[3:]:
        assert line[header_end - 1] != " ", line


def test_reclaim_rows_compare_lost_work_against_a_tenth_of_kueues() -> None:
    kueue = {
        **KUEUE,
        "reclaim": {"evictions": 40, "lost_gpu_seconds": 2000.0, "rerun_gpu_seconds": 9000.0},
    }
    quartermaster = {
        **QUARTERMASTER,
        "reclaim": {"evictions": 30, "lost_gpu_seconds": 150.0, "rerun_gpu_seconds": 150.0},
    }
    rows = {row.label: row for row in comparison_rows(kueue, quartermaster, time_goals=False)}
    lost = rows["work lost since the last checkpoint"]
    assert lost.ratio == pytest.approx(0.075) and lost.verdict == "met"
    assert rows["work run again"].ratio == pytest.approx(150 / 9000)
    assert rows["work run again"].verdict == ""
    # The timing goals belong to Kueue's own configs, not to this comparison.
    assert rows["total time"].verdict == "" and rows["large: time to admission, mean"].verdict == ""
    worse = {**quartermaster, "reclaim": {**quartermaster["reclaim"], "lost_gpu_seconds": 201.0}}
    rows = {row.label: row for row in comparison_rows(kueue, worse, time_goals=False)}
    assert rows["work lost since the last checkpoint"].verdict == "missed"
    text = format_table(kueue, quartermaster, time_goals=False)
    line = next(x for x in text.splitlines() if x.startswith("work lost"))
    assert "2,000 GPU-s" in line and "150 GPU-s" in line and "<= 0.10: met" in line
    # Without reclaim figures the table has no such rows.
    assert not any(r.label.startswith("work") for r in comparison_rows(KUEUE, QUARTERMASTER))


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.50) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([7.0], 0.99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 0.5)


def test_quartermaster_lines_say_where_the_time_went() -> None:
    figures = {
        "submitted": 15000,
        "submission": {
            "requests": 1160,
            "done_s": 412.25,
            "request_mean_s": 0.4,
            "request_p99_s": 1.25,
            "late_max_s": 350.0,
        },
        "launch_after_admission": {"mean_s": 0.37, "p50_s": 0.3, "p99_s": 0.88},
        "end_noticed_after_exit": {"mean_s": 1.69, "p50_s": 1.5, "p99_s": 6.76},
        "gpu_seconds": {"held": 41141.2, "work": 39600.0},
    }
    assert quartermaster_lines(figures) == [
        "Quartermaster:",
        "  the API took 15,000 submissions in 1,160 requests in 412.2 s (request mean 0.40 s, p99 1.25 s; "
        "the last sent up to 350.0 s after its arrival time)",
        "  launched 0.37 s after admission (p99 0.88 s); "
        "an end noticed 1.69 s after the exit (p99 6.76 s)",
        "  GPUs held 41,141 GPU-s for 39,600 GPU-s of work",
    ]
    assert quartermaster_lines({}) == []


def test_arrival_groups_put_workloads_due_together_in_one_request() -> None:
    def due(name: str, at: float) -> Workload:
        return Workload(name, "q", "small", 1, 50, 200, at)

    workloads = [due("a", 0.1), due("b", 0.1), due("c", 0.2), due("d", 0.5), due("e", 0.5)]
    groups = arrival_groups(workloads, together=True)
    assert [[w.name for w in g] for g in groups] == [["a", "b"], ["c"], ["d", "e"]]
    assert [[w.name for w in g] for g in arrival_groups(workloads, together=False)] == [
        ["a"],
        ["b"],
        ["c"],
        ["d"],
        ["e"],
    ]
