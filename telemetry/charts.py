"""Plotly figures for the telemetry page.

Pure functions: selector output in, a `plotly.graph_objects.Figure` out. No
database, no request, no clock, so each figure can be tested with plain data.
Views only hand `figure.to_json()` to the templates.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from datetime import datetime

import plotly.graph_objects as go

from telemetry.history_selectors import UtilizationPoint
from telemetry.mission import MISSION
from telemetry.preemption_selectors import (
    GROW,
    SHRINK,
    CheckpointAgainstGrace,
    ResizeStop,
    StopsOfTeam,
)
from telemetry.report_selectors import SimulationReport

# One palette for every chart, matching the portal's CSS.
PALETTE = (
    "#2563eb",
    "#16a34a",
    "#d97706",
    "#9333ea",
    "#0891b2",
    "#dc2626",
    "#4f46e5",
    "#65a30d",
    "#db2777",
    "#0d9488",
)
INK = "#1f2937"
MUTED = "#6b7280"
GRID = "#e5e7eb"
# Colours that carry a meaning, the same as the portal's state pills: green
# went well, red failed, amber was stopped to make room, grey was stopped by a
# person. A chart never gives "failed" a colour that a success also wears.
GOOD = "#16a34a"
BAD = "#dc2626"
WARN = "#d97706"
OUTCOME_COLOURS = {
    "succeeded": GOOD,
    "failed": BAD,
    "preempted": WARN,
    "gang-guard": "#9333ea",
    "cancelled": MUTED,
    "running": "#2563eb",
    # Stopped at an agreed step and relaunched at once at another size.
    "resized": "#0891b2",
}
# The two ways a resize goes, in words and colours shared by every resize chart;
# neither wears a preemption's amber, since a resize gives the job back at once.
RESIZE_NAMES = {SHRINK: "shrunk", GROW: "grown"}
RESIZE_COLOURS = {SHRINK: OUTCOME_COLOURS["resized"], GROW: "#4f46e5"}


def _layout(figure: go.Figure, *, title: str, x: str, y: str, height: int = 320) -> go.Figure:
    figure.update_layout(
        # No plotly template: the styling is set here, and the page stays small.
        template="none",
        title={
            "text": title,
            "x": 0.01,
            "xanchor": "left",
            "y": 0.98,
            "yanchor": "top",
            "yref": "container",
            "font": {"size": 14, "color": INK},
        },
        height=height,
        margin={"l": 56, "r": 16, "t": 72, "b": 48},
        paper_bgcolor="#ffffff",
        plot_bgcolor="#ffffff",
        font={
            "family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif",
            "size": 12,
            "color": INK,
        },
        # The legend sits between the title and the plot, clear of the axis titles.
        legend={"orientation": "h", "x": 0.0, "xanchor": "left", "y": 1.02, "yanchor": "bottom"},
        hovermode="x unified",
        bargap=0.08,
    )
    figure.update_xaxes(title_text=x, gridcolor=GRID, linecolor=GRID, zeroline=False)
    figure.update_yaxes(title_text=y, gridcolor=GRID, linecolor=GRID, zeroline=False)
    return figure


def _count_axis(figure: go.Figure, top: int) -> None:
    """A y axis of counts shows whole numbers only, from zero. Up to ten, every
    whole number gets a tick; above that plotly's own steps are whole already."""
    settings: dict[str, object] = {"rangemode": "tozero", "tickformat": ",d"}
    if top <= 10:
        settings.update(tick0=0, dtick=1)
    figure.update_yaxes(**settings)


def _bins(values: Sequence[float], size: float) -> tuple[float, int]:
    """Where the histogram's bins start (a multiple of `size` at or below the
    smallest value) and the most values any one bin holds."""
    start = math.floor(min(values) / size) * size
    counts = Counter(math.floor((value - start) / size) for value in values)
    return start, max(counts.values())


def _time_range(figure: go.Figure, since: datetime | None, until: datetime | None) -> None:
    """Draw the whole chosen period, even where there are no samples yet."""
    if since is not None and until is not None:
        figure.update_xaxes(range=[since, until])


