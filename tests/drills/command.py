"""`manage.py drill` run as an operator runs it, for the tests that drive a whole drill:
a subprocess on a database of the drill's own, migrated first, whose JSON result is read
back. The output is printed, so that a failing drill's log is in the test's report."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_drill_command(
    env: dict[str, str], arguments: list[str], out: Path, *, timeout: float
) -> tuple[dict[str, Any], subprocess.CompletedProcess[str], float]:
    """Migrate the drill's database, run the drill with `arguments`, and return its
    result (written to `out`), the finished process and the seconds it took."""
    manage = [sys.executable, str(REPO_ROOT / "manage.py")]
    subprocess.run(
        [*manage, "migrate", "--noinput", "-v0"], env=env, cwd=REPO_ROOT, check=True, timeout=300
    )
    started = time.monotonic()
    drill = subprocess.run(
        [*manage, "drill", *arguments, "--json", str(out)],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    elapsed = time.monotonic() - started
    print(drill.stdout[-8000:])
    print(drill.stderr[-4000:], file=sys.stderr)
    assert out.exists(), f"the drill wrote no result ({drill.returncode}): {drill.stderr[-4000:]}"
    return json.loads(out.read_text()), drill, elapsed


def assert_shrunk_and_grown_back(result: dict[str, Any], ranks: int) -> None:
    """What every elastic drill shows: a shrink to half and a grow back, each stopped at
    its agreed step with every exit 0 and resumed at the next step, nothing run twice,
    and every sample of every epoch seen as in the uninterrupted run."""
    shrink, grow = result["resizes"]
    assert (shrink["from_ranks"], shrink["to_ranks"]) == (ranks, ranks // 2)
    assert (grow["from_ranks"], grow["to_ranks"]) == (ranks // 2, ranks)
    for resize in (shrink, grow):
        assert resize["exit_codes"] == [0] * resize["from_ranks"]
        assert resize["steps_run_again"] == 0
        assert resize["resumed_step"] == resize["agreed_step"] + 1
    assert [a["ranks"] for a in result["attempts"]] == [ranks, ranks // 2, ranks]
    assert result["samples"]["exact"] and result["samples"]["loss_within_tolerance"]
