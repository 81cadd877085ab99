"""The command lines of the portal's three long-running processes: the web
server, a Celery worker and Celery beat. `make run` and the drill start them
the same way."""

from __future__ import annotations

import sys
from pathlib import Path


def web_command(*, bind: str, workers: int = 2, threads: int = 4, timeout: int = 120) -> list[str]:
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
        "--access-logfile",
        "-",
        "--graceful-timeout",
        "5",
    ]


def _celery(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "portal", *args, "--loglevel", "INFO"]


def worker_command(*, hostname: str, concurrency: int = 2) -> list[str]:
    return _celery("worker", "--concurrency", str(concurrency), "--hostname", hostname)


def beat_command(*, schedule: Path) -> list[str]:
    return _celery("beat", "--schedule", str(schedule))
