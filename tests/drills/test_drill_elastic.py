"""`manage.py drill --elastic` on the local runtime: real rank processes training with
gloo, a real web server, Celery worker and beat on a database of the drill's own.

The borrower's elastic job (4 ranks, or 2) is shrunk to 2 by the owner's critical job
and grown back to 4 when it ends, each time stopped at an agreed step and relaunched
at once; the drill then checks its samples, step by step, against an uninterrupted
4-rank run of the same seed (drills/elastic_samples.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from preemption.runtimes.runner import RunnerAccount
from tests.drills.command import assert_shrunk_and_grown_back, run_drill_command

RANKS = 4

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_elastic_drill_shrinks_and_grows_without_losing_a_sample(
    runner_account: RunnerAccount, runner_tmp_path: Path
) -> None:
    # The ranks run as the runner user, who must pass through the drill's folders.
    tmp_path = runner_tmp_path
    var_dir = tmp_path / "var"
    var_dir.mkdir()
    env = {
        **os.environ,
        "QM_RUNTIME": "local",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'drill.sqlite3'}",
        "QM_VAR_DIR": str(var_dir),
        "PYTHONUNBUFFERED": "1",
        # One node of as many GPUs as the borrower's ranks: the critical job has to
        # take some of them.
        "QM_DRILL_GPUS_PER_NODE": str(RANKS),
    }
    # The embedded default: the broker on disk under QM_VAR_DIR, the drill's own nodes.
    env.pop("CELERY_BROKER_URL", None)
    env.pop("QM_LOCAL_NODES", None)
    result, drill, elapsed = run_drill_command(
        env,
        ["--elastic", "--runtime", "local", "--ranks", str(RANKS)],
        tmp_path / "elastic.json",
        timeout=840,
    )
    print(f"the elastic drill took {elapsed:.1f} s")
    assert drill.returncode == 0, result["missed"]

    assert_shrunk_and_grown_back(result, RANKS)
    shrink, grow = result["resizes"]
    for resize in (shrink, grow):
        assert resize["time_to_free_seconds"] is not None
    assert shrink["critical_running_seconds"] is not None
    samples = result["samples"]
    assert samples["exact"] and samples["samples_seen"] == samples["samples_expected"]
    assert samples["world_sizes"] == [RANKS // 2, RANKS]
    assert samples["loss_within_tolerance"]
    assert result["borrower_state"] == "succeeded"