def _empty(figure: go.Figure, message: str) -> go.Figure:
    figure.add_annotation(
        text=message,
        showarrow=False,
        xref="paper",
        yref="paper",
        x=0.5,
        y=0.5,
        font={"color": MUTED, "size": 13},
    )
    figure.update_xaxes(visible=False)
    figure.update_yaxes(visible=False)
    return figure


def utilization_figure(
    points: Sequence[UtilizationPoint],
    *,
    flavor: str,
    since: datetime | None = None,
    until: datetime | None = None,
) -> go.Figure:
    """GPUs used over time stacked by team, with each team's guarantee at that
    time as a dashed line of the team's colour, and the flavor's capacity,
    drawn over the whole period from `since` to `until`."""
    figure = go.Figure()
    mine = [p for p in points if p.flavor == flavor]
    _layout(figure, title=f"GPUs in use by team — {flavor}", x="time (UTC)", y="GPUs", height=360)
    if not mine:
        return _empty(figure, "No utilization samples in this period yet.")
    teams = sorted({p.team for p in mine})
    by_team: dict[str, list[UtilizationPoint]] = defaultdict(list)
    for point in mine:
        by_team[point.team].append(point)
    for index, team in enumerate(teams):
        colour = PALETTE[index % len(PALETTE)]
        series = by_team[team]
        figure.add_trace(
            go.Scatter(
                x=[p.at for p in series],
                y=[p.used for p in series],
                name=f"{team} used",
                mode="lines",
                stackgroup="used",
                line={"width": 0.5, "color": colour},
                legendgroup=team,
            )
        )
    for index, team in enumerate(teams):
        colour = PALETTE[index % len(PALETTE)]
        series = by_team[team]
        figure.add_trace(
            go.Scatter(
                x=[p.at for p in series],
                y=[p.guarantee for p in series],
                name=f"{team} guarantee",
                mode="lines",
                line={"dash": "dash", "width": 1.5, "color": colour},
                legendgroup=team,
            )
        )
    capacity: dict[object, int] = {}
    for point in mine:
        capacity[point.at] = point.capacity
    if any(capacity.values()):
        moments = sorted(capacity)
        figure.add_trace(
            go.Scatter(
                x=moments,
                y=[capacity[m] for m in moments],
                name="capacity",
                mode="lines",
                line={"color": MUTED, "width": 1, "dash": "dot"},
            )
        )
    _time_range(figure, since, until)
    figure.update_yaxes(rangemode="tozero", tickformat=",d")
    return figure


def borrowed_share_figure(
    points: Sequence[UtilizationPoint],
    *,
    flavor: str,
    since: datetime | None = None,
    until: datetime | None = None,
) -> go.Figure:
    """The share of GPUs in use that ran on borrowed capacity, over time."""
    figure = go.Figure()
    _layout(
        figure,
        title=f"Borrowed share of GPUs in use — {flavor}",
        x="time (UTC)",
        y="borrowed / used",
    )
    used: dict[object, int] = defaultdict(int)
    borrowed: dict[object, int] = defaultdict(int)
    for point in points:
        if point.flavor == flavor:
            used[point.at] += point.used
            borrowed[point.at] += point.borrowed
    if not used:
        return _empty(figure, "No utilization samples in this period yet.")
    moments = sorted(used)
    figure.add_trace(
        go.Scatter(
            x=moments,
            y=[borrowed[m] / used[m] if used[m] else 0.0 for m in moments],
            name="borrowed share",
            mode="lines",
            line={"color": PALETTE[2], "width": 2},
            fill="tozeroy",
            fillcolor="rgba(217,119,6,0.12)",
        )
    )
    figure.update_yaxes(tickformat=".0%", range=[0, 1])
    _time_range(figure, since, until)
    return figure


