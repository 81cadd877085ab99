"""Stopping the embedded portal stops the ranks of its jobs.

`serve_embedded` runs as a real process on a free port with a folder of its
own (SQLite, the disk broker, the local runtime); a job of two real rank
processes runs; SIGINT (Ctrl-C) must leave none of them behind. Processes are
counted by a scan of every process (the runtime's own process inspection).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from django.conf import settings

from preemption.runtimes import processes
from preemption.runtimes.runner import RunnerAccount

pytestmark = pytest.mark.timeout(400)

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ranks(marker: str) -> list[int]:
    """Live processes (zombies aside) whose command line holds `marker`, by a scan of every process."""
    found = []
    for process in processes.live_processes():
        if marker in processes.command_line(process.pid):
            found.append(process.pid)
    return found


def _manage(env: dict[str, str], *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


SUBMIT = """
import shlex, sys
from django.contrib.auth import get_user_model
from preemption.services import job_submit
from quotas.models import PriorityClass, ResourceFlavor, Team
sleeper = f"{shlex.quote(sys.executable)} -c 'import time; time.sleep(600)' MARKER"
job_submit(
    submitter=get_user_model().objects.get(username="ravi"),
    team=Team.objects.get(slug="vision"),
    flavor=ResourceFlavor.objects.get(name="h100-80gb"),
    ranks=2,
    gpus_per_rank=4,
    command=sleeper,
    priority_class=PriorityClass.objects.get(name="ai-batch-preemptible"),
    name="sleeper",
)
"""


def _installation_env(var: Path) -> dict[str, str]:
    """The environment of an embedded installation in `var` (SQLite, the disk broker)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DATABASE_URL", "CELERY_BROKER_URL", "QM_RUNS_DIR", "QM_CHECKPOINTS_DIR")
    }
    env.update(QM_VAR_DIR=str(var), QM_RUNNER_USER=settings.QM_RUNNER_USER, PYTHONPATH=str(ROOT))
    return env


