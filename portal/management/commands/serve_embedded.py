"""Run the embedded portal: web server, Celery worker and beat together.

Where the runtime can tell (the local and mimic runtimes) it also listens for the
ranks' exits and reconciles their jobs at each (preemption.reconcile.listen_for_exits),
so a finished job's GPUs go to the next one at once rather than at the next periodic
pass.

Ctrl-C (or SIGTERM) stops all three; if one of them dies, the others are
stopped too, so nothing is left half-running. With the local runtime the ranks
of running jobs are stopped as well (SIGTERM, a grace window to checkpoint,
SIGKILL), and their jobs resume from their checkpoints at the next start;
`--keep-jobs` leaves them running instead. Either way the command says which it
did. The ranks get their SIGTERM at once, while the worker still finishes its
tasks (it takes a few seconds), so a supervisor that kills this command soon
after its own SIGTERM leaves no rank untold. Meanwhile launches are held (a job
requeued by the worker's last passes starts at the next start), and a gang
launched before the hold is stopped once the worker has exited.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from portal.processes import embedded_commands
from preemption.reconcile import RankShutdown, hold_launches, listen_for_exits, live_rank_count


class Command(BaseCommand):
    help = "Serve the portal with a Celery worker and beat (the embedded default)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--bind", default="127.0.0.1:8000")
        parser.add_argument("--web-workers", type=int, default=4)
        parser.add_argument(
            "--verbose",
            action="store_true",
            help="log every request and task, not only warnings",
        )
        parser.add_argument(
            "--keep-jobs",
            action="store_true",
            help="leave the local runtime's ranks running when the portal stops",
        )
        parser.add_argument(
            "--stop-grace",
            type=float,
            default=15.0,
            help="seconds the ranks get to checkpoint and exit before SIGKILL (default 15)",
        )

    def handle(
        self,
        *args: Any,
        bind: str,
        web_workers: int,
        keep_jobs: bool,
        stop_grace: float,
        verbose: bool,
        **options: Any,
    ) -> None:
        python = sys.executable
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "QM_PUBLIC_URL": settings.QM_PUBLIC_URL}
        quiet = not verbose
        if quiet:
            env.setdefault("LOG_LEVEL", "WARNING")
        subprocess.run(
            [python, "manage.py", "collectstatic", "--noinput", "-v0"], check=True, env=env
        )
        commands = embedded_commands(
            bind=bind,
            web_workers=web_workers,
            schedule=settings.VAR_DIR / "celerybeat-schedule",
            quiet=quiet,
        )
        # A hold left by a stop that was cut short (the marker's process is gone).
        hold_launches(False)
        children: dict[str, subprocess.Popen[bytes]] = {}
        stopping = False

        def stop(*_: Any) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        for name, command in commands.items():
            children[name] = subprocess.Popen(command, env=env, start_new_session=True)
        self.stdout.write(
            self.style.SUCCESS(
                f"Quartermaster is running at http://{bind}/  (Ctrl-C stops web, worker, beat"
                + (" and leaves the jobs' ranks running)" if keep_jobs else " and the jobs' ranks)")
            )
        )
        if quiet:
            self.stdout.write("Logging warnings only; --verbose logs every request and task.")
        watching = threading.Event()
        threading.Thread(
            target=listen_for_exits, args=(watching,), name="exits", daemon=True
        ).start()
        exit_code = 0
        try:
            while not stopping:
                for name, child in children.items():
                    if child.poll() is not None:
                        self.stderr.write(
                            f"{name} exited with code {child.returncode}; stopping the others"
                        )
                        exit_code = 1
                        stopping = True
                        break
                time.sleep(0.5)
        finally:
            watching.set()
            for child in children.values():
                if child.poll() is None:
                    # The leader only: gunicorn and Celery stop their own workers
                    # in order; a signal to the whole group makes those workers
                    # die mid-task and their parents log each as an error.
                    child.terminate()
            # The worker finishes its tasks while it stops; a job requeued meanwhile is
            # not launched again only to be stopped once more.
            hold_launches(True)
            shutdown = self._signal_ranks(keep_jobs=keep_jobs, grace_seconds=stop_grace)
            deadline = time.time() + 15
            for child in children.values():
                try:
                    child.wait(timeout=max(0.1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    os.killpg(child.pid, signal.SIGKILL)
            self._finish_ranks(shutdown)
            hold_launches(False)
        sys.exit(exit_code)

    def _signal_ranks(self, *, keep_jobs: bool, grace_seconds: float) -> RankShutdown | None:
        """Tell the local runtime's ranks to stop with the portal (None when they are
        kept or belong to another runtime); `_finish_ranks` waits for them.

        Kubernetes pods belong to the cluster, not to this process, and are left alone.
        """
        if settings.QM_RUNTIME != "local" or keep_jobs:
            return None
        shutdown = RankShutdown(grace_seconds=grace_seconds)
        jobs, ranks = shutdown.signal_live()
        if ranks:
            self.stdout.write(
                f"Stopping {ranks} rank processes of {jobs} jobs: SIGTERM, up to "
                f"{grace_seconds:g} s to checkpoint, then SIGKILL ...",
            )
            self.stdout.flush()
        return shutdown

    def _finish_ranks(self, shutdown: RankShutdown | None) -> None:
        """Once the worker has exited: stop the ranks it launched meanwhile, wait for
        every rank told to stop, and say what was done; or say which ranks were kept."""
        if settings.QM_RUNTIME != "local":
            return
        if shutdown is None:
            jobs, ranks = live_rank_count()
            if ranks:
                self.stdout.write(
                    f"Left {ranks} rank processes of {jobs} jobs running (--keep-jobs); "
                    "the next start picks them up."
                )
            return
        report = shutdown.finish()
        if report.ranks:
            resumes = ", ".join(
                f"job {job_id} resumes at step {step}"
                if step is not None
                else f"job {job_id} starts over (no checkpoint)"
                for job_id, step in report.resumes.items()
            )
            self.stdout.write(
                f"Stopped {report.ranks} rank processes of {report.jobs} jobs"
                + (f" ({report.killed} killed at the end of the grace)" if report.killed else "")
                + (
                    f"; at the next start {resumes}."
                    if resumes
                    else "; they resume from their checkpoints at the next start."
                )
            )
