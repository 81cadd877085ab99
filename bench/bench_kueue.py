"""Benchmark: Kueue's own scalability test and Quartermaster on the same config, in one run.

Builds Kueue's runner and minimalkueue (tools/kueue/build.sh) and the test
control plane (tools/k8s/build.sh), runs Kueue's test on a generator config it
ships, then the same config through the whole Quartermaster control plane
(bench/kueue_qm.py, on a fresh database), one after the other so neither competes with the other for
the CPU, and prints one table with both sides' figures and their ratio
(bench/README.md says how to read it). Then the reclaim comparison, which Kueue's
test does not have: owners come back for the quota they lent, on our own config
(bench/kueue_configs/reclaim/generator.yaml), through both systems the same way,
with the work the victims lost since their last checkpoint (bench/kueue_reclaim.py
for Kueue's side).

Usage: .venv/bin/python bench/bench_kueue.py [--config baseline|tas|PATH] [--no-reclaim]
                                             [--scale 1.0] [--json out.json]
       KUEUE_CONFIG=large-scale make bench-kueue
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.kueue_qm import run_on_fresh_database  # noqa: E402
from bench.kueue_reclaim import RECLAIM_CONFIG, run_kueue_reclaim  # noqa: E402
from bench.kueue_side import (  # noqa: E402
    KueueRunError,
    build_k8s,
    build_kueue,
    resolve_config,
    run_kueue,
)
from bench.kueue_table import format_table, quartermaster_lines  # noqa: E402


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def scaled_config(config: Path, scale: float, folder: Path) -> Path:
    """A copy of the generator config with every workload set's count multiplied by
    `scale` (at least one each), written under `folder`, for both sides to run: the
    same queues, quotas, topology, intervals and running times over a shorter window
    of arrivals."""
    if not (math.isfinite(scale) and 0 < scale <= 1):
        raise ValueError(f"--scale must be more than 0 and at most 1, got {scale!r}")
    data = yaml.safe_load(config.read_text())
    for cohort in data.get("cohorts") or []:
        for queues in cohort.get("queuesSets") or []:
            for workloads in queues.get("workloadsSets") or []:
                workloads["count"] = max(1, round(int(workloads["count"]) * scale))
    out = folder / f"{config.parent.name}-x{scale:g}" / "generator.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        f"# {config} with every workload set's count times {scale:g} (bench/bench_kueue.py)\n"
        + yaml.safe_dump(data, sort_keys=False)
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config",
        default=os.environ.get("KUEUE_CONFIG", "baseline"),
        help="a generator config Kueue ships (baseline, ...) or a path to one",
    )
    parser.add_argument("--timeout", default="30m", help="Kueue's runner --timeout")
    parser.add_argument(
        "--reclaim",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the reclaim comparison (about 5 minutes)",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="run both sides on a copy of the config with every workload set's count "
        "times this (0 < scale <= 1); the table's title says so",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write both sides' figures")
    args = parser.parse_args(argv)

    kueue_dir = build_kueue()
    k8s_bin = build_k8s()
    try:
        config = resolve_config(kueue_dir, args.config)
        if args.scale != 1.0:
            config = scaled_config(config, args.scale, REPO_ROOT / "var" / "bench" / "kueue")
    except (KueueRunError, ValueError) as exc:
        print(f"bench_kueue: {exc}", file=sys.stderr)
        return 2

    print(f"config: {config}", flush=True)
    print(f"before Kueue: {_load()}", flush=True)
    started = time.monotonic()
    try:
        kueue = run_kueue(config, timeout=args.timeout, kueue_dir=kueue_dir, k8s_bin=k8s_bin)
    except KueueRunError as exc:
        print(f"bench_kueue: {exc}", file=sys.stderr)
        return 1
    print(f"Kueue done in {time.monotonic() - started:.0f} s; {_load()}", flush=True)
    started = time.monotonic()
    # A database of its own, created, migrated and dropped around the run.
    quartermaster = run_on_fresh_database(config)
    print(f"Quartermaster done in {time.monotonic() - started:.0f} s; {_load()}", flush=True)

    print()
    print(
        format_table(
            kueue,
            quartermaster,
            title=f"{config.parent.name} ({config}) on {platform.node()}, {os.cpu_count()} CPUs"
            + (f", SCALED: every workload set's count x {args.scale:g}" if args.scale != 1 else ""),
        )
    )
    costs = kueue.get("processes") or {}
    if costs:
        print()
        print("Kueue's processes (psutil samples):")
        for name, cost in costs.items():
            print(f"  {name:15} {cost['cpu_s']:8.1f} s CPU  {cost['peak_rss_mb']:7.0f} MB peak RSS")
    mk = kueue["minimalkueue"]
    print(
        f"minimalkueue (its rusage, as the runner records it): {mk['cpu_s']:.1f} s CPU, "
        f"{mk['peak_rss_mb']:.0f} MB peak RSS; Kueue's recorder dropped "
        f"{kueue['dropped_workload_events']} workload events"
    )
    for line in quartermaster_lines(quartermaster):
        print(line)
    results = {"kueue": kueue, "quartermaster": quartermaster}
    if args.reclaim:
        print(f"\nreclaim config: {RECLAIM_CONFIG}", flush=True)
        try:
            kueue_reclaim = run_kueue_reclaim(RECLAIM_CONFIG, timeout=args.timeout)
        except KueueRunError as exc:
            print(f"bench_kueue: {exc}", file=sys.stderr)
            return 1
        quartermaster_reclaim = run_on_fresh_database(RECLAIM_CONFIG)
        print()
        print(
            format_table(
                kueue_reclaim,
                quartermaster_reclaim,
                title="reclaim: owners come back for the quota they lent",
                time_goals=False,
            )
        )
        results.update(kueue_reclaim=kueue_reclaim, quartermaster_reclaim=quartermaster_reclaim)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
