"""The embedded default's SQLite backend serves write transactions in turn: one
waits in the kernel for the writers' lock, not in SQLite's busy handler."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
import django
django.setup()
from django.db import connection, transaction
with connection.cursor() as cursor:
    cursor.execute("CREATE TABLE IF NOT EXISTS t (x)")
print("begin", flush=True)
if sys.argv[1] == "write":
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("INSERT INTO t VALUES (1)")
else:
    with connection.cursor() as cursor:
        cursor.execute("SELECT COUNT(*) FROM t")
print("done", flush=True)
"""


def _client(tmp_path: Path, mode: str) -> subprocess.Popen[str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DATABASE_URL", "CELERY_BROKER_URL")
    }
    env.update(
        DJANGO_SETTINGS_MODULE="portal.settings",
        QM_VAR_DIR=str(tmp_path / "var"),
        DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
        PYTHONPATH=str(ROOT),
    )
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, mode], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )


def _line(client: subprocess.Popen[str]) -> str:
    assert client.stdout is not None
    return client.stdout.readline().strip()


def test_a_write_waits_for_the_writers_turn_and_a_read_does_not(tmp_path: Path) -> None:
    turns = os.open(tmp_path / "db.sqlite3.writers", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        # The test holds the turn; SQLite itself is not locked by anyone.
        fcntl.flock(turns, fcntl.LOCK_EX)
        writer = _client(tmp_path, "write")
        assert _line(writer) == "begin"
        reader = _client(tmp_path, "read")
        assert _line(reader) == "begin" and _line(reader) == "done"
        assert reader.wait(timeout=30) == 0
        # The read went through while the write still waits for its turn.
        time.sleep(0.5)
        assert writer.poll() is None
        fcntl.flock(turns, fcntl.LOCK_UN)
        assert _line(writer) == "done"
        assert writer.wait(timeout=30) == 0
        # The writer gave its turn back when it committed.
        fcntl.flock(turns, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(turns)
