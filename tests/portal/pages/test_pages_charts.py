"""The chart builders are pure: plain selector rows in, plotly figures out.
No database here."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from telemetry import charts
from telemetry.history_selectors import UtilizationPoint
from telemetry.preemption_selectors import CheckpointAgainstGrace
from telemetry.report_selectors import mission_matrix

START = datetime(2026, 1, 1, tzinfo=UTC)


def _points() -> list[UtilizationPoint]:
    points = []
    for minute in range(3):
        at = START + timedelta(minutes=minute)
        points.append(UtilizationPoint(at, "vision", "h100", 4 + minute, 8, 0, 24))
        points.append(UtilizationPoint(at, "ops", "h100", 10, 8, 2 + minute, 24))
        points.append(UtilizationPoint(at, "ops", "a100", 3, 0, 3, 8))
    return points


def test_utilization_stacks_teams_of_one_flavor_with_their_guarantees() -> None:
    figure = charts.utilization_figure(_points(), flavor="h100")
    traces = {trace.name: trace for trace in figure.data}
    assert set(traces) == {
        "ops used",
        "vision used",
        "ops guarantee",
        "vision guarantee",
        "capacity",
    }
    assert list(traces["vision used"].y) == [4, 5, 6]
    assert traces["vision used"].stackgroup == traces["ops used"].stackgroup == "used"
    assert traces["ops guarantee"].line.dash == "dash"
    assert traces["ops guarantee"].stackgroup is None
    assert list(traces["capacity"].y) == [24, 24, 24]


def test_borrowed_share_divides_borrowed_by_used_per_moment() -> None:
    figure = charts.borrowed_share_figure(_points(), flavor="h100")
    assert list(figure.data[0].y) == [2 / 14, 3 / 15, 4 / 16]


def test_empty_inputs_give_a_figure_that_says_so() -> None:
    for figure in (
        charts.utilization_figure([], flavor="h100"),
        charts.signal_latency_figure([]),
        charts.checkpoint_grace_figure([]),
        charts.exit_code_figure([]),
        charts.recovery_figure([]),
    ):
        assert figure.data == ()
        assert figure.layout.annotations[0].text.startswith("No ")


def test_checkpoints_are_drawn_as_a_share_of_their_grace_window() -> None:
    rows = [
        CheckpointAgainstGrace(1, START, 60.0, 12.0, "graceful"),
        CheckpointAgainstGrace(2, START, 10.0, 14.0, "checkpoint-skipped"),
        CheckpointAgainstGrace(3, START, 0.0, 0.0, "graceful"),
    ]
    figure = charts.checkpoint_grace_figure(rows)
    bars, grace = figure.data
    # 12 of 60 s is 20 %; 14 of 10 s is 140 %; no window and no checkpoint is 0.
    assert list(bars.y) == [0.2, 1.4, 0.0]
    assert list(bars.marker.color) == [charts.GOOD, charts.BAD, charts.GOOD]
    assert [row[:2] for row in bars.customdata] == [[12.0, 60.0], [14.0, 10.0], [0.0, 0.0]]
    assert list(grace.y) == [1.0, 1.0, 1.0]
    assert figure.layout.yaxis.tickformat == ".0%"
    # The axis reaches past the tallest bar: 1.4 × 1.1.
    assert figure.layout.yaxis.range == (0, pytest.approx(1.54))


def test_exit_codes_stack_by_how_the_attempt_ended() -> None:
    figure = charts.exit_code_figure(
        [(0, "preempted", 16), (0, "succeeded", 4), (137, "preempted", 2)]
    )
    by_reason = {trace.name: list(trace.y) for trace in figure.data}
    assert by_reason == {"preempted": [16, 2], "succeeded": [4, 0]}
    assert list(figure.data[0].x) == ["0", "137"]
    # The tallest stack is 16 + 4 = 20 ranks: whole-number ticks chosen by plotly.
    assert figure.layout.yaxis.tickformat == ",d"
    assert figure.layout.yaxis.dtick is None


def test_outcomes_wear_their_meaning_failed_in_red() -> None:
    figure = charts.exit_code_figure(
        [(0, "succeeded", 2), (1, "failed", 1), (143, "preempted", 2), (143, "cancelled", 1)]
    )
    colours = {trace.name: trace.marker.color for trace in figure.data}
    assert colours == {
        "succeeded": "#16a34a",
        "failed": "#dc2626",
        "preempted": "#d97706",
        "cancelled": "#6b7280",
    }
    # At most 3 ranks in a stack (exit 143: 2 preempted + 1 cancelled): a tick per rank.
    assert (figure.layout.yaxis.tick0, figure.layout.yaxis.dtick) == (0, 1)
    assert figure.layout.yaxis.rangemode == "tozero"


def test_histograms_count_in_whole_numbers() -> None:
    # Bins of 50 ms from 0.20 s: 0.21 and 0.22 share one, 0.31 has one: at most 2.
    latency = charts.signal_latency_figure([0.21, 0.22, 0.31])
    assert latency.data[0].xbins.start == pytest.approx(0.2)
    assert (latency.layout.yaxis.dtick, latency.layout.yaxis.tickformat) == (1, ",d")
    # 12 preemptions recovered within the same 5 s bin: more than 10, plotly's own steps.
    recovery = charts.recovery_figure([(job, 31.0) for job in range(12)])
    assert recovery.data[0].xbins.start == 30.0
    assert recovery.layout.yaxis.dtick is None
    assert recovery.layout.yaxis.tickformat == ",d"


def test_the_chosen_period_is_drawn_whole() -> None:
    since, until = START - timedelta(hours=24), START + timedelta(minutes=5)
    for figure in (
        charts.utilization_figure(_points(), flavor="h100", since=since, until=until),
        charts.borrowed_share_figure(_points(), flavor="h100", since=since, until=until),
    ):
        # The samples cover 3 minutes; the axis spans the 24 hours asked for.
        assert tuple(figure.layout.xaxis.range) == (since, until)


def test_figures_carry_no_external_template_or_font() -> None:
    text = charts.signal_latency_figure([0.2, 0.3]).to_json()
    assert "http" not in text


def test_mission_matrix_reads_the_drill_json_figures() -> None:
    from telemetry.models import DrillRun

    good = {
        "signal_propagation_seconds": 0.5,
        "checkpoint_seconds": 4.0,
        "grace_seconds": 60,
        "checkpoint_committed": True,
        "exit_codes": [0, 0],
        "orphaned_ports": [],
        "restart_integrity": True,
        "recovery_seconds": 30.0,
        "utilization": 91.0,
    }
    late = {
        **good,
        "signal_propagation_seconds": 1.5,
        "exit_codes": [0, 137],
        "checkpoint_committed": False,
    }
    drills = [
        DrillRun(started_at=START, runtime="local", ranks=2, grace_seconds=60.0, result=r)
        for r in (good, late)
    ]
    rows = {row.name: row for row in mission_matrix(drills)}
    assert rows["Signal reaches every rank"].latest == "0.50 s"
    assert rows["Signal reaches every rank"].over_runs == "worst 1.50 s"
    assert rows["Signal reaches every rank"].passed is False
    assert rows["Checkpoint success rate"].over_runs == "50 % of 2 runs"
    assert rows["Every rank exits 0"].passed is False
    assert rows["Orphaned sockets"].passed is True
    assert rows["Utilization"].latest == "91 %"
    assert rows["Recovery time"].passed is True
    assert mission_matrix([]) == []
