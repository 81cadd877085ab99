"""The side-by-side table of ``make bench-kueue``: Kueue's figures, Quartermaster's, and their ratio.

Both sides hand in a dict of the same shape (``bench/kueue_side.py`` for Kueue,
``bench/kueue_qm.py`` for Quartermaster)::

    {"total_s": float, "usage": float (0..1), "preemptions": int,
     "admission": {class_name: {"mean_s": float, "p50_s": float, "p99_s": float}}}

A side of the reclaim comparison also hands in ``"reclaim": {"evictions",
"lost_gpu_seconds", "rerun_gpu_seconds"}`` (``bench/kueue_reclaim.py``, and
``bench/kueue_qm.py``'s figures from the mimic runtime's records).

The ratio column is always Quartermaster / Kueue, so below 1 means Quartermaster
took less time (or, for usage, kept less of the quota busy). Rows with a goal
(issue 18: total time and each class's mean time to admission at most half of
Kueue's on the same config; lost work in the reclaim comparison at most a tenth
of Kueue's) say whether the goal was met.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Quartermaster / Kueue at or below this meets the goal of a timed row.
TIME_GOAL_RATIO = 0.5
# Quartermaster / Kueue at or below this meets the goal of the lost-work row.
LOST_WORK_GOAL_RATIO = 0.1
MISSING = "-"


@dataclass(frozen=True)
class Row:
    label: str
    kueue: float | None
    quartermaster: float | None
    unit: str
    # The largest Quartermaster / Kueue ratio that meets the row's goal, if it has one.
    goal_ratio: float | None = None
    # The largest figure of Quartermaster's own that meets the row's goal (a count that
    # must be 0, say), for a row whose goal is no ratio.
    goal_max: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.kueue is None or self.quartermaster is None:
            return None
        if not _finite(self.kueue) or not _finite(self.quartermaster):
            return None
        if self.kueue == 0:
            return None
        return self.quartermaster / self.kueue

    @property
    def verdict(self) -> str:
        if self.goal_max is not None:
            if self.quartermaster is None or not _finite(self.quartermaster):
                return "no figure"
            return "met" if self.quartermaster <= self.goal_max else "missed"
        if self.goal_ratio is None:
            return ""
        ratio = self.ratio
        if ratio is None:
            return "no figure"
        return "met" if ratio <= self.goal_ratio else "missed"


def _finite(value: float) -> bool:
    return not math.isnan(value) and not math.isinf(value)


def _admission(side: dict[str, Any], cls: str, key: str) -> float | None:
    figures = (side.get("admission") or {}).get(cls)
    if figures is None or figures.get(key) is None:
        return None
    return float(figures[key])


def _class_order(kueue: dict[str, Any], quartermaster: dict[str, Any]) -> list[str]:
    """Classes from both sides, those Kueue reports first and in its order."""
    ordered = list(kueue.get("admission") or {})
    ordered += [c for c in (quartermaster.get("admission") or {}) if c not in ordered]
    return ordered


def _reclaim(side: dict[str, Any], key: str) -> float | None:
    value = (side.get("reclaim") or {}).get(key)
    return None if value is None else float(value)


def comparison_rows(
    kueue: dict[str, Any], quartermaster: dict[str, Any], *, time_goals: bool = True
) -> list[Row]:
    """The table's rows; `time_goals=False` drops the timing goals, which issue 18 sets
    on Kueue's own configs, not on the reclaim comparison."""
    time_goal = TIME_GOAL_RATIO if time_goals else None
    rows = [
        Row(
            "total time",
            kueue.get("total_s"),
            quartermaster.get("total_s"),
            "s",
            time_goal,
        )
    ]
    for cls in _class_order(kueue, quartermaster):
        for key, name, goal in (
            ("mean_s", "mean", time_goal),
            ("p50_s", "p50", None),
            ("p99_s", "p99", None),
        ):
            rows.append(
                Row(
                    f"{cls}: time to admission, {name}",
                    _admission(kueue, cls, key),
                    _admission(quartermaster, cls, key),
                    "s",
                    goal,
                )
            )
    usage_k = kueue.get("usage")
    usage_q = quartermaster.get("usage")
    rows.append(
        Row(
            "cluster usage",
            None if usage_k is None else usage_k * 100,
            None if usage_q is None else usage_q * 100,
            "%",
        )
    )
    rows.append(Row("preemptions", kueue.get("preemptions"), quartermaster.get("preemptions"), ""))
    rows += _placement_rows(kueue, quartermaster)
    # Only the reclaim comparison's Kueue side (bench/kueue_reclaim.py) has reclaim
    # figures; Quartermaster's side always has them, from the mimic runtime's records.
    if "reclaim" in kueue:
        rows += [
            Row(
                "victims' evictions",
                _reclaim(kueue, "evictions"),
                _reclaim(quartermaster, "evictions"),
                "",
            ),
            Row(
                "work lost since the last checkpoint",
                _reclaim(kueue, "lost_gpu_seconds"),
                _reclaim(quartermaster, "lost_gpu_seconds"),
                "GPU-s",
                LOST_WORK_GOAL_RATIO,
            ),
            Row(
                "work run again",
                _reclaim(kueue, "rerun_gpu_seconds"),
                _reclaim(quartermaster, "rerun_gpu_seconds"),
                "GPU-s",
            ),
        ]
    return rows


