"""Kueue's side of the side-by-side benchmark: Kueue's own scalability test, run here.

Runs the runner of ``sigs.k8s.io/kueue`` (test/performance/scheduler) with its
``minimalkueue`` against the kube-apiserver and etcd that ``make k8s`` builds, the
way Kueue's ``make run-performance-scheduler`` does, and returns the figures its
recorder wrote: nothing here is estimated or simulated. The binaries come from
``tools/kueue/build.sh``.

What comes from where (all under the run's output folder):

* ``summary.yaml`` (the runner's recorder): per workload class the mean time to
  admission and the evictions; per cluster-queue class the CPU used and the
  nominal quota, from which usage is computed the way Kueue's checker does
  (``cpuUsed / (nominalQuota * (lastEventTime - firstEventTime))``).
* ``wlStates.csv`` (the same recorder, one row per workload): p50 and p99 of the
  time to admission, which the summary does not carry.
* ``minimalkueue.stats.yaml`` (the runner, from minimalkueue's rusage): its wall
  time, which is what Kueue's checker bounds (``cmd.maxWallMs``), its CPU time and
  its peak RSS.
* psutil samples of the runner's process tree while it runs: CPU seconds and
  peak RSS of minimalkueue, kube-apiserver and etcd, so the cost of the API server
  Kueue works through is visible too.

Usage: .venv/bin/python bench/kueue_side.py [--config baseline|PATH] [--timeout 20m]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO_ROOT / "tools" / "kueue" / "build.sh"
K8S_BUILD_SCRIPT = REPO_ROOT / "tools" / "k8s" / "build.sh"
CONFIGS_IN_MODULE = Path("test/performance/scheduler/configs")
CRDS_IN_MODULE = Path("config/components/crd/bases")
# Processes of the run whose cost is reported, by executable name.
WATCHED_PROCESSES = ("minimalkueue", "kube-apiserver", "etcd")
SAMPLE_INTERVAL_S = 0.5


class KueueRunError(RuntimeError):
    """Kueue's runner could not be started or did not leave its recorded figures."""


@dataclass
class ProcessCost:
    cpu_s: float = 0.0
    peak_rss_mb: float = 0.0


@dataclass
class _Sampler:
    """Samples the CPU time and RSS of the runner's descendants until stopped.

    A process's CPU time only grows, so the last sample before it exits is its
    total (to within one interval); RSS is kept at its highest sample.
    """

    root_pid: int
    costs: dict[str, dict[int, ProcessCost]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        try:
            root = psutil.Process(self.root_pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop.is_set():
            try:
                children = root.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for proc in children:
                try:
                    name = proc.name()
                    if name not in WATCHED_PROCESSES:
                        continue
                    with proc.oneshot():
                        cpu = proc.cpu_times()
                        rss = proc.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                cost = self.costs.setdefault(name, {}).setdefault(proc.pid, ProcessCost())
                cost.cpu_s = cpu.user + cpu.system
                cost.peak_rss_mb = max(cost.peak_rss_mb, rss / 2**20)
            self._stop.wait(SAMPLE_INTERVAL_S)

    def stop(self) -> None:
        self._stop.set()

    def totals(self) -> dict[str, dict[str, float]]:
        return {
            name: {
                "cpu_s": round(sum(c.cpu_s for c in by_pid.values()), 2),
                "peak_rss_mb": round(max(c.peak_rss_mb for c in by_pid.values()), 1),
            }
            for name, by_pid in sorted(self.costs.items())
        }


def build_kueue() -> Path:
    """Build (or find in the cache) Kueue's runner and minimalkueue; return the version folder."""
    out = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], check=True, stdout=subprocess.PIPE, text=True
    ).stdout
    return Path(out.strip().splitlines()[-1])


def build_k8s() -> Path:
    """The folder holding kube-apiserver and etcd, as ``KUBEBUILDER_ASSETS`` wants it."""
    out = subprocess.run(
        ["bash", str(K8S_BUILD_SCRIPT)], check=True, stdout=subprocess.PIPE, text=True
    ).stdout
    return Path(out.strip().splitlines()[-1])


