"""The resize charts are pure: plain selector rows in, plotly figures out, each
with an empty state that says why it is empty. No database here."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from telemetry import charts
from telemetry.preemption_selectors import ResizeStop, StopsOfTeam

START = datetime(2026, 1, 1, tzinfo=UTC)


def _resize(
    job: int,
    attempt: int,
    sizes: tuple[int, int],
    *,
    free: float | None,
    lost: float | None,
    minute: int = 0,
) -> ResizeStop:
    return ResizeStop(
        job_id=job,
        attempt=attempt,
        team="vision",
        decided_at=START + timedelta(minutes=minute),
        from_ranks=sizes[0],
        to_ranks=sizes[1],
        grace_seconds=60.0,
        seconds_to_free=free,
        lost_gpu_seconds=lost,
        cause=f"{'shrunk' if sizes[1] < sizes[0] else 'grown'} from {sizes[0]} to {sizes[1]} ranks",
    )


ROWS = [
    _resize(7, 1, (8, 4), free=6.0, lost=32.0, minute=0),
    _resize(9, 1, (4, 2), free=None, lost=None, minute=1),
    _resize(7, 2, (4, 8), free=12.5, lost=0.0, minute=2),
    _resize(8, 1, (2, 1), free=65.0, lost=20.5, minute=3),
]


def test_stops_by_team_groups_preempted_shrunk_and_grown_bars() -> None:
    figure = charts.stops_by_team_figure(
        [StopsOfTeam("ops", 3, 1, 0), StopsOfTeam("vision", 0, 2, 1)]
    )
    bars = {trace.name: (list(trace.x), list(trace.y)) for trace in figure.data}
    assert bars == {
        "preempted": (["ops", "vision"], [3, 0]),
        "shrunk": (["ops", "vision"], [1, 2]),
        "grown": (["ops", "vision"], [0, 1]),
    }
    colours = {trace.name: trace.marker.color for trace in figure.data}
    assert colours["preempted"] == charts.WARN
    assert colours["shrunk"] != colours["grown"] != charts.WARN
    assert figure.layout.barmode == "group"
    # At most 3 stops in a bar: a tick for each whole number.
    assert (figure.layout.yaxis.dtick, figure.layout.yaxis.tickformat) == (1, ",d")


def test_lost_work_is_one_bar_per_finished_resize_in_time_order() -> None:
    figure = charts.resize_lost_work_figure(ROWS)
    bars = {trace.name: dict(zip(trace.x, trace.y, strict=True)) for trace in figure.data}
    # Job 9's shrink is still stopping: no bar until its loss is known.
    assert bars == {
        "shrunk": {"job 7 · attempt 1": 32.0, "job 8 · attempt 1": 20.5},
        "grown": {"job 7 · attempt 2": 0.0},
    }
    assert list(figure.layout.xaxis.categoryarray) == [
        "job 7 · attempt 1",
        "job 7 · attempt 2",
        "job 8 · attempt 1",
    ]
    assert figure.layout.yaxis.title.text == "GPU-seconds lost"
    shrunk = next(trace for trace in figure.data if trace.name == "shrunk")
    assert [row[:3] for row in shrunk.customdata] == [[8, 4, "vision"], [2, 1, "vision"]]
    assert shrunk.customdata[0][4] == "shrunk from 8 to 4 ranks"


def test_time_to_free_draws_each_resize_beside_its_grace_window() -> None:
    figure = charts.resize_free_time_figure(ROWS)
    by_name = {trace.name: trace for trace in figure.data}
    assert dict(zip(by_name["shrunk"].x, by_name["shrunk"].y, strict=True)) == {
        "job 7 · attempt 1": 6.0,
        "job 8 · attempt 1": 65.0,
    }
    assert dict(zip(by_name["grown"].x, by_name["grown"].y, strict=True)) == {
        "job 7 · attempt 2": 12.5
    }
    grace = by_name["grace window"]
    assert list(grace.x) == ["job 7 · attempt 1", "job 7 · attempt 2", "job 8 · attempt 1"]
    assert list(grace.y) == [60.0, 60.0, 60.0]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([], "No job has been resized yet."),
        ([_resize(9, 1, (4, 2), free=None, lost=None)], "No resize has finished stopping yet."),
    ],
)
def test_empty_resize_charts_say_why(rows: list[ResizeStop], message: str) -> None:
    for figure in (charts.resize_lost_work_figure(rows), charts.resize_free_time_figure(rows)):
        assert figure.data == ()
        assert figure.layout.annotations[0].text == message


def test_no_stop_at_all_says_so() -> None:
    figure = charts.stops_by_team_figure([])
    assert figure.data == ()
    assert figure.layout.annotations[0].text == "No job has been preempted or resized yet."


def test_ranks_of_a_resized_attempt_wear_the_resize_colour_among_exit_codes() -> None:
    # Sorted, "resized" would come sixth of these reasons: the palette's red, which
    # only a failure may wear, had it no colour of its own.
    figure = charts.exit_code_figure(
        [
            (0, "a", 1),
            (0, "b", 1),
            (0, "c", 1),
            (0, "d", 1),
            (0, "e", 1),
            (0, "resized", 8),
        ]
    )
    colours = {trace.name: trace.marker.color for trace in figure.data}
    assert colours["resized"] == charts.RESIZE_COLOURS["shrink"] != charts.BAD
