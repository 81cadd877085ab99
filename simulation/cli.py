"""Command line of the trace replay: ``python -m simulation ...`` (and ``manage.py simulate``).

:func:`add_arguments` declares every option on any argparse parser, so the Django command can
reuse it; :func:`run_simulation` takes the parsed options (a namespace or a mapping such as the
``options`` of a Django command) and returns the :class:`~simulation.report.Report`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import fairshare
from simulation.elastic import compare_elastic, comparison_lines
from simulation.engine import GANG_TOPOLOGIES, POLICIES, Progress, SimulationConfig, simulate
from simulation.report import Report
from simulation.traces import (
    FORMATS,
    ClusterNode,
    TraceError,
    TraceJob,
    derive_quotas,
    load_cluster,
    load_helios_quotas,
    load_quotas,
    load_trace,
    rack_layout,
    uniform_cluster,
)

# The shared data folder sits next to the project root (../shared/data from /work/main).
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
DEFAULT_OPENB_TRACE = SHARED_DATA / "openb_pod_list_default.csv"
DEFAULT_HELIOS_QUOTAS = SHARED_DATA / "helios_venus_vc_gpus_daily.csv"

DEFAULTS: dict[str, Any] = {
    "trace": None,
    "format": "generic",
    "nodes": None,
    "gpus_per_node": 8,
    "cluster": None,
    "quotas": None,
    "derive_quotas": False,
    "quotas_from_helios": None,
    "helios_file": DEFAULT_HELIOS_QUOTAS,
    "policy": "fairshare",
    "checkpoint_interval": 1800.0,
    "save_seconds": 30.0,
    "restart_seconds": 60.0,
    "cycle_seconds": 1.0,
    "grace_seconds": 120.0,
    "arrival_scale": 1.0,
    "json": None,
    "seed": 0,
    "min_runtime": None,
    "usage_strength": 0.0,
    "half_life": 7 * 86_400.0,
    "rack_size": None,
    "gang_topology": "none",
    "elastic_share": 0.0,
    "progress": True,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the simulation's options (the names of issue 8) on ``parser``."""
    parser.add_argument(
        "--trace",
        type=Path,
        help="trace file (default for --format openb: ../shared/data/openb_pod_list_default.csv)",
    )
    parser.add_argument("--format", choices=FORMATS, default=DEFAULTS["format"])
    parser.add_argument("--nodes", type=int, help="number of identical nodes")
    parser.add_argument("--gpus-per-node", type=int, default=DEFAULTS["gpus_per_node"])
    parser.add_argument(
        "--cluster", type=Path, help="cluster CSV: name,gpus (or the openb node list)"
    )
    quotas = parser.add_mutually_exclusive_group()
    quotas.add_argument("--quotas", type=Path, help="quota CSV: team,guarantee")
    quotas.add_argument(
        "--derive-quotas",
        action="store_true",
        help="guarantees proportional to each team's share of the trace's GPU time",
    )
    quotas.add_argument(
        "--quotas-from-helios",
        metavar="DATE",
        help="guarantees from one day (YYYY-MM-DD) of the Helios Venus virtual clusters",
    )
    parser.add_argument("--helios-file", type=Path, default=DEFAULTS["helios_file"])
    parser.add_argument("--policy", choices=POLICIES, default=DEFAULTS["policy"])
    parser.add_argument(
        "--checkpoint-interval",
        type=float,
        default=DEFAULTS["checkpoint_interval"],
        help="seconds of work between checkpoints (0: never)",
    )
    parser.add_argument("--save-seconds", type=float, default=DEFAULTS["save_seconds"])
    parser.add_argument("--restart-seconds", type=float, default=DEFAULTS["restart_seconds"])
    parser.add_argument("--cycle-seconds", type=float, default=DEFAULTS["cycle_seconds"])
    parser.add_argument(
        "--grace-seconds",
        type=float,
        default=DEFAULTS["grace_seconds"],
        help="grace window of the (single, preemptible) priority class",
    )
    parser.add_argument(
        "--arrival-scale",
        type=float,
        default=DEFAULTS["arrival_scale"],
        help="multiply submit times by this factor (below 1 compresses the trace)",
    )
    parser.add_argument(
        "--min-runtime",
        action="append",
        metavar="REASON=SECONDS",
        help=(
            "the priority class's minimum runtime before preemption for one reason "
            f"({', '.join(fairshare.PREEMPTION_REASONS)}); may repeat"
        ),
    )
    parser.add_argument(
        "--usage-strength",
        type=float,
        default=DEFAULTS["usage_strength"],
        help="how strongly a team's decayed usage beyond its guarantee lowers its share of "
        "the spare GPUs (0: weight alone)",
    )
    parser.add_argument(
        "--half-life",
        type=float,
        default=DEFAULTS["half_life"],
        metavar="SECONDS",
        help="half-life of decayed usage; default a week",
    )
    parser.add_argument(
        "--rack-size",
        type=int,
        metavar="NODES",
        help="group the nodes into racks of this many (the openb node list: inside each GPU "
        "model); without it nodes have no topology",
    )
    parser.add_argument(
        "--gang-topology",
        choices=GANG_TOPOLOGIES,
        default=DEFAULTS["gang_topology"],
        help="gangs of more than one rank require one rack, prefer one, or ask nothing",
    )
    parser.add_argument(
        "--elastic-share",
        type=float,
        default=DEFAULTS["elastic_share"],
        metavar="SHARE",
        help="this share of the multi-GPU jobs (drawn with --seed) is elastic, from half its "
        "ranks to all, and the scheduler may shrink and grow them (0: none)",
    )
    parser.add_argument("--json", type=Path, help="write the JSON report here")
    parser.add_argument(
        "--compare-elastic",
        type=float,
        metavar="SHARE",
        help="run twice, without elastic jobs and with this share of the multi-GPU jobs "
        "elastic, and print the two side by side (python -m simulation only)",
    )
    parser.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar on stderr"
    )


