"""A rank of the local runtime attacks the control plane and another job, for real.

The control plane here is this test process (root, as CI and `make run` as root are) with
a var folder made by the settings module in a child process; the ranks run as the real
runner user (created by bin/runner-user) under a LocalRuntime rooted in that var folder.
A victim job of another team runs throughout, with a secret in its private folder, a
checkpoint and an events token in its environment. Each attacker is a one-rank job that
first does a job's ordinary work (a file in its own folder, a checkpoint), then tries one
attack and prints how the kernel answered. Every line of the table asserts the refusal,
that the attacker's job still succeeded, and that the victim runs on untouched.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from preemption import runtime as runtime_settings
from preemption.runtime import get_runtime, local_runner
from preemption.runtimes import GangId, GangSpec, LocalRuntime, RankPlacement, parse_inventory
from preemption.runtimes.local.launch_server import PROJECT_ROOT
from preemption.runtimes.records import EXITS_FIFO, STARTED_FILE, read_record
from preemption.runtimes.runner import RunnerAccount, find_runner
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

PYTHON = shlex.quote(sys.executable)
SLEEPER = f"{PYTHON} {shlex.quote(str(PROJECT_ROOT / 'examples' / 'sleeper.py'))}"
INVENTORY = "node-a:h100-80gb:8"
VICTIM_JOB = 101
VICTIM_TOKEN = "victim-events-token-must-not-leak"

# The attacker's program: the job's ordinary work, then one attack, then exit 0.
ATTACK = textwrap.dedent(
    """
    import errno, os, signal, sys
    action, target = sys.argv[1], sys.argv[2]
    with open(os.path.join(os.environ["HOME"], "notes.txt"), "w") as notes:
        notes.write("my own work")
    checkpoint = os.path.join(os.environ["QM_CHECKPOINT_DIR"], "step_1.pt")
    with open(checkpoint, "w") as saved:
        saved.write("checkpoint of job " + os.environ["QM_JOB_ID"])
    try:
        if action == "read":
            with open(target, "rb") as handle:
                got = handle.read()
        elif action == "list":
            got = os.listdir(target)
        elif action == "signal":
            os.kill(int(target), signal.SIGTERM)
            got = "signalled"
        else:
            with open(target, "w") as handle:
                handle.write('{"exit_code": 99}')
            got = "written"
        print("ATTACK SUCCEEDED", repr(got)[:300], flush=True)
    except OSError as error:
        print("REFUSED", errno.errorcode[error.errno], type(error).__name__, flush=True)
    """
)


@dataclass
class Scene:
    """The control plane's var folder, its runtime, and the victim job."""

    var: Path
    runtime: LocalRuntime
    victim_pid: int

    def checkpoints(self, job_id: int) -> Path:
        return self.var / "checkpoints" / f"job-{job_id}"


def control_plane_var(var: Path) -> None:
    """Make a var folder the way the settings module does, with a SQLite database."""
    code = (
        "import django; django.setup()\n"
        "from django.db import connection, transaction\n"
        "with transaction.atomic(), connection.cursor() as cursor:\n"
        "    cursor.execute('create table tokens (job integer, token text)')\n"
        f"    cursor.execute(\"insert into tokens values ({VICTIM_JOB}, '{VICTIM_TOKEN}')\")\n"
    )
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(PROJECT_ROOT),
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        "QM_VAR_DIR": str(var),
        "DATABASE_URL": f"sqlite:///{var / 'quartermaster.sqlite3'}",
    }
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=PROJECT_ROOT)


def gang(job_id: int, command: str, *, runtime: LocalRuntime, var: Path, token: str) -> GangSpec:
    return GangSpec(
        job_id=job_id,
        attempt=1,
        command=command,
        ranks=(RankPlacement(0, "node-a", 0),),
        gpus_per_rank=1,
        grace_seconds=5.0,
        priority_class="ai-batch-preemptible",
        env={
            "QM_JOB_ID": str(job_id),
            "QM_ATTEMPT": "1",
            "QM_CHECKPOINT_DIR": str(var / "checkpoints" / f"job-{job_id}"),
            "QM_EVENTS_TOKEN": token,
        },
    )


