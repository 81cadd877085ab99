"""`manage.py simulate` and `manage.py drill` on a database that was never
migrated answer at once, in one line, what to run; they replay nothing and
write nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "tests" / "simulation" / "fixtures"


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DATABASE_URL", "CELERY_BROKER_URL")
    }
    # A folder of its own: the embedded SQLite database there has never been migrated.
    env.update(QM_VAR_DIR=str(tmp_path / "var"), PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _one_line(result: subprocess.CompletedProcess[str], command: str) -> str:
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "OperationalError" not in result.stderr
    assert "was never migrated: run `python manage.py migrate` first" in lines[0]
    assert f"then `python manage.py {command}` again" in lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(
            (
                "simulate",
                *("--format", "openb", "--trace", str(TRACE / "openb_pod_list_slice.csv")),
                *("--nodes", "8", "--no-progress"),
            ),
            id="simulate",
        ),
        pytest.param(("drill", "--ranks", "2"), id="drill"),
    ],
)
def test_command_on_an_unmigrated_database_says_what_to_run(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    report = tmp_path / "report.json"
    extra = ("--json", str(report))
    line = _one_line(_run(tmp_path, *args, *extra), args[0])
    assert not report.exists()
    if args[0] == "simulate":
        assert "--no-store" in line