def _options(options: argparse.Namespace | Mapping[str, Any]) -> dict[str, Any]:
    given = vars(options) if isinstance(options, argparse.Namespace) else dict(options)
    merged = dict(DEFAULTS)
    for key in DEFAULTS:
        if given.get(key) is not None:
            merged[key] = given[key]
    return merged


def _cluster(opts: Mapping[str, Any], guarantees: Mapping[str, int] | None) -> list[ClusterNode]:
    if opts["cluster"] is not None:
        if opts["nodes"] is not None:
            raise TraceError("give either --nodes or --cluster, not both")
        return load_cluster(Path(opts["cluster"]))
    nodes = opts["nodes"]
    per_node = int(opts["gpus_per_node"])
    if nodes is None:
        total = sum(guarantees.values()) if guarantees else 0
        if total <= 0:
            raise TraceError("give --nodes or --cluster (or quotas whose sum sizes the cluster)")
        nodes = math.ceil(total / per_node)
    return uniform_cluster(int(nodes), per_node)


def prepare(options: argparse.Namespace | Mapping[str, Any]) -> tuple[list[TraceJob], Any]:
    """Read every input the options name; return the trace and its SimulationConfig."""
    opts = _options(options)
    if opts["gang_topology"] != "none" and opts["rack_size"] is None:
        raise TraceError("--gang-topology required or preferred needs --rack-size")
    if opts["rack_size"] is not None and int(opts["rack_size"]) < 1:
        raise TraceError("--rack-size must be >= 1")
    guarantees: dict[str, int] | None = None
    if opts["quotas"] is not None:
        guarantees = load_quotas(Path(opts["quotas"]))
    elif opts["quotas_from_helios"] is not None:
        guarantees = load_helios_quotas(Path(opts["helios_file"]), str(opts["quotas_from_helios"]))
    trace_path = opts["trace"]
    if trace_path is None:
        if opts["format"] != "openb":
            raise TraceError("--trace is required for --format generic and sia")
        trace_path = DEFAULT_OPENB_TRACE
    trace = load_trace(Path(trace_path), opts["format"], guarantees, int(opts["seed"]))
    scale = float(opts["arrival_scale"])
    if scale <= 0:
        raise TraceError("--arrival-scale must be > 0")
    if scale != 1.0:
        trace = [replace(job, submit_time=job.submit_time * scale) for job in trace]
    usage_strength = float(opts["usage_strength"])
    half_life = float(opts["half_life"])
    if not 0 <= usage_strength < math.inf:
        raise TraceError("--usage-strength must be 0 or more")
    if not 0 < half_life < math.inf:
        raise TraceError("--half-life must be > 0")
    elastic_share = float(opts["elastic_share"])
    if not 0 <= elastic_share <= 1:
        raise TraceError("--elastic-share must be between 0 and 1")
    nodes = _cluster(opts, guarantees)
    if opts["rack_size"] is not None:
        nodes = rack_layout(nodes, int(opts["rack_size"]))
    capacity = sum(node.gpus for node in nodes)
    if opts["derive_quotas"]:
        guarantees = derive_quotas(trace, capacity)
    config = SimulationConfig(
        nodes=nodes,
        guarantees=guarantees or {},
        policy=opts["policy"],
        checkpoint_interval=float(opts["checkpoint_interval"]),
        save_seconds=float(opts["save_seconds"]),
        restart_seconds=float(opts["restart_seconds"]),
        cycle_seconds=float(opts["cycle_seconds"]),
        grace_seconds=float(opts["grace_seconds"]),
        seed=int(opts["seed"]),
        min_runtimes=parse_min_runtimes(opts["min_runtime"] or ()),
        usage_strength=usage_strength,
        half_life_seconds=half_life,
        gang_topology=str(opts["gang_topology"]),
        elastic_share=elastic_share,
    )
    return trace, config


