"""What the local runtime's sandbox per rank costs (preemption/runtimes/sandbox.py).

The same gangs run on two LocalRuntimes over fresh roots, one with QM_LOCAL_SANDBOX=off
and one with it on, as the runner user when there is one (`bin/runner-user`), taking
turns so that a busy machine slows both alike. Printed, per rank, as medians: the time
from launch() to the rank's first line in its log (its shell, in its namespaces and
cgroup, has started the command), and the time from kill() until every rank of the gang
is observed to have exited; each with the sandbox's ratio to no sandbox. Goals: the
sandbox within 1.2x of none and under 50 ms per rank for each.

Usage: .venv/bin/python bench/bench_sandbox.py [--gangs 20] [--ranks 4]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from preemption.runtimes import (  # noqa: E402
    GangId,
    GangSpec,
    LocalRuntime,
    RankPlacement,
    parse_inventory,
)
from preemption.runtimes import sandbox as sandboxes  # noqa: E402
from preemption.runtimes.runner import find_runner  # noqa: E402

GOAL_RATIO = 1.2
GOAL_MS_PER_RANK = 50.0
LIMITS = sandboxes.SandboxLimits(pids_max=4096, memory_max=64 << 30, file_size_max=256 << 30)


def quartiles(seconds: list[float]) -> tuple[float, float, float]:
    """25th percentile, median and 75th percentile, in milliseconds."""
    low, middle, high = statistics.quantiles([value * 1000 for value in seconds], n=4)
    return low, middle, high


def wait(condition: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.001)


def one_gang(runtime: LocalRuntime, job_id: int, ranks: int, base: Path) -> tuple[float, float]:
    """Seconds per rank to launch the gang and to stop it."""
    spec = GangSpec(
        job_id=job_id,
        attempt=1,
        command="echo up; exec sleep 60",
        ranks=tuple(RankPlacement(rank, "node-a", rank) for rank in range(ranks)),
        gpus_per_rank=1,
        grace_seconds=5.0,
        priority_class="ai-batch-preemptible",
        env={"QM_CHECKPOINT_DIR": str(base / "checkpoints" / f"job-{job_id}")},
    )
    gang = GangId(job_id, 1)
    start = time.perf_counter()
    runtime.launch(spec)
    wait(
        lambda: all(b"up" in runtime.read_log(gang, rank) for rank in range(ranks)),
        f"gang {job_id} to start",
    )
    launched = time.perf_counter() - start
    start = time.perf_counter()
    runtime.kill(gang)
    wait(
        lambda: all(o.phase == "exited" for o in runtime.observe(gang)),
        f"gang {job_id} to stop",
    )
    stopped = time.perf_counter() - start
    runtime.forget(gang)
    return launched / ranks, stopped / ranks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gangs", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=4)
    arguments = parser.parse_args()
    found = sandboxes.support()
    if not found.available:
        print(f"bench_sandbox: no sandbox on this machine: {found.reason}")
        return 0
    runner = find_runner("qm-runner").account
    base = Path(tempfile.mkdtemp(prefix="qm-bench-sandbox-"))
    base.chmod(0o711)
    inventory = parse_inventory(f"node-a:h100-80gb:{arguments.ranks}")
    runtimes = {
        "off": LocalRuntime(base / "off", inventory, runner=runner),
        "on": LocalRuntime(
            base / "on",
            inventory,
            runner=runner,
            sandbox=sandboxes.SandboxConfig(mode="on", limits=LIMITS),
        ),
    }
    figures: dict[str, dict[str, list[float]]] = {
        mode: {"launch": [], "stop": []} for mode in runtimes
    }
    try:
        # One gang of each first, unmeasured: the launcher's start and the imports.
        for job_id in range(arguments.gangs + 1):
            for mode, runtime in runtimes.items():
                launched, stopped = one_gang(runtime, job_id + 1, arguments.ranks, base)
                if job_id:
                    figures[mode]["launch"].append(launched)
                    figures[mode]["stop"].append(stopped)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"sandbox (cgroup v{found.cgroup_version}): {arguments.gangs} gangs of "
        f"{arguments.ranks} ranks each way, taking turns; per rank, median "
        f"[25th-75th percentile]"
    )
    met = True
    for what in ("launch", "stop"):
        off = quartiles(figures["off"][what])
        on = quartiles(figures["on"][what])
        ratio = on[1] / off[1] if off[1] else float("inf")
        within = ratio <= GOAL_RATIO and on[1] < GOAL_MS_PER_RANK
        met = met and within
        print(
            f"  time to {what} a rank: {off[1]:.1f} ms [{off[0]:.1f}-{off[2]:.1f}] without, "
            f"{on[1]:.1f} ms [{on[0]:.1f}-{on[2]:.1f}] with the sandbox"
        )
        print(
            f"    ratio {ratio:.2f}x (goal <= {GOAL_RATIO}x), {on[1]:.1f} ms "
            f"(goal < {GOAL_MS_PER_RANK:.0f} ms): {'within goal' if within else 'OVER GOAL'}"
        )
    print(f"  sandbox cost: {'within both goals' if met else 'over a goal'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
