"""`make test`'s pieces around its pytest runs: the settings each xdist worker starts
from (tests/worker_settings.py) and the closing lines over every run's JUnit report
(tools/test_totals.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TOTALS = REPO_ROOT / "tools" / "test_totals.py"
PROBE = (
    "import json, os; from django.conf import settings; "
    "print(json.dumps([str(settings.VAR_DIR), str(settings.QM_RUNS_DIR), "
    "os.environ['QM_VAR_DIR'], os.environ['DJANGO_SETTINGS_MODULE']]))"
)


def settings_seen(var_dir: Path, worker: str | None) -> list[str]:
    """What a process that loads tests.worker_settings sees, as an xdist worker or not."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_XDIST")}
    env.update(QM_VAR_DIR=str(var_dir), DJANGO_SETTINGS_MODULE="tests.worker_settings")
    if worker is not None:
        env["PYTEST_XDIST_WORKER"] = worker
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return list(json.loads(result.stdout.strip().splitlines()[-1]))


def test_each_xdist_worker_takes_a_var_folder_of_its_own(tmp_path: Path) -> None:
    worker = settings_seen(tmp_path, "gw3")
    assert worker == [
        str(tmp_path / "gw3"),
        str(tmp_path / "gw3" / "runs"),
        # The processes a test starts inherit the worker's folder, on the portal's settings.
        str(tmp_path / "gw3"),
        "portal.settings",
    ]
    # Such a process, still a part of worker gw3, stays in the same folder.
    assert settings_seen(tmp_path / "gw3", "gw3")[0] == str(tmp_path / "gw3")
    # Without xdist, one process: QM_VAR_DIR as given.
    assert settings_seen(tmp_path, None)[:3] == [
        str(tmp_path),
        str(tmp_path / "runs"),
        str(tmp_path),
    ]


def junit(path: Path, cases: dict[str, float], failures: int = 0) -> Path:
    rows = "".join(
        f'<testcase classname="tests.m" name="{name}" time="{seconds}" />'
        for name, seconds in cases.items()
    )
    path.write_text(
        f'<testsuites><testsuite name="pytest" errors="0" failures="{failures}" skipped="0" '
        f'tests="{len(cases)}">{rows}</testsuite></testsuites>'
    )
    return path


@pytest.mark.parametrize(("failures", "code"), [(0, 0), (1, 1)])
def test_the_closing_lines_name_the_ten_slowest_tests_of_all_runs(
    tmp_path: Path, failures: int, code: int
) -> None:
    postgresql = junit(tmp_path / "postgresql.xml", {f"test_{i}": i for i in range(12)}, failures)
    sqlite = junit(tmp_path / "sqlite.xml", {"test_slow": 30.5, "test_quick": 0.01})
    result = subprocess.run(
        [sys.executable, str(TOTALS), str(postgresql), str(sqlite)], capture_output=True, text=True
    )
    assert result.returncode == code, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "2 pytest runs; the 10 slowest tests:"
    slowest = [line.split()[-2:] for line in lines[1:11]]
    assert slowest == [["tests.m::test_slow", "(sqlite)"]] + [
        [f"tests.m::test_{i}", "(postgresql)"] for i in range(11, 2, -1)
    ]
    assert lines[1].split()[0] == "30.50"
    assert lines[-1] == f"total: {14 - failures} passed, {failures} failed"


INNER_TEST = """
import signal, subprocess, sys

def test_sigint_is_handled_as_in_the_foreground():
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    code = "import signal; print(signal.getsignal(signal.SIGINT) != signal.SIG_IGN)"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.stdout.strip() == "True"
"""


def test_a_run_started_in_the_background_handles_sigint_as_in_the_foreground(
    tmp_path: Path,
) -> None:
    # A shell starts a background command with SIGINT ignored; so does this preexec_fn.
    inner = REPO_ROOT / "tests" / "tools" / f"test_inner_{tmp_path.name}.py"
    inner.write_text(INNER_TEST)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(inner)],
            cwd=REPO_ROOT,
            # A run of its own, not a part of this one's xdist worker.
            env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},
            capture_output=True,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
    finally:
        inner.unlink()
    assert result.returncode == 0, result.stdout[-3000:]