def resolve_config(kueue_dir: Path, config: str) -> Path:
    """A generator config by the name Kueue gives it in its module, or a path to one."""
    candidate = Path(config)
    if candidate.suffix in (".yaml", ".yml"):
        if not candidate.is_file():
            raise KueueRunError(f"generator config {candidate} does not exist")
        return candidate.resolve()
    configs = kueue_dir / "src" / CONFIGS_IN_MODULE
    path = configs / config / "generator.yaml"
    if not path.is_file():
        shipped = sorted(p.parent.name for p in configs.glob("*/generator.yaml"))
        raise KueueRunError(
            f"Kueue {kueue_dir.name} ships no '{config}' generator config "
            f"(it has: {', '.join(shipped)}); pass a path to a generator.yaml instead"
        )
    return path


def is_topology_aware(generator_config: Path) -> bool:
    """Whether the config has a topology section (Kueue's tas config)."""
    data = yaml.safe_load(Path(generator_config).read_text())
    return isinstance(data, dict) and bool(data.get("topology"))


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile (the value at rank ceil(fraction * n))."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


def parse_results(output_dir: Path) -> dict[str, Any]:
    """Read the figures the runner recorded in ``output_dir``, exactly as it wrote them."""
    summary_path = output_dir / "summary.yaml"
    stats_path = output_dir / "minimalkueue.stats.yaml"
    workloads_path = output_dir / "wlStates.csv"
    for path in (summary_path, stats_path, workloads_path):
        if not path.is_file():
            raise KueueRunError(f"the runner left no {path.name} in {output_dir}")
    summary = yaml.safe_load(summary_path.read_text())
    stats = yaml.safe_load(stats_path.read_text())

    admitted_ms: dict[str, list[float]] = {}
    with workloads_path.open(newline="") as f:
        for row in csv.DictReader(f):
            admitted_ms.setdefault(row["class name"], []).append(float(row["ms to admitted"]))

    admission: dict[str, dict[str, float]] = {}
    evictions = 0
    workloads = 0
    for name, cls in sorted((summary.get("workloadClasses") or {}).items()):
        samples = admitted_ms.get(name, [])
        admission[name] = {
            "mean_s": cls["averageTimeToAdmissionMs"] / 1000,
            "p50_s": percentile(samples, 0.50) / 1000 if samples else math.nan,
            "p99_s": percentile(samples, 0.99) / 1000 if samples else math.nan,
            "count": cls["count"],
            "evictions": cls.get("totalEvictions", 0),
            "mean_to_finish_s": cls["averageTimeToFinishMs"] / 1000,
        }
        evictions += cls.get("totalEvictions", 0)
        workloads += cls["count"]

    # Usage as Kueue's checker computes it per cluster-queue class; over all classes,
    # the same quotient with every class's quota over the whole monitored window (a
    # class that borrows shows more than 100 % on its own).
    usage_by_class: dict[str, float] = {}
    used_total = 0.0
    quota_total = 0.0
    firsts: list[float] = []
    lasts: list[float] = []
    for name, group in sorted((summary.get("clusterQueueClasses") or {}).items()):
        first = _timestamp(group["firstEventTime"])
        last = _timestamp(group["lastEventTime"])
        capacity = group["nominalQuota"] * (last - first) * 1000
        usage_by_class[name] = group["cpuUsed"] / capacity if capacity else math.nan
        used_total += group["cpuUsed"]
        quota_total += group["nominalQuota"]
        firsts.append(first)
        lasts.append(last)
    capacity_total = quota_total * (max(lasts) - min(firsts)) * 1000 if firsts else 0.0
    if workloads and used_total == 0:
        raise KueueRunError(
            f"Kueue admitted none of the {workloads} workloads (no CPU used by any cluster "
            f"queue in {summary_path}): its figures would compare nothing"
        )

    return {
        "total_s": stats["wallMs"] / 1000,
        "admission": admission,
        "usage": used_total / capacity_total if capacity_total else math.nan,
        "usage_by_class": usage_by_class,
        # Nothing but Kueue's own preemption evicts a workload in this test: the
        # runner never fails or deletes one.
        "preemptions": evictions,
        "workloads": workloads,
        "dropped_workload_events": summary.get("droppedWorkloadEvents", 0),
        "minimalkueue": {
            "wall_s": stats["wallMs"] / 1000,
            "cpu_s": (stats["userMs"] + stats["sysMs"]) / 1000,
            # Linux reports ru_maxrss in KiB.
            "peak_rss_mb": stats["maxrss"] / 1024 if stats["maxrss"] >= 0 else math.nan,
        },
    }


