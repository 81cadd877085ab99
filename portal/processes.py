"""The command lines of the portal's long-running processes: the web server, a
Celery worker and Celery beat, which `make run` and the drill start the same way,
and the listener for the ranks' exits, which `make run` runs inside its own process
and a deployment of separate processes runs beside them."""

from __future__ import annotations

import sys
from collections.abc import Sequence
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


def _celery(*args: str, quiet: bool, warning_filters: Sequence[str] = ()) -> list[str]:
    # At INFO a worker logs two lines per task and beat one per sending; the
    # scheduling cycle runs every second, so `quiet` keeps warnings only.
    # --quiet also drops the start-up banner.
    level = "WARNING" if quiet else "INFO"
    banner = ("--quiet",) if quiet else ()
    filters = [option for spec in warning_filters for option in ("-W", spec)]
    return [
        sys.executable,
        *filters,
        "-m",
        "celery",
        "-A",
        "portal",
        *banner,
        *args,
        "--loglevel",
        level,
    ]


# Celery warns at each start of a worker that runs as root, on stderr, in eight lines.
# The embedded portal's worker runs as root by design: the local runtime starts every
# rank as a user and group of its job's own, which only root may do (see
# preemption/runtimes/local/), so the warning told each new user of `make run` about a
# choice made for them. Celery has no setting for it (C_FORCE_ROOT only lets a root
# worker accept pickle), and its SecurityWarning class cannot be named in a -W option
# (the interpreter reads those before it can import Celery), so the filter names the
# warning's message: any other warning, Celery's own included, still shows.
ROOT_WORKER_WARNING = "ignore:You're running the worker with superuser privileges"


def worker_command(
    *, hostname: str, concurrency: int = 2, quiet: bool = False, root_by_design: bool = False
) -> list[str]:
    """A Celery worker; `root_by_design` drops Celery's warning about running as root."""
    return _celery(
        *("worker", "--concurrency", str(concurrency), "--hostname", hostname),
        quiet=quiet,
        warning_filters=(ROOT_WORKER_WARNING,) if root_by_design else (),
    )


def beat_command(*, schedule: Path, quiet: bool = False) -> list[str]:
    return _celery("beat", "--schedule", str(schedule), quiet=quiet)


def embedded_commands(
    *, bind: str, web_workers: int, schedule: Path, quiet: bool
) -> dict[str, list[str]]:
    """The web server, worker and beat of the embedded portal (`make run`), by name."""
    return {
        # Processes rather than threads: the threads of one process take turns at
        # the interpreter, and a thread mostly waits for its turn to write to SQLite,
        # which two per process cover (bench_submit: 4 x 2 served a burst with p95
        # 607 ms, 3 x 4 with 682 ms).
        "web": web_command(bind=bind, workers=web_workers, threads=2, quiet=quiet),
        "worker": worker_command(hostname="embedded@%h", quiet=quiet, root_by_design=True),
        "beat": beat_command(schedule=schedule, quiet=quiet),
    }


def exits_command() -> list[str]:
    """The listener for the ranks' exits (manage.py watch_exits)."""
    return [sys.executable, str(Path(__file__).resolve().parents[1] / "manage.py"), "watch_exits"]