def signal_latency_figure(
    latencies: Sequence[float], *, target_seconds: float = MISSION.signal_propagation_seconds
) -> go.Figure:
    """How long the signal took from the preemption decision to each rank."""
    figure = go.Figure()
    _layout(figure, title="Signal latency: decision → rank received", x="seconds", y="ranks")
    if not latencies:
        return _empty(figure, "No rank has been signalled yet.")
    # 50 ms bins: fine enough against the signal target, readable with few ranks.
    start, top = _bins(latencies, 0.05)
    figure.add_trace(
        go.Histogram(
            x=list(latencies),
            name="ranks",
            marker={"color": PALETTE[0]},
            xbins={"start": start, "size": 0.05},
        )
    )
    _count_axis(figure, top)
    figure.add_vline(
        x=target_seconds,
        line={"color": PALETTE[5], "dash": "dash"},
        annotation_text=f"target {target_seconds:g} s",
    )
    figure.update_layout(hovermode="closest", showlegend=False)
    return figure


def checkpoint_grace_figure(rows: Sequence[CheckpointAgainstGrace]) -> go.Figure:
    """Each preemption's checkpoint time as a share of its own grace window, so
    a 2 s checkpoint in a 60 s window is a visible 3 % bar rather than a sliver
    on a 0–60 s scale, and windows of different lengths compare directly."""
    figure = go.Figure()
    _layout(
        figure,
        title="Checkpoint time as a share of its grace window",
        x="preemption",
        y="share of the grace window",
    )
    if not rows:
        return _empty(figure, "No preemption has reported a checkpoint yet.")
    labels = [f"job {r.job_id} · {r.decided_at:%m-%d %H:%M}" for r in rows]
    shares = [checkpoint_share(r) for r in rows]
    figure.add_trace(
        go.Bar(
            x=labels,
            y=shares,
            name="checkpoint",
            marker={
                "color": [
                    GOOD if MISSION.checkpoint_met(r.checkpoint_seconds, r.grace_seconds) else BAD
                    for r in rows
                ]
            },
            customdata=[[r.checkpoint_seconds, r.grace_seconds, r.outcome] for r in rows],
            hovertemplate=(
                "%{x}<br>checkpoint %{customdata[0]:.2f} s of %{customdata[1]:g} s"
                " (%{y:.1%})<br>%{customdata[2]}<extra></extra>"
            ),
        )
    )
    figure.add_trace(
        go.Scatter(
            x=labels,
            y=[1.0] * len(rows),
            name="grace window",
            mode="lines",
            line={"color": MUTED, "dash": "dash", "shape": "hv"},
            hoverinfo="skip",
        )
    )
    target = MISSION.checkpoint_share_of_grace
    if target < 1.0:
        # A stricter target than the window itself gets a line of its own.
        figure.add_hline(
            y=target,
            line={"color": BAD, "dash": "dot", "width": 1},
            annotation_text=f"target ≤ {target:.0%}",
        )
    figure.update_layout(hovermode="closest")
    figure.update_yaxes(tickformat=".0%", range=[0, max(1.05, max(shares) * 1.1)])
    return figure


def checkpoint_share(row: CheckpointAgainstGrace) -> float:
    """Checkpoint seconds over grace seconds; with no grace window at all, any
    checkpoint took the whole window (1.0) and none took nothing."""
    if row.grace_seconds > 0:
        return row.checkpoint_seconds / row.grace_seconds
    return 1.0 if row.checkpoint_seconds > 0 else 0.0


def exit_code_figure(counts: Sequence[tuple[int, str, int]]) -> go.Figure:
    """Ranks per exit code, stacked by how their attempt ended."""
    figure = go.Figure()
    _layout(figure, title="Exit codes of ranks", x="exit code", y="ranks")
    if not counts:
        return _empty(figure, "No rank has exited yet.")
    codes = sorted({code for code, _, _ in counts})
    reasons = sorted({reason for _, reason, _ in counts})
    table = Counter({(code, reason): n for code, reason, n in counts})
    for index, reason in enumerate(reasons):
        figure.add_trace(
            go.Bar(
                x=[str(code) for code in codes],
                y=[table[(code, reason)] for code in codes],
                name=reason,
                marker={"color": OUTCOME_COLOURS.get(reason, PALETTE[index % len(PALETTE)])},
            )
        )
    figure.update_layout(barmode="stack", hovermode="closest")
    figure.update_xaxes(type="category")
    _count_axis(figure, max(sum(table[(code, r)] for r in reasons) for code in codes))
    return figure


