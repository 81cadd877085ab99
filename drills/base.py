"""The drill's settings and the state of one drill run: the constants, the refusal
(DrillError), the arguments and environment a run is checked against, its log line
and its wait for a condition. Starts no process and writes no row.
"""

from __future__ import annotations

import math
import os
import random
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from django.conf import settings
from django.db import close_old_connections

from preemption.runtime import local_runner

FLAVOR = "drill-gpu"
STEP_SLEEP = 0.2
STEPS = 120
SAVE_EVERY = 200
NOTICE_MODES = {"on": (True,), "off": (False,), "both": (False, True)}
CRITICAL_SECONDS = 30.0
DISTURBANCES = ("kill-rank", "second-sigterm", "short-grace", "kill-worker")
# One kill-rank round needs one retry; the second leaves room for a disturbance that
# lands during the restart.
BORROWER_RETRIES = 2
# Two hooks for a test cluster of real kubelets on this machine (tests/k8s/realnodes):
# nodes of fewer GPUs, so that eight ranks span two nodes, and the web server on an
# address the pods reach (the host's address on their bridge) rather than loopback.
GPUS_PER_NODE_ENV = "QM_DRILL_GPUS_PER_NODE"
BIND_ADDRESS_ENV = "QM_DRILL_BIND_ADDRESS"


class DrillError(RuntimeError):
    """The drill could not complete a phase (the message says which)."""


def _ts(moment: datetime | None) -> float | None:
    return moment.timestamp() if moment else None


class DrillBase:
    """The state of one drill run, read and checked from its arguments and the
    environment; the set-up (drills.setup), the measurements (drills.measure) and
    the run (drills.harness.Drill) build on it."""

    def __init__(
        self,
        *,
        ranks: int,
        grace: float | None,
        runtime: str,
        say: Callable[[str], None],
        steps: int = STEPS,
        critical_seconds: float = CRITICAL_SECONDS,
        seed: int | None = None,
        notice: str = "on",
        critical_at_step: int | None = None,
    ) -> None:
        if ranks < 1 or ranks > 256:
            raise DrillError("--ranks must be between 1 and 256")
        if critical_at_step is not None and not 1 <= critical_at_step < steps:
            raise DrillError(
                f"--critical-at-step must be between 1 and {steps - 1} (below --steps), "
                f"got {critical_at_step}"
            )
        self.ranks = ranks
        self.grace = grace
        self.runtime = runtime
        self.say = say
        self.steps = steps
        # The step the borrower has reached when the critical job is submitted: three
        # quarters through by default; the steps after it are the time the eviction
        # has to land before the borrower ends on its own.
        self.steady_step = steps * 3 // 4 if critical_at_step is None else critical_at_step
        self.critical_seconds = critical_seconds
        self.random = random.Random(seed)
        if notice not in NOTICE_MODES:
            raise DrillError("--notice must be on, off or both")
        self.notice_modes = NOTICE_MODES[notice]
        gpus_per_node = os.environ.get(GPUS_PER_NODE_ENV) or "8"
        if not gpus_per_node.isdigit() or not 1 <= int(gpus_per_node) <= 64:
            raise DrillError(f"{GPUS_PER_NODE_ENV} must be between 1 and 64, got {gpus_per_node!r}")
        self.gpus_per_node = int(gpus_per_node)
        self.bind_address = os.environ.get(BIND_ADDRESS_ENV) or "127.0.0.1"
        self.nodes = max(1, math.ceil(ranks / self.gpus_per_node))
        self.capacity = self.nodes * self.gpus_per_node
        self.work = Path(tempfile.mkdtemp(prefix="qm-drill-", dir=settings.VAR_DIR))
        self.dumps = self.work / "dumps"
        self.dumps.mkdir(mode=0o700)
        if (runtime == "local" and local_runner() is not None) or runtime == "kubernetes":
            # The borrowers' ranks run as users of their jobs' own and write their
            # final state here: they may pass through the drill's folder and add files
            # to this one, but neither list it nor remove another job's files.
            self.work.chmod(0o711)
            self.dumps.chmod(0o1733)
        self.train = settings.BASE_DIR / "examples" / "train_ddp.py"
        self.sleeper = settings.BASE_DIR / "examples" / "sleeper.py"
        self.started = time.monotonic()
        # Set when the web server starts: the trap's events go there.
        self.public_url = ""

    def log(self, message: str) -> None:
        self.say(f"[{time.monotonic() - self.started:7.1f}s] {message}")

    # -- waiting -----------------------------------------------------------------

    def wait(
        self, condition: Callable[[], bool], what: str, *, timeout: float, quiet: bool = False
    ) -> None:
        if not quiet:
            self.log(f"waiting for {what}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            close_old_connections()
            if condition():
                return
            time.sleep(0.1)
        raise DrillError(
            f"timed out after {timeout:.0f} s waiting for {what} (logs in {self.work})"
        )