@pytest.fixture(scope="module")
def scene(runner_account: RunnerAccount) -> Iterator[Scene]:
    base = Path(tempfile.mkdtemp(prefix="qm-security-"))
    base.chmod(0o711)
    var = base / "var"
    control_plane_var(var)
    runtime = LocalRuntime(var / "runs", parse_inventory(INVENTORY), runner=runner_account)
    victim = gang(
        VICTIM_JOB,
        'printf "victim secret" > "$HOME/secret.txt"; '
        'printf "victim checkpoint" > "$QM_CHECKPOINT_DIR/step_1.pt"; '
        f"exec {SLEEPER} --seconds 300",
        runtime=runtime,
        var=var,
        token=VICTIM_TOKEN,
    )
    runtime.launch(victim)
    try:
        wait_until(lambda: b"ready" in runtime.read_log(victim.gang, 0), "the victim to start")
        started = read_record(runtime.gang_dir(victim.gang) / "0" / STARTED_FILE)
        assert started is not None
        yield Scene(var=var, runtime=runtime, victim_pid=int(started["pid"]))
    finally:
        for observed in runtime.observe():
            runtime.kill(GangId(observed.job_id, observed.attempt))
        wait_until(lambda: not runtime.gang_processes(victim.gang), "the victim to die")
        shutil.rmtree(base, ignore_errors=True)


def victim_folder(scene: Scene) -> Path:
    return scene.runtime.gang_dir(GangId(VICTIM_JOB, 1)) / "0" / "work"


# One line per attack: what the rank tries, how, on which path, and the kernel's answer.
ATTACKS: list[tuple[str, str, Callable[[Scene, int], Path | int], str]] = [
    ("signal another job's rank", "signal", lambda s, job: s.victim_pid, "EPERM"),
    ("read the secret key", "read", lambda s, job: s.var / "secret_key", "EACCES"),
    ("read the SQLite database", "read", lambda s, job: s.var / "quartermaster.sqlite3", "EACCES"),
    (
        "open the SQLite writers' lock (to hold up every writer)",
        "read",
        lambda s, job: s.var / "quartermaster.sqlite3.writers",
        "EACCES",
    ),
    ("list the control plane's var folder", "list", lambda s, job: s.var, "EACCES"),
    (
        "read the control plane's environment (SECRET_KEY, DATABASE_URL)",
        "read",
        lambda s, job: Path(f"/proc/{os.getpid()}/environ"),
        "EACCES",
    ),
    ("list every job's run folder", "list", lambda s, job: s.runtime.root, "EACCES"),
    (
        "list another job's folder",
        "list",
        lambda s, job: s.runtime.root / str(VICTIM_JOB),
        "EACCES",
    ),
    (
        "read a file in another job's private folder",
        "read",
        lambda s, job: victim_folder(s) / "secret.txt",
        "EACCES",
    ),
    (
        "read another job's events token from its rank's environment",
        "read",
        lambda s, job: Path(f"/proc/{s.victim_pid}/environ"),
        "EACCES",
    ),
    (
        "read another job's events token from its gang record",
        "read",
        lambda s, job: s.runtime.gang_dir(GangId(VICTIM_JOB, 1)) / "gang.json",
        "EACCES",
    ),
    (
        "read another job's checkpoint",
        "read",
        lambda s, job: s.checkpoints(VICTIM_JOB) / "step_1.pt",
        "EACCES",
    ),
    ("list every job's checkpoints", "list", lambda s, job: s.var / "checkpoints", "EACCES"),
    (
        "forge its own exit record",
        "write",
        lambda s, job: s.runtime.gang_dir(GangId(job, 1)) / "0" / "exit.json",
        "EACCES",
    ),
    (
        "forge its own start record (to aim the control plane's signals at another group)",
        "write",
        lambda s, job: s.runtime.gang_dir(GangId(job, 1)) / "0" / "started.json",
        "EACCES",
    ),
    (
        "hold every launch by placing the stopping portal's marker",
        "write",
        lambda s, job: s.var / "launches.held",
        "EACCES",
    ),
]


@pytest.mark.parametrize(
    ("what", "action", "target", "expected"),
    ATTACKS,
    ids=[attack[0] for attack in ATTACKS],
)
def test_a_rank_is_refused(
    scene: Scene,
    what: str,
    action: str,
    target: Callable[[Scene, int], Path | int],
    expected: str,
) -> None:
    job_id = 200 + [attack[0] for attack in ATTACKS].index(what)
    path = target(scene, job_id)
    victim_secret = (victim_folder(scene) / "secret.txt").read_bytes()
    command = f"{PYTHON} -c {shlex.quote(ATTACK)} {action} {shlex.quote(str(path))}"
    spec = gang(job_id, command, runtime=scene.runtime, var=scene.var, token=f"token-{job_id}")
    scene.runtime.launch(spec)
    wait_until(
        lambda: scene.runtime.observe(spec.gang)[0].phase == "exited", "the attacker to exit"
    )

    log = scene.runtime.read_log(spec.gang, 0).decode()
    assert f"REFUSED {expected} PermissionError" in log, log
    assert "ATTACK SUCCEEDED" not in log
    # The attacker's job ran normally: exit 0, its own folder, a checkpoint the control
    # plane can read.
    assert scene.runtime.observe(spec.gang)[0].exit_code == 0
    work = scene.runtime.gang_dir(spec.gang) / "0" / "work"
    assert (work / "notes.txt").read_text() == "my own work"
    saved = scene.checkpoints(job_id) / "step_1.pt"
    assert saved.read_text() == f"checkpoint of job {job_id}"
    assert saved.stat().st_uid == scene.runtime.runner.job_uid(job_id)  # type: ignore[union-attr]
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    # Nothing the attack aimed at changed: the victim runs on with its secret.
    assert scene.runtime.observe(GangId(VICTIM_JOB, 1))[0].phase == "running"
    assert (victim_folder(scene) / "secret.txt").read_bytes() == victim_secret
    if action == "write" and path.name == "launches.held":
        assert not path.exists()
    elif action == "write":
        # The keeper's record stands, not the attacker's {"exit_code": 99}.
        kept = read_record(path)
        assert kept is not None
        if path.name == "started.json":
            rank = scene.runtime.observe(spec.gang)[0]
            assert kept["pid"] == kept["pgid"] == int(rank.handle) and "exit_code" not in kept
        else:
            assert kept["exit_code"] == 0 and "exited_at" in kept