def parse_min_runtimes(entries: Sequence[str]) -> dict[str, float]:
    """``REASON=SECONDS`` entries of ``--min-runtime`` as the engine's reason -> seconds."""
    minimums: dict[str, float] = {}
    for entry in entries:
        reason, _, seconds = entry.partition("=")
        if reason not in fairshare.PREEMPTION_REASONS:
            raise TraceError(
                f"--min-runtime {entry!r}: the reason must be one of "
                f"{', '.join(fairshare.PREEMPTION_REASONS)}"
            )
        try:
            value = float(seconds)
        except ValueError:
            raise TraceError(f"--min-runtime {entry!r}: seconds must be a number") from None
        if not 0 <= value < math.inf:
            raise TraceError(f"--min-runtime {entry!r}: seconds must be 0 or more")
        minimums[reason] = value
    return minimums


def progress_bar(stream: TextIO, width: int = 30) -> Callable[[Progress], None]:
    """A progress callback drawing one self-overwriting line on ``stream``."""
    started = time.monotonic()

    def draw(progress: Progress) -> None:
        share = progress.jobs_done / progress.jobs_total if progress.jobs_total else 1.0
        filled = int(share * width)
        bar = "#" * filled + "." * (width - filled)
        stream.write(
            f"\r[{bar}] {share:6.1%} {progress.jobs_done}/{progress.jobs_total} jobs, "
            f"{progress.simulated_seconds / 3600:.1f} h simulated, "
            f"{progress.running} running, {progress.pending} pending, "
            f"{progress.plan_calls} cycles, {time.monotonic() - started:.0f} s"
        )
        if progress.finished:
            stream.write("\n")
        stream.flush()

    return draw


def run_simulation(
    options: argparse.Namespace | Mapping[str, Any], stderr: TextIO | None = None
) -> Report:
    """Run one simulation from parsed options; write --json if given; return the report."""
    given = vars(options) if isinstance(options, argparse.Namespace) else options
    if given.get("compare_elastic") is not None:
        # Two replays and a table, not one report: a caller that stores or prints one
        # report (manage.py simulate) would silently run only the first.
        raise TraceError("--compare-elastic prints two runs: use python -m simulation")
    opts = _options(options)
    trace, config = prepare(opts)
    progress = progress_bar(stderr or sys.stderr) if opts["progress"] else None
    report = simulate(trace, config, progress)
    if opts["json"] is not None:
        report.write_json(Path(opts["json"]))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m simulation``: run, print a summary, exit 0 (2 on bad input)."""
    parser = argparse.ArgumentParser(
        prog="python -m simulation",
        description="Replay a job trace through the fair-share engine in simulated time.",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.compare_elastic is not None:
        return _compare_elastic(parser, args)
    try:
        report = run_simulation(args)
    except (TraceError, ValueError) as error:
        parser.exit(2, f"error: {error}\n")
    for line in report.summary_lines():
        print(line)
    return 0


def _compare_elastic(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--compare-elastic``: both runs, each one's summary, then the table side by side;
    ``--json`` gets both reports under ``whole_gang`` and ``elastic``."""
    try:
        if not 0 < args.compare_elastic <= 1:
            raise TraceError("--compare-elastic must be above 0 and at most 1")
        trace, config = prepare(args)
        progress = progress_bar(sys.stderr) if args.progress else None
        comparison = compare_elastic(trace, config, args.compare_elastic, progress)
    except (TraceError, ValueError) as error:
        parser.exit(2, f"error: {error}\n")
    for title, report in (("whole-gang eviction", comparison.whole_gang),
                          (f"elastic share {comparison.share:g}", comparison.elastic)):  # fmt: skip
        print(f"{title}:")
        for line in report.summary_lines():
            print(f"  {line}")
    for line in comparison_lines(comparison):
        print(line)
    if args.json is not None:
        both = {
            "whole_gang": comparison.whole_gang.to_dict(),
            "elastic": comparison.elastic.to_dict(),
        }
        Path(args.json).write_text(json.dumps(both, indent=2) + "\n")
    return 0