def _timestamp(value: Any) -> float:
    """Seconds since the epoch of a recorder timestamp (YAML may already have parsed it)."""
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    text = str(value)
    # Go writes RFC 3339 with up to nanoseconds; Python's parser takes microseconds.
    if "." in text:
        head, _, tail = text.partition(".")
        digits = "".join(ch for ch in tail if ch.isdigit())
        zone = tail[len(digits) :]
        text = f"{head}.{digits[:6].ljust(6, '0')}{zone}"
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def run_kueue(
    config: str | Path = "baseline",
    *,
    output_dir: Path | None = None,
    timeout: str = "20m",
    kueue_dir: Path | None = None,
    k8s_bin: Path | None = None,
) -> dict[str, Any]:
    """Run Kueue's scalability runner with minimalkueue on ``config`` and return its figures.

    ``config`` is the name of a config Kueue ships (``baseline``) or a path to a
    generator.yaml. ``timeout`` is the runner's own ``--timeout`` (its longest
    recording). The runner is started with the arguments of Kueue's
    ``make run-performance-scheduler`` (minimalkueue's logs to files, its metrics
    scraped every 5 s).
    """
    kueue_dir = kueue_dir or build_kueue()
    k8s_bin = k8s_bin or build_k8s()
    generator_config = resolve_config(kueue_dir, str(config))
    if output_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        output_dir = (
            REPO_ROOT / "var" / "bench" / "kueue" / f"{generator_config.parent.name}-{stamp}"
        )
    # The runner works in the module's folder: it must get an absolute output folder.
    output_dir = output_dir.resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    src = kueue_dir / "src"
    command = [
        str(kueue_dir / "bin" / "performance-scheduler-runner"),
        f"--o={output_dir}",
        f"--crds={src / CRDS_IN_MODULE}",
        f"--generatorConfig={generator_config}",
        f"--minimalKueue={kueue_dir / 'bin' / 'minimalkueue'}",
        f"--timeout={timeout}",
        "--withLogs=true",
        "--logToFile=true",
        "--metricsScrapeInterval=5s",
    ]
    if is_topology_aware(generator_config):
        # As Kueue's `make run-tas-performance-scheduler` starts it: without TAS's
        # controllers minimalkueue never admits a workload of a topology flavor, and the
        # recorder stops once the generator is done, with nothing recorded.
        command.append("--enableTAS=true")
    env = {k: v for k, v in os.environ.items() if k != "PROJECT_DIR"}
    env["KUBEBUILDER_ASSETS"] = str(k8s_bin)
    load_before = os.getloadavg()
    started = time.monotonic()
    with (output_dir / "runner.log").open("wb") as log:
        # Started from the module's own folder: Kueue's test utilities look upward
        # from the working directory for its Makefile.
        proc = subprocess.Popen(command, cwd=src, env=env, stdout=log, stderr=subprocess.STDOUT)
        sampler = _Sampler(proc.pid)
        thread = threading.Thread(target=sampler.run, daemon=True)
        thread.start()
        try:
            returncode = proc.wait()
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
            sampler.stop()
            thread.join()
    runner_wall_s = time.monotonic() - started
    if returncode != 0:
        tail = (output_dir / "runner.log").read_text(errors="replace").splitlines()[-15:]
        raise KueueRunError(
            f"Kueue's runner exited with {returncode}; last lines of {output_dir / 'runner.log'}:\n"
            + "\n".join(tail)
        )
    result = parse_results(output_dir)
    result.update(
        {
            "system": f"Kueue {kueue_dir.name} (runner + minimalkueue)",
            "config": str(generator_config),
            "output_dir": str(output_dir),
            "runner_wall_s": round(runner_wall_s, 1),
            "processes": sampler.totals(),
            "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()],
        }
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="baseline", help="a config Kueue ships, or a path")
    parser.add_argument("--timeout", default="20m", help="the runner's --timeout")
    parser.add_argument("--output-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        result = run_kueue(args.config, output_dir=args.output_dir, timeout=args.timeout)
    except KueueRunError as exc:
        print(f"kueue_side: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
