"""Whole-gang eviction against elastic jobs: two runs of one trace side by side (issue 47).

:func:`compare_elastic` replays a trace twice, once as it is and once with a share of its
multi-GPU jobs elastic (``SimulationConfig.elastic_share``), and :func:`comparison_lines`
prints the figures the issue asks about with their ratios to its goals: mean completion time
at least 20% lower, the wait of a job inside its team's guarantee (a returning owner's) at
least twice shorter, and no team below its guarantee line longer than one cycle plus the grace
window.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from simulation.engine import Progress, SimulationConfig, simulate
from simulation.report import Report, percentile
from simulation.traces import TraceJob

# The goals of issue 47 for elastic jobs against whole-gang eviction.
COMPLETION_GOAL = 0.8  # mean completion time at most this share of the eviction run's
OWNER_WAIT_GOAL = 2.0  # the returning owner's wait at least this many times shorter


@dataclass(frozen=True, slots=True)
class ElasticComparison:
    """The two runs of one trace: ``whole_gang`` (no elastic job) and ``elastic``."""

    share: float
    whole_gang: Report
    elastic: Report
    # One scheduling cycle plus the grace window: the longest a team may stay below its line.
    bound_seconds: float


def compare_elastic(
    trace: list[TraceJob],
    config: SimulationConfig,
    share: float,
    progress: Callable[[Progress], None] | None = None,
) -> ElasticComparison:
    """Replay ``trace`` under ``config`` without elastic jobs, then with ``share`` of its
    multi-GPU jobs elastic."""
    whole_gang = simulate(trace, replace(config, elastic_share=0.0), progress)
    elastic = simulate(trace, replace(config, elastic_share=share), progress)
    return ElasticComparison(
        share, whole_gang, elastic, config.cycle_seconds + config.grace_seconds
    )


def owner_waits(report: Report) -> dict[str, float]:
    """The returning owners' waits: of the jobs that waited inside their team's unused
    guarantee at all (those for which it had to be taken back), how many, their mean and
    p90; and the longest wait of any job inside its guarantee."""
    waits = [wait for wait in report.inside_guarantee_wait_by_job.values() if wait > 0]
    return {
        "jobs": len(waits),
        "mean": sum(waits) / len(waits) if waits else 0.0,
        "p90": percentile(waits, 0.9),
        "max": report.longest_inside_guarantee_wait_seconds,
    }


def _ratio(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator``; infinite when only the denominator is 0 (a wait that
    vanished is shorter by any factor), None when both are."""
    if denominator > 0:
        return numerator / denominator
    return math.inf if numerator > 0 else None


def _times(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def comparison_lines(comparison: ElasticComparison) -> list[str]:
    """The side-by-side table and the goals, as lines for the terminal."""
    base, elastic = comparison.whole_gang, comparison.elastic
    base_wait, elastic_wait = owner_waits(base), owner_waits(elastic)
    bound = comparison.bound_seconds

    def share(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1%}"

    def completion(report: Report) -> str:
        figures = report.completion_time_seconds
        return f"{figures['mean']:.0f} / {figures['p50']:.0f} / {figures['p99']:.0f}"

    def waits(figures: dict[str, float]) -> str:
        return f"{figures['jobs']:.0f} jobs, mean {figures['mean']:.1f}, p90 {figures['p90']:.1f}"

    resizes = elastic.resizes or {"shrinks": 0, "grows": 0}
    rows = [
        ("jobs completed", f"{base.run['jobs_completed']}/{base.run['jobs']}",
         f"{elastic.run['jobs_completed']}/{elastic.run['jobs']}"),
        ("elastic jobs", "0", str(elastic.run.get("elastic_jobs", 0))),
        ("completion s (mean / p50 / p99)", completion(base), completion(elastic)),
        ("allocation while jobs wait", share(base.allocation["while_jobs_wait"]),
         share(elastic.allocation["while_jobs_wait"])),
        ("owners' waits inside guarantee s", waits(base_wait), waits(elastic_wait)),
        ("longest wait inside guarantee s", f"{base_wait['max']:.1f}",
         f"{elastic_wait['max']:.1f}"),
        (f"longest below line s (bound {bound:g})",
         f"{base.longest_below_guarantee_line_seconds:.1f}",
         f"{elastic.longest_below_guarantee_line_seconds:.1f}"),
        ("lost GPU-hours", f"{base.lost_gpu_hours:.1f}", f"{elastic.lost_gpu_hours:.1f}"),
        ("preemptions", str(base.preemptions), str(elastic.preemptions)),
        ("shrinks / grows", "0 / 0", f"{resizes['shrinks']} / {resizes['grows']}"),
    ]  # fmt: skip
    title = f"elastic share {comparison.share:g}"
    width = max(len(label) for label, _, _ in rows)
    left = max(len("whole-gang eviction"), *(len(b) for _, b, _ in rows))
    lines = [f"{'':{width}}  {'whole-gang eviction':>{left}}  {title}"]
    lines += [f"{label:{width}}  {b:>{left}}  {e}" for label, b, e in rows]
    completion_ratio = _ratio(
        elastic.completion_time_seconds["mean"], base.completion_time_seconds["mean"]
    )
    wait_ratio = _ratio(base_wait["mean"], elastic_wait["mean"])
    longest_ratio = _ratio(base_wait["max"], elastic_wait["max"])
    line_ok = elastic.longest_below_guarantee_line_seconds <= bound
    lines += [
        f"goal: mean completion time at most {COMPLETION_GOAL:.0%} of whole-gang eviction's: "
        f"{_times(completion_ratio)} -> "
        f"{'met' if completion_ratio is not None and completion_ratio <= COMPLETION_GOAL else 'NOT met'}",
        f"goal: a returning owner waits at least {OWNER_WAIT_GOAL:g}x less: mean "
        f"{_times(wait_ratio)}, longest {_times(longest_ratio)} shorter -> "
        f"{'met' if wait_ratio is not None and wait_ratio >= OWNER_WAIT_GOAL else 'NOT met'}",
        f"goal: no team below its guarantee line longer than cycle + grace = {bound:g} s: "
        f"longest {elastic.longest_below_guarantee_line_seconds:.1f} s -> "
        f"{'met' if line_ok else 'NOT met'}",
    ]
    return lines
