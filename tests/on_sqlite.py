"""Run some tests again on the embedded default's SQLite, in a pytest of their own.

The suite runs on PostgreSQL; a test whose behaviour hangs on the database's
locking (SQLite's one write lock) is also run on a SQLite file database, as
`make run` uses one (tests/sqlite_settings.py says why a file)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def passes_on_sqlite(tmp_path: Path, test_file: str, *names: str) -> None:
    """Run the tests `names` of `test_file` on SQLite; fail unless every one passed."""
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp_path / 'portal.sqlite3'}",
        "QM_SQLITE_TEST_NAME": str(tmp_path / "test.sqlite3"),
        "QM_VAR_DIR": str(tmp_path / "var"),
        "PYTHONPATH": str(ROOT),
    }
    env.pop("CELERY_BROKER_URL", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "--ds",
            "tests.sqlite_settings",
            *(f"{test_file}::{name}" for name in names),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"{len(names)} passed" in done.stdout