def test_a_rank_cannot_write_to_the_control_planes_exits_pipe(scene: Scene) -> None:
    # The keepers' pipe that wakes the reconciler: a rank that could write to it could
    # make the control plane run passes without end.
    stop = threading.Event()
    announced: list[list[int]] = []
    watcher = threading.Thread(target=scene.runtime.watch_exits, args=(stop, announced.append))
    watcher.start()
    try:
        fifo = scene.runtime.root / EXITS_FIFO
        wait_until(fifo.exists, "the exits pipe")
        command = f"{PYTHON} -c {shlex.quote(ATTACK)} write {shlex.quote(str(fifo))}"
        spec = gang(299, command, runtime=scene.runtime, var=scene.var, token="token-299")
        scene.runtime.launch(spec)
        wait_until(
            lambda: scene.runtime.observe(spec.gang)[0].phase == "exited", "the attacker to exit"
        )
        log = scene.runtime.read_log(spec.gang, 0).decode()
        assert "REFUSED EACCES PermissionError" in log, log
        assert "ATTACK SUCCEEDED" not in log
        assert scene.runtime.observe(spec.gang)[0].exit_code == 0
        found = fifo.lstat()
        assert stat.S_ISFIFO(found.st_mode) and stat.S_IMODE(found.st_mode) == 0o600
        assert found.st_uid == os.geteuid()
        # The attacker's own exit is announced by its keeper, as every rank's is.
        wait_until(lambda: bool(announced), "the attacker's exit to be announced")
        # Only the keeper's line reached the pipe: its job, and nothing the rank wrote.
        assert announced == [[299]]
    finally:
        stop.set()
        watcher.join(timeout=10)
    assert not watcher.is_alive()


def test_the_control_plane_keeps_its_var_folder_to_itself(scene: Scene) -> None:
    me = os.geteuid()
    expected_modes = {
        scene.var: 0o711,
        scene.var / "secret_key": 0o600,
        scene.var / "quartermaster.sqlite3": 0o600,
        scene.var / "broker": 0o700,
        scene.var / "quartermaster.sqlite3.writers": 0o600,
        scene.runtime.root: 0o711,
        scene.runtime.root / str(VICTIM_JOB): 0o710,
        scene.checkpoints(VICTIM_JOB): 0o770,
        victim_folder(scene): 0o700,
    }
    for path, mode in expected_modes.items():
        info = path.stat()
        assert stat.S_IMODE(info.st_mode) == mode, path
    for path in list(expected_modes)[:7]:
        assert path.stat().st_uid == me, path
    runner = scene.runtime.runner
    assert runner is not None
    job_gid = runner.job_gid(VICTIM_JOB)
    assert (scene.runtime.root / str(VICTIM_JOB)).stat().st_gid == job_gid
    assert scene.checkpoints(VICTIM_JOB).stat().st_gid == job_gid
    assert (victim_folder(scene).stat().st_uid, victim_folder(scene).stat().st_gid) == (
        job_gid,
        job_gid,
    )
    # SQLite gives its write-ahead log the database's mode.
    wal = scene.var / "quartermaster.sqlite3-wal"
    assert not wal.exists() or stat.S_IMODE(wal.stat().st_mode) == 0o600