def _placement_rows(kueue: dict[str, Any], quartermaster: dict[str, Any]) -> list[Row]:
    """On a topology-aware config: the attempts placed across more than one domain of
    the level their workload requires (goal: none) and of the level it only prefers,
    from the placements recorded. Kueue's recorder keeps no placements, so its side
    shows none unless a figure is handed in."""
    placed = [side.get("placement") or {} for side in (kueue, quartermaster)]
    if not any(p.get("attempts_checked") for p in placed):
        return []

    def figure(side: dict[str, Any], key: str) -> float | None:
        return None if not side.get("attempts_checked") else float(side.get(key, 0))

    return [
        Row(
            "topology attempts checked",
            figure(placed[0], "attempts_checked"),
            figure(placed[1], "attempts_checked"),
            "",
        ),
        Row(
            "placed across a required domain",
            figure(placed[0], "across_required"),
            figure(placed[1], "across_required"),
            "",
            goal_max=0,
        ),
        Row(
            "placed across a preferred domain",
            figure(placed[0], "across_preferred"),
            figure(placed[1], "across_preferred"),
            "",
        ),
    ]


def _cell(value: float | None, unit: str) -> str:
    if value is None or not _finite(value):
        return MISSING
    if unit == "":
        return f"{value:.0f}"
    if unit == "%":
        return f"{value:.1f} %"
    if unit == "GPU-s":
        return f"{value:,.0f} {unit}"
    return f"{value:.2f} {unit}" if value < 10 else f"{value:.1f} {unit}"


def format_table(
    kueue: dict[str, Any],
    quartermaster: dict[str, Any],
    *,
    title: str = "",
    time_goals: bool = True,
) -> str:
    """The table as text, one row per figure, with the ratio and the goal's verdict."""
    header = ("figure", "Kueue", "Quartermaster", "QM / Kueue", "goal")
    body = []
    for row in comparison_rows(kueue, quartermaster, time_goals=time_goals):
        ratio = row.ratio
        goal = ""
        if row.goal_max is not None:
            goal = f"QM <= {row.goal_max:g}: {row.verdict}"
        elif row.goal_ratio is not None:
            goal = f"<= {row.goal_ratio:.2f}: {row.verdict}"
        body.append(
            (
                row.label,
                _cell(row.kueue, row.unit),
                _cell(row.quartermaster, row.unit),
                MISSING if ratio is None else f"{ratio:.2f}",
                goal,
            )
        )
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [cell.rjust(width) for cell, width in zip(cells[1:4], widths[1:4], strict=True)]
        return "  ".join([first, *rest, cells[4]]).rstrip()

    out = []
    if title:
        out.append(title)
    out.append(line(header))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(cells) for cells in body)
    return "\n".join(out)


def quartermaster_lines(figures: dict[str, Any]) -> list[str]:
    """Where Quartermaster's time went: how fast the REST API took the stream, and how
    long a job held its GPUs beyond its work (admission to launch, exit to its end
    being noticed)."""
    lines = ["Quartermaster:"]
    submission = figures.get("submission") or {}
    if submission:
        requests = submission.get("requests")
        how = f" in {requests:,} requests" if requests else ""
        lines.append(
            f"  the API took {figures.get('submitted', 0):,} submissions{how} in "
            f"{submission['done_s']:.1f} s (request mean {submission['request_mean_s']:.2f} s, "
            f"p99 {submission['request_p99_s']:.2f} s; the last sent up to "
            f"{submission['late_max_s']:.1f} s after its arrival time)"
        )
    refused = submission.get("errors") or []
    if refused:
        lines.append(f"  REFUSED: {len(refused)} requests, the first: {refused[0]}")
    launch = figures.get("launch_after_admission") or {}
    noticed = figures.get("end_noticed_after_exit") or {}
    if launch and noticed:
        lines.append(
            f"  launched {launch['mean_s']:.2f} s after admission (p99 {launch['p99_s']:.2f} s); "
            f"an end noticed {noticed['mean_s']:.2f} s after the exit (p99 {noticed['p99_s']:.2f} s)"
        )
    held = figures.get("gpu_seconds") or {}
    unit = figures.get("unit_millis") or 1000
    if unit != 1000:
        lines.append(
            f"  one GPU here stands for {unit}m of the config's resource (Quartermaster "
            "counts whole GPUs; every quota, request and node is counted in that unit)"
        )
    if held:
        lines.append(f"  GPUs held {held['held']:,.0f} GPU-s for {held['work']:,.0f} GPU-s of work")
    placement = figures.get("placement") or {}
    if placement.get("attempts_checked"):
        lines.append(
            f"  placements checked: {placement['attempts_checked']:,} attempts of topology-aware "
            f"workloads, {placement['across_required']} across a domain they required, "
            f"{placement['across_preferred']} across one they only preferred, "
            f"{placement['unknown_nodes']} on a node without the level's label"
        )
        if placement.get("offenders"):
            lines.append(f"  across a required domain: {', '.join(placement['offenders'])}")
    return lines if len(lines) > 1 else []
