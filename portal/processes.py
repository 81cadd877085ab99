"""The command lines of the portal's long-running processes: the web server, a
Celery worker and Celery beat, which `make run` and the drill start the same way,
and the listener for the ranks' exits, which `make run` runs inside its own process
and a deployment of separate processes runs beside them."""

from __future__ import annotations

import sys
from pathlib import Path


def web_command(
    *, bind: str, workers: int = 2, threads: int = 4, timeout: int = 120, quiet: bool = False
) -> list[str]:
    """The web server; `quiet` drops the access log and gunicorn's own notices,
    keeping warnings and errors.

    Each connection serves one request (`--keep-alive 0`): a worker process runs one
    thread at a time (the GIL), and kept-alive connections stay with the process that
    accepted them, so in a burst of many clients one process served most of them while
    the others idled. A new connection per request goes to whichever process is free to
    accept it, which spreads the load over the processes and the machine's cores.

    A process accepts no more connections than it has threads (`--worker-connections`):
    one that took more queued them behind its busy threads while another process sat
    free, and those requests made the slowest twentieth of a burst (bench_submit, web
    server alone: p95 644 ms with the queueing, 382 ms without)."""
    return [
        sys.executable,
        "-m",
        "gunicorn",
        "portal.wsgi:application",
        "--bind",
        bind,
        "--workers",
        str(workers),
        "--threads",
        str(threads),
        "--timeout",
        str(timeout),
        *(("--log-level", "warning") if quiet else ("--access-logfile", "-")),
        "--graceful-timeout",
        "5",
        "--keep-alive",
        "0",
        "--worker-connections",
        str(threads),
    ]


def _celery(*args: str, quiet: bool) -> list[str]:
    # At INFO a worker logs two lines per task and beat one per sending; the
    # scheduling cycle runs every second, so `quiet` keeps warnings only.
    # --quiet also drops the start-up banner.
    level = "WARNING" if quiet else "INFO"
    banner = ("--quiet",) if quiet else ()
    return [sys.executable, "-m", "celery", "-A", "portal", *banner, *args, "--loglevel", level]


def worker_command(*, hostname: str, concurrency: int = 2, quiet: bool = False) -> list[str]:
    return _celery("worker", "--concurrency", str(concurrency), "--hostname", hostname, quiet=quiet)


def beat_command(*, schedule: Path, quiet: bool = False) -> list[str]:
    return _celery("beat", "--schedule", str(schedule), quiet=quiet)


def exits_command() -> list[str]:
    """The listener for the ranks' exits (manage.py watch_exits)."""
    return [sys.executable, str(Path(__file__).resolve().parents[1] / "manage.py"), "watch_exits"]
