"""The embedded portal's Celery worker runs as root by design and does not warn
every user of `make run` about it; any other warning still reaches its output.

The worker runs as a real process with the command line `serve_embedded` gives it,
in a folder of its own (the embedded default: SQLite and the disk broker), until it
says it is ready. A `sitecustomize` on its path raises two other warnings as it
starts, one of them Celery's own SecurityWarning, which must still show."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from portal.processes import embedded_commands, worker_command

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
ROOT_WARNING = "You're running the worker with superuser privileges"
OTHER_WARNINGS = """
import warnings
from celery.exceptions import SecurityWarning
warnings.warn("a warning of the project's own that must still show", UserWarning)
warnings.warn(SecurityWarning("another security warning that must still show"))
"""


def _worker_output(command: list[str], tmp_path: Path) -> str:
    """Everything the worker writes from its start until it is ready."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(OTHER_WARNINGS)
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DATABASE_URL", "CELERY_BROKER_URL")
    }
    env.update(
        QM_VAR_DIR=str(tmp_path / "var"),
        PYTHONPATH=f"{site}{os.pathsep}{ROOT}",
        PYTHONUNBUFFERED="1",
    )
    worker = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        assert worker.stdout is not None
        deadline = time.monotonic() + 90
        for line in worker.stdout:
            lines.append(line)
            # Celery checks its privileges before it connects to the broker.
            if line.rstrip().endswith(" ready.") or time.monotonic() > deadline:
                break
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
    output = "".join(lines)
    assert output.rstrip().endswith(" ready."), output
    return output


def test_the_embedded_worker_keeps_quiet_about_root_and_shows_other_warnings(
    tmp_path: Path,
) -> None:
    assert os.geteuid() == 0, "the embedded portal runs as root; so do these tests"
    # The worker of `serve_embedded --verbose`, which says when it is ready; the quiet
    # one differs only in what Celery logs, not in the interpreter's options before -m.
    verbose, quiet = (
        embedded_commands(
            bind="127.0.0.1:0", web_workers=1, schedule=tmp_path / "schedule", quiet=logs_less
        )["worker"]
        for logs_less in (False, True)
    )
    assert verbose[: verbose.index("-m")] == quiet[: quiet.index("-m")]

    output = _worker_output(verbose, tmp_path)

    assert ROOT_WARNING not in output, output
    assert "a warning of the project's own that must still show" in output, output
    assert "SecurityWarning: another security warning that must still show" in output, output


def test_another_worker_still_warns_about_root(tmp_path: Path) -> None:
    """The filter is the embedded worker's alone: a deployment's worker run as root
    is told, as Celery tells it."""
    assert os.geteuid() == 0, "the embedded portal runs as root; so do these tests"
    output = _worker_output(worker_command(hostname="deployed@%h", concurrency=1), tmp_path)
    assert ROOT_WARNING in output, output