def recovery_figure(
    rows: Sequence[tuple[int, float]], *, target_seconds: float = MISSION.recovery_seconds
) -> go.Figure:
    """Seconds from each preemption decision until the job resumed."""
    figure = go.Figure()
    _layout(figure, title="Recovery: decision → resumed", x="seconds", y="preemptions")
    if not rows:
        return _empty(figure, "No preempted job has resumed yet.")
    seconds = [value for _, value in rows]
    start, top = _bins(seconds, 5.0)
    figure.add_trace(
        go.Histogram(
            x=seconds,
            name="preemptions",
            marker={"color": PALETTE[3]},
            xbins={"start": start, "size": 5.0},
        )
    )
    _count_axis(figure, top)
    figure.add_vline(
        x=target_seconds,
        line={"color": PALETTE[5], "dash": "dash"},
        annotation_text=f"target {target_seconds:g} s",
    )
    figure.update_layout(hovermode="closest", showlegend=False)
    return figure


def stops_by_team_figure(rows: Sequence[StopsOfTeam]) -> go.Figure:
    """Per team, how often its running jobs were preempted, shrunk, or stopped
    to grow, side by side: a resize is no preemption, yet it stops the gang at
    an agreed step as a preemption does."""
    figure = go.Figure()
    _layout(figure, title="Preemptions and resizes by team", x="team", y="stops")
    if not rows:
        return _empty(figure, "No job has been preempted or resized yet.")
    teams = [row.team for row in rows]
    for name, counts, colour in (
        ("preempted", [row.preemptions for row in rows], WARN),
        (RESIZE_NAMES[SHRINK], [row.shrinks for row in rows], RESIZE_COLOURS[SHRINK]),
        (RESIZE_NAMES[GROW], [row.grows for row in rows], RESIZE_COLOURS[GROW]),
    ):
        figure.add_trace(go.Bar(x=teams, y=counts, name=name, marker={"color": colour}))
    figure.update_layout(barmode="group", hovermode="closest")
    figure.update_xaxes(type="category")
    _count_axis(figure, max(max(row.preemptions, row.shrinks, row.grows) for row in rows))
    return figure


def resize_label(row: ResizeStop) -> str:
    """A resize's name on an axis: one resize stops one attempt, so no two share it."""
    return f"job {row.job_id} · attempt {row.attempt}"


def _resize_bars(
    figure: go.Figure, rows: Sequence[ResizeStop], values: Sequence[float], *, unit: str
) -> None:
    """One bar per resize in the order given, coloured by its direction, with its
    sizes, team, time and cause on hover."""
    for direction in (SHRINK, GROW):
        mine = [
            (row, value)
            for row, value in zip(rows, values, strict=True)
            if row.direction == direction
        ]
        if not mine:
            continue
        figure.add_trace(
            go.Bar(
                x=[resize_label(row) for row, _ in mine],
                y=[value for _, value in mine],
                name=RESIZE_NAMES[direction],
                marker={"color": RESIZE_COLOURS[direction]},
                customdata=[
                    [
                        row.from_ranks,
                        row.to_ranks,
                        row.team,
                        f"{row.decided_at:%Y-%m-%d %H:%M:%S}",
                        row.cause,
                    ]
                    for row, _ in mine
                ],
                hovertemplate=(
                    "%{x}: %{customdata[0]} → %{customdata[1]} ranks (%{customdata[2]})"
                    "<br>%{y:,.1f} " + unit + " · decided %{customdata[3]} UTC"
                    "<br>%{customdata[4]}<extra></extra>"
                ),
            )
        )
    # Shrinks and grows are two traces on one category axis: stacked, each bar
    # keeps its full width, and the axis keeps the resizes in time order.
    figure.update_layout(barmode="relative", hovermode="closest")
    figure.update_xaxes(
        type="category",
        categoryorder="array",
        categoryarray=[resize_label(row) for row in rows],
    )
    figure.update_yaxes(rangemode="tozero")


