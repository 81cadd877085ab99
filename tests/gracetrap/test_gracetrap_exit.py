"""Every rank exits 0 at the end of a run, however the run closes its process group.

The abort this guards against: "terminate called without an active exception" on a
rank of a gloo gang that ended with a bare ``dist.destroy_process_group()``, on a
loaded machine: a gloo worker thread still handling the last collective's tensors
while the interpreter shuts down; see ``gracetrap.gloo._let_gloo_workers_settle``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
RUNS = 10
WORLD_SIZE = 3


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["shutdown", "destroy"])
def test_both_endings_exit_zero_every_time(tmp_path: Path, ending: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(HERE / "gracetrap_exit_runs.py"),
            ending,
            str(RUNS),
            str(WORLD_SIZE),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        cwd=HERE,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["codes"] == [[0] * WORLD_SIZE] * RUNS, report
    assert report["aborted"] == [], report


_EXIT_SCRIPT = """
import atexit, os, signal, sys
import torch
from gracetrap import Trap

class Cyclic:
    def __init__(self):
        self.me = self  # a reference cycle: only the garbage collector frees it
    def __del__(self, write=os.write):
        write(1, b"FINALIZED\\n")

kept = Cyclic()  # garbage once the interpreter clears the modules at exit
atexit.register(os.write, 1, b"ATEXIT\\n")
trap = Trap(sys.argv[1], {"model": torch.nn.Linear(2, 2)}, signals=(signal.SIGUSR1,),
            events_url="", exit_code=5)
os.kill(os.getpid(), signal.SIGUSR1)
assert trap.should_stop(0)
try:
    if sys.argv[2] == "trap":
        trap.save_and_exit(0)
    sys.exit(5)
finally:
    os.write(1, b"FINALLY\\n")
"""


@pytest.mark.parametrize("path", ["trap", "plain"])
def test_a_preempted_rank_skips_only_the_last_collections_on_its_way_out(
    tmp_path: Path, path: str
) -> None:
    """After ``save_and_exit`` the interpreter's last garbage collections are skipped
    (they made most of a 16-rank gang's time to free), while the caller's ``finally``
    blocks and every exit handler still run. The plain exit shows the same script
    does finalize its reference cycle when the trap is not the one leaving."""
    result = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path / "checkpoints"), path],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 5, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if not line.startswith("QM_EVENT")]
    if path == "trap":
        assert lines == ["FINALLY", "ATEXIT"], result.stdout
        assert (tmp_path / "checkpoints" / "latest").exists()
    else:
        assert lines == ["FINALLY", "ATEXIT", "FINALIZED"], result.stdout


_STORM_SCRIPT = """
import signal, subprocess, sys, time
import torch
from gracetrap import Trap

trap = Trap(sys.argv[1], {"model": torch.nn.Linear(2, 2)}, signals=(signal.SIGTERM,),
            events_url="")
# SIGTERM after SIGTERM until this process is gone, as a runtime that evicts each rank
# on its own may send one while the rank exits: the last ones land while the
# interpreter finalizes.
storm = subprocess.Popen(
    ["/bin/sh", "-c", "while kill -TERM $0 2>/dev/null; do :; done", str(trap._pid)],
    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
)
while trap._signal_at is None:
    time.sleep(0.001)
assert trap.should_stop(0)
trap.save_and_exit(0)
"""


def test_a_rank_that_saved_exits_zero_under_a_storm_of_its_own_signal(tmp_path: Path) -> None:
    """The trap's signals stay harmless until the process is gone. The interpreter puts
    their default actions back as it finalizes, and a SIGTERM that came then ended a
    rank that had saved and was exiting 0 with 143."""
    codes = []
    for run in range(5):
        result = subprocess.run(
            [sys.executable, "-c", _STORM_SCRIPT, str(tmp_path / f"checkpoints-{run}")],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        codes.append(result.returncode)
        assert (tmp_path / f"checkpoints-{run}" / "latest").exists(), result.stderr[-3000:]
    assert codes == [0] * 5, codes
