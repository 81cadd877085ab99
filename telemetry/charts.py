"""Plotly figures for the telemetry page.

Pure functions: selector output in, a `plotly.graph_objects.Figure` out. No
database, no request, no clock, so each figure can be tested with plain data.
Views only hand `figure.to_json()` to the templates.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

import plotly.graph_objects as go

from telemetry.mission import MISSION
from telemetry.selectors import CheckpointAgainstGrace, SimulationReport, UtilizationPoint

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


def utilization_figure(points: Sequence[UtilizationPoint], *, flavor: str) -> go.Figure:
    """GPUs used over time stacked by team, with each team's guarantee at that
    time as a dashed line of the team's colour, and the flavor's capacity."""
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
    return figure


def borrowed_share_figure(points: Sequence[UtilizationPoint], *, flavor: str) -> go.Figure:
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
    return figure


def signal_latency_figure(
    latencies: Sequence[float], *, target_seconds: float = MISSION.signal_propagation_seconds
) -> go.Figure:
    """How long the signal took from the preemption decision to each rank."""
    figure = go.Figure()
    _layout(figure, title="Signal latency: decision → rank received", x="seconds", y="ranks")
    if not latencies:
        return _empty(figure, "No rank has been signalled yet.")
    figure.add_trace(
        go.Histogram(
            x=list(latencies),
            name="ranks",
            marker={"color": PALETTE[0]},
            # 50 ms bins: fine enough against the signal target, readable with few ranks.
            xbins={"size": 0.05},
        )
    )
    figure.add_vline(
        x=target_seconds,
        line={"color": PALETTE[5], "dash": "dash"},
        annotation_text=f"target {target_seconds:g} s",
    )
    figure.update_layout(hovermode="closest", showlegend=False)
    return figure


def checkpoint_grace_figure(rows: Sequence[CheckpointAgainstGrace]) -> go.Figure:
    """Each preemption's checkpoint duration next to its grace window."""
    figure = go.Figure()
    _layout(
        figure, title="Checkpoint duration against the grace window", x="preemption", y="seconds"
    )
    if not rows:
        return _empty(figure, "No preemption has reported a checkpoint yet.")
    labels = [f"job {r.job_id} · {r.decided_at:%m-%d %H:%M}" for r in rows]
    figure.add_trace(
        go.Bar(
            x=labels,
            y=[r.checkpoint_seconds for r in rows],
            name="checkpoint",
            marker={
                "color": [
                    PALETTE[1]
                    if MISSION.checkpoint_met(r.checkpoint_seconds, r.grace_seconds)
                    else PALETTE[5]
                    for r in rows
                ]
            },
            customdata=[r.outcome for r in rows],
            hovertemplate="%{x}<br>checkpoint %{y:.2f} s<br>%{customdata}<extra></extra>",
        )
    )
    figure.add_trace(
        go.Scatter(
            x=labels,
            y=[r.grace_seconds for r in rows],
            name="grace window",
            mode="lines+markers",
            line={"color": MUTED, "dash": "dash", "shape": "hv"},
        )
    )
    figure.update_layout(hovermode="closest")
    return figure


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
                marker={"color": PALETTE[index % len(PALETTE)]},
            )
        )
    figure.update_layout(barmode="stack", hovermode="closest")
    figure.update_xaxes(type="category")
    return figure


def recovery_figure(
    rows: Sequence[tuple[int, float]], *, target_seconds: float = MISSION.recovery_seconds
) -> go.Figure:
    """Seconds from each preemption decision until the job resumed."""
    figure = go.Figure()
    _layout(figure, title="Recovery: decision → resumed", x="seconds", y="preemptions")
    if not rows:
        return _empty(figure, "No preempted job has resumed yet.")
    figure.add_trace(
        go.Histogram(
            x=[seconds for _, seconds in rows],
            name="preemptions",
            marker={"color": PALETTE[3]},
            xbins={"size": 5.0},
        )
    )
    figure.add_vline(
        x=target_seconds,
        line={"color": PALETTE[5], "dash": "dash"},
        annotation_text=f"target {target_seconds:g} s",
    )
    figure.update_layout(hovermode="closest", showlegend=False)
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