def test_the_victim_rank_runs_as_its_job_user_and_group_without_new_privileges(
    scene: Scene,
) -> None:
    status = Path(f"/proc/{scene.victim_pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    runner = scene.runtime.runner
    assert runner is not None
    gid = runner.job_gid(VICTIM_JOB)
    assert fields["Uid"].split() == [str(runner.job_uid(VICTIM_JOB))] * 4
    assert fields["Gid"].split() == [str(gid)] * 4
    assert fields["Groups"].split() == []
    # No setuid program (su, sudo, newgrp) can hand privileges back.
    assert fields["NoNewPrivs"].strip() == "1"


# -------------------------------------------------- without a runner user

LOOKUPS = [
    ("no such user", "qm-no-such-runner", "there is no user 'qm-no-such-runner'"),
    ("root itself", "root", "is root, which isolates nothing"),
    ("empty setting", "", "QM_RUNNER_USER is empty"),
]


@pytest.mark.parametrize(("case", "name", "reason"), LOOKUPS, ids=[c[0] for c in LOOKUPS])
def test_a_runner_that_cannot_be_had_says_why(case: str, name: str, reason: str) -> None:
    lookup = find_runner(name)
    assert lookup.account is None
    assert reason in lookup.reason


def test_production_refuses_the_local_runtime_without_a_runner(
    settings: Any, tmp_path: Path, runner_account: RunnerAccount
) -> None:
    settings.PRODUCTION = True
    settings.QM_RUNNER_USER = "qm-no-such-runner"
    with pytest.raises(ImproperlyConfigured, match="there is no user 'qm-no-such-runner'"):
        local_runner()

    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(PROJECT_ROOT),
        "QM_PRODUCTION": "1",
        "SECRET_KEY": "production-key-" + "x" * 50,
        "ALLOWED_HOSTS": "qm.example.org",
        "QM_VAR_DIR": str(tmp_path / "var"),
        "DATABASE_URL": f"sqlite:///{tmp_path / 'var' / 'qm.sqlite3'}",
        "QM_RUNNER_USER": "qm-no-such-runner",
    }
    refused = subprocess.run(
        [sys.executable, "manage.py", "check"],
        env=env,
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert refused.returncode != 0
    assert "preemption.E001" in refused.stderr
    assert "there is no user 'qm-no-such-runner'" in refused.stderr

    accepted = subprocess.run(
        [sys.executable, "manage.py", "check"],
        env={**env, "QM_RUNNER_USER": runner_account.name},
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert accepted.returncode == 0, accepted.stderr


def test_outside_production_ranks_run_as_the_control_plane_with_one_warning(
    settings: Any,
    runner_tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings.PRODUCTION = False
    settings.QM_RUNNER_USER = "qm-no-such-runner"
    settings.QM_LOCAL_NODES = INVENTORY
    settings.QM_RUNS_DIR = runner_tmp_path / "runs"
    monkeypatch.setattr(runtime_settings, "_warned_without_runner", False)
    with caplog.at_level(logging.WARNING, logger="preemption.runtime"):
        first = get_runtime()
        second = get_runtime()
    warnings = [r.getMessage() for r in caplog.records if r.name == "preemption.runtime"]
    assert len(warnings) == 1
    assert "run as the control plane's own user" in warnings[0]
    assert "there is no user 'qm-no-such-runner'" in warnings[0]
    assert isinstance(first, LocalRuntime) and isinstance(second, LocalRuntime)
    assert first.runner is None

    spec = gang(
        300, 'echo "uid=$(id -u) home=$HOME"', runtime=first, var=runner_tmp_path, token="t"
    )
    first.launch(spec)
    wait_until(lambda: first.observe(spec.gang)[0].phase == "exited", "the rank to exit")
    work = first.gang_dir(spec.gang) / "0" / "work"
    assert first.read_log(spec.gang, 0) == f"uid={os.geteuid()} home={work}\n".encode()
    assert first.observe(spec.gang)[0].exit_code == 0


# ------------------------------------------------------------ the runner user

RUNNER_USER_SCRIPT = PROJECT_ROOT / "bin" / "runner-user"


def run_runner_user(*prefix: str, user: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, str(RUNNER_USER_SCRIPT), sys.executable],
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "QM_RUNNER_USER": user},
        capture_output=True,
        text=True,
        check=False,
    )


def test_runner_user_script_creates_the_user_once_and_says_so() -> None:
    name = "qm-test-runner"
    subprocess.run(["userdel", name], capture_output=True, check=False)
    try:
        created = run_runner_user(user=name)
        assert created.returncode == 0, created.stderr
        assert f"created the system user {name}" in created.stdout
        lookup = find_runner(name)
        assert lookup.account is not None, lookup.reason
        assert lookup.account.uid < 1000  # a system user

        again = run_runner_user(user=name)
        assert again.returncode == 0, again.stderr
        assert again.stdout == ""
    finally:
        subprocess.run(["userdel", name], capture_output=True, check=False)


def test_runner_user_script_run_by_another_user_only_says_what_ranks_run_as(
    runner_account: RunnerAccount,
) -> None:
    result = run_runner_user("runuser", "-u", runner_account.name, "--", user="qm-test-nobody")
    assert result.returncode == 0, result.stderr
    assert f"not root: ranks of the local runtime will run as {runner_account.name}" in (
        result.stdout
    )
    assert find_runner("qm-test-nobody").account is None
