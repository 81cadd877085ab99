"""Every rank exits 0 at the end of a run, however the run closes its process group.

The abort this guards against: "terminate called without an active exception" on a
rank of a gloo gang that ended with a bare ``dist.destroy_process_group()``, on a
loaded machine: a gloo worker thread still handling the last collective's tensors
while the interpreter shuts down; see ``gracetrap.trap._let_gloo_workers_settle``.
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