def resize_lost_work_figure(rows: Sequence[ResizeStop]) -> go.Figure:
    """The work each resize lost, in GPU-seconds: the gang's GPUs times the
    seconds since its last checkpoint when it stopped (none after a checkpoint
    taken for the resize). A resize still stopping has lost nothing known yet
    and is left out."""
    figure = go.Figure()
    _layout(figure, title="Work lost per resize", x="resize", y="GPU-seconds lost")
    done = [row for row in rows if row.lost_gpu_seconds is not None]
    if not done:
        message = "No resize has finished stopping yet." if rows else "No job has been resized yet."
        return _empty(figure, message)
    _resize_bars(figure, done, [row.lost_gpu_seconds or 0.0 for row in done], unit="GPU-s lost")
    return figure


def resize_free_time_figure(rows: Sequence[ResizeStop]) -> go.Figure:
    """Seconds from each resize decision until every rank of the stopped gang had
    exited: for a shrink, until the GPUs it gives up were free for the job that
    waits for them; for a grow, until the relaunch at the larger size could
    begin. Each resize's grace window is drawn beside it: a bar that reaches it
    was killed at the deadline."""
    figure = go.Figure()
    _layout(
        figure,
        title="Resize: decision → GPUs free (every rank exited)",
        x="resize",
        y="seconds",
    )
    done = [row for row in rows if row.seconds_to_free is not None]
    if not done:
        message = "No resize has finished stopping yet." if rows else "No job has been resized yet."
        return _empty(figure, message)
    _resize_bars(figure, done, [row.seconds_to_free or 0.0 for row in done], unit="s")
    figure.add_trace(
        go.Scatter(
            x=[resize_label(row) for row in done],
            y=[row.grace_seconds for row in done],
            name="grace window",
            mode="lines",
            line={"color": MUTED, "dash": "dash", "shape": "hv"},
            hoverinfo="skip",
        )
    )
    return figure


def simulation_teams_figure(report: SimulationReport) -> go.Figure:
    """GPU-hours each team used, borrowed and lent in one simulated run."""
    figure = go.Figure()
    _layout(
        figure,
        title=f"GPU-hours per team — {report.name} ({report.policy})",
        x="team",
        y="GPU-hours",
        height=360,
    )
    teams = report.report.get("teams") or {}
    if not teams:
        return _empty(figure, "The report names no teams.")
    names = sorted(teams)
    for index, (key, label) in enumerate(
        (
            ("gpu_hours_used", "used"),
            ("gpu_hours_borrowed", "borrowed"),
            ("gpu_hours_lent", "lent"),
        )
    ):
        figure.add_trace(
            go.Bar(
                x=names,
                y=[teams[name].get(key, 0) for name in names],
                name=label,
                marker={"color": PALETTE[index]},
            )
        )
    figure.update_layout(barmode="group", hovermode="closest")
    return figure


def simulation_comparison_figure(reports: Sequence[SimulationReport]) -> go.Figure:
    """GPU allocation and p99 queueing delay of each stored run, side by side."""
    figure = go.Figure()
    _layout(
        figure,
        title="Runs compared: allocation and p99 queueing delay",
        x="run",
        y="allocation",
        height=360,
    )
    if not reports:
        return _empty(figure, "No simulation report stored yet.")
    labels = [f"#{r.run_id} {r.policy}" for r in reports]
    figure.add_trace(
        go.Bar(
            x=labels,
            y=[r.allocation for r in reports],
            name="allocation",
            marker={"color": PALETTE[0]},
        )
    )
    figure.add_trace(
        go.Scatter(
            x=labels,
            y=[r.queueing.get("p99") for r in reports],
            name="p99 queueing (s)",
            mode="markers",
            marker={"color": PALETTE[2], "size": 10},
            yaxis="y2",
        )
    )
    figure.update_layout(
        hovermode="closest",
        yaxis={"tickformat": ".0%", "range": [0, 1]},
        yaxis2={
            "title": {"text": "p99 queueing (s)", "standoff": 8},
            "overlaying": "y",
            "side": "right",
            "showgrid": False,
            "rangemode": "tozero",
        },
        margin={"r": 72},
    )
    return figure