@pytest.fixture(scope="module")
def seeded_var(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An installation's folder after `migrate` and `seed_demo --no-jobs`, made once for
    the module: each test serves a copy of its own, the folder a fresh installation
    would have, instead of migrating and seeding one again (seconds of CPU each)."""
    var = tmp_path_factory.mktemp("seeded") / "var"
    env = _installation_env(var)
    _manage(env, "migrate", "--noinput", "-v0")
    _manage(env, "seed_demo", "--no-jobs")
    return var


def _serve_with_a_job(
    runner_tmp_path: Path, seeded_var: Path, *options: str
) -> tuple[subprocess.Popen[str], dict[str, str], str]:
    """Serve a copy of `seeded_var` with a running two-rank job; the server, its
    environment and the marker on its ranks' command lines."""
    marker = f"qm-serve-test-{uuid.uuid4().hex}"
    shutil.copytree(seeded_var, runner_tmp_path / "var", symlinks=True)
    env = _installation_env(runner_tmp_path / "var")
    _manage(env, "shell", "-c", SUBMIT.replace("MARKER", marker))
    port = _free_port()
    server = subprocess.Popen(
        [
            *(sys.executable, "manage.py", "serve_embedded", "--bind", f"127.0.0.1:{port}"),
            *("--web-workers", "1", "--stop-grace", "5", *options),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while len(_ranks(marker)) < 2:
            assert server.poll() is None, server.stdout.read() if server.stdout else ""
            assert time.monotonic() < deadline, "the job's two ranks never started"
            time.sleep(1)
    except BaseException:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        raise
    return server, env, marker


def _serve_then_interrupt(
    runner_tmp_path: Path, seeded_var: Path, *options: str
) -> tuple[str, int, list[int], dict[str, str], str]:
    """Serve with a running two-rank job, press Ctrl-C, and return the output,
    the exit code, the rank processes left, the environment and the marker."""
    server, env, marker = _serve_with_a_job(runner_tmp_path, seeded_var, *options)
    try:
        server.send_signal(signal.SIGINT)
        output, _ = server.communicate(timeout=120)
        return output, server.returncode, _ranks(marker), env, marker
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _of_installation(var_dir: str) -> list[psutil.Process]:
    """Live processes started with `var_dir` as their QM_VAR_DIR (web, worker, beat)."""
    found = []
    for process in processes.live_processes(skip=os.getpid()):
        if processes.environ_value(process.pid, "QM_VAR_DIR") == var_dir:
            with contextlib.suppress(psutil.Error):
                found.append(psutil.Process(process.pid))
    return found


def test_ctrl_c_stops_the_ranks_of_running_jobs(
    runner_account: RunnerAccount, runner_tmp_path: Path, seeded_var: Path
) -> None:
    output, code, left, env, marker = _serve_then_interrupt(runner_tmp_path, seeded_var)
    try:
        assert left == [], f"rank processes left behind: {left}\n{output}"
        assert "Stopped 2 rank processes of 1 jobs" in output, output
        # The sleeper saves no checkpoint: the stop closed its attempt and says so.
        assert "; at the next start job 1 starts over (no checkpoint)." in output, output
        # The worker runs as root by design, and Celery's warning about it is not shown.
        assert "superuser privileges" not in output, output
        assert code == 0, output
        # Quiet by default: the scheduling cycle ran every second meanwhile,
        # but neither it nor the web server logged a line per task or request.
        assert "Sending due task" not in output and " succeeded in " not in output, output
        assert "GET /" not in output and "[INFO]" not in output, output
        assert len(output.splitlines()) < 30, output
        # The stop is recorded, so the next start requeues the job instead of
        # taking its ranks' exit for the end of the job.
        stops = _manage(
            env,
            "shell",
            "-c",
            "from preemption.models import PreemptionEvent as P; "
            "print([(p.reason, p.signal_sent_at is not None) for p in P.objects.all()])",
        )
        assert stops.strip().splitlines()[-1] == "[('shutdown', True)]"
        # Requeued already, not left stopping until the next start.
        state = _manage(
            env,
            "shell",
            "-c",
            "from preemption.models import Job; print(Job.objects.get().state)",
        )
        assert state.strip().splitlines()[-1] == "requeued"
    finally:
        for pid in _ranks(marker):
            # A rank listed a moment ago may have ended since (its job finished).
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_supervisor_that_kills_the_portal_soon_after_its_sigterm_leaves_no_rank_behind(
    runner_account: RunnerAccount, runner_tmp_path: Path, seeded_var: Path
) -> None:
    """Container runtimes and service managers SIGKILL a service some seconds after
    their SIGTERM. The ranks are told at once, while the worker is still finishing
    its tasks, so once the portal says it is stopping them a kill of the portal
    itself no longer leaves them running: they exit on their SIGTERM."""
    server, env, marker = _serve_with_a_job(runner_tmp_path, seeded_var)
    said: list[str] = []
    try:
        server.send_signal(signal.SIGTERM)
        assert server.stdout is not None
        for line in server.stdout:
            said.append(line)
            if line.startswith("Stopping 2 rank processes of 1 jobs"):
                break
        else:
            pytest.fail(f"the portal never said it stops the ranks:\n{''.join(said)}")
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
        deadline = time.monotonic() + 30
        while _ranks(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _ranks(marker) == [], "".join(said)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        # The web server, worker and beat had their SIGTERM before the kill.
        left = _of_installation(env["QM_VAR_DIR"])
        _, alive = psutil.wait_procs(left, timeout=30)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
        for pid in _ranks(marker):
            # A rank listed a moment ago may have ended since (its job finished).
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert alive == [], f"left running after the portal's SIGTERM: {alive}"


def test_keep_jobs_leaves_the_ranks_running_and_says_so(
    runner_account: RunnerAccount, runner_tmp_path: Path, seeded_var: Path
) -> None:
    output, code, left, _, marker = _serve_then_interrupt(
        runner_tmp_path, seeded_var, "--keep-jobs"
    )
    try:
        assert len(left) >= 2, output
        assert "Left 2 rank processes of 1 jobs running (--keep-jobs)" in output, output
        assert code == 0, output
    finally:
        for pid in _ranks(marker):
            # A rank listed a moment ago may have ended since (its job finished).
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.django_db
def test_seed_demo_says_it_starts_real_training_processes() -> None:
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    call_command("seed_demo", stdout=out)
    text = out.getvalue()
    assert "admin  / admin-demo-pass" in text
    assert "Submitted 3 demo jobs: 5 real training processes" in text
    assert "stopping the portal stops them" in text
