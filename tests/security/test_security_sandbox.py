"""A rank of the sandboxed local runtime tries to escape, peek and exhaust, for real.

The control plane is this test process (root); ranks run as the real runner user under
a LocalRuntime with QM_LOCAL_SANDBOX=on and small limits. A victim job of another team
runs throughout: its command line carries an API key and it listens on its rendezvous
port. Each attacker is a job of its own that tries one thing and prints what the kernel
answered; every test asserts the refusal, its reason, and that the victim and the host
are untouched. (sandbox.py says how the sandbox is made.)
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from preemption.runtimes import GangId, GangSpec, LocalRuntime, RankPlacement, parse_inventory
from preemption.runtimes import sandbox as sandboxes
from preemption.runtimes.base import RuntimePermanentError
from preemption.runtimes.processes import is_alive
from preemption.runtimes.records import GANG_FILE, STARTED_FILE, read_record
from preemption.runtimes.runner import RunnerAccount
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

PYTHON = shlex.quote(sys.executable)
INVENTORY = "node-a:h100-80gb:8"
VICTIM_JOB = 301
VICTIM_API_KEY = "victim-api-key-must-not-leak"
PIDS_MAX = 40
FILE_SIZE_MAX = 1 << 20
LIMITS = sandboxes.SandboxLimits(pids_max=PIDS_MAX, memory_max=1 << 30, file_size_max=FILE_SIZE_MAX)

# The victim: listens on its gang's rendezvous port, with a secret on its command line.
VICTIM = textwrap.dedent(
    """
    import os, socket, time
    server = socket.socket()
    server.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
    server.listen()
    print("ready", flush=True)
    time.sleep(300)
    """
)


def python(code: str, *args: str) -> str:
    return " ".join([PYTHON, "-c", shlex.quote(code), *map(shlex.quote, args)])


@dataclass
class Scene:
    var: Path
    runtime: LocalRuntime
    victim: GangId
    victim_pid: int
    victim_port: int


def gang(job_id: int, command: str, *, var: Path, ranks: int = 1) -> GangSpec:
    return GangSpec(
        job_id=job_id,
        attempt=1,
        command=command,
        ranks=tuple(RankPlacement(rank, "node-a", rank) for rank in range(ranks)),
        gpus_per_rank=1,
        grace_seconds=5.0,
        priority_class="ai-batch-preemptible",
        team="attackers" if job_id != VICTIM_JOB else "victims",
        env={
            "QM_JOB_ID": str(job_id),
            "QM_ATTEMPT": "1",
            "QM_CHECKPOINT_DIR": str(var / "checkpoints" / f"job-{job_id}"),
        },
    )


@pytest.fixture(scope="module")
def scene(runner_account: RunnerAccount) -> Iterator[Scene]:
    found = sandboxes.support()
    assert found.available, found.reason
    base = Path(tempfile.mkdtemp(prefix="qm-sandbox-"))
    base.chmod(0o711)
    var = base / "var"
    var.mkdir(mode=0o711)
    runtime = LocalRuntime(
        var / "runs",
        parse_inventory(INVENTORY),
        runner=runner_account,
        sandbox=sandboxes.SandboxConfig(mode="on", limits=LIMITS),
    )
    victim = gang(VICTIM_JOB, python(VICTIM, f"--api-key={VICTIM_API_KEY}"), var=var)
    runtime.launch(victim)
    try:
        wait_until(lambda: b"ready" in runtime.read_log(victim.gang, 0), "the victim to listen")
        started = read_record(runtime.gang_dir(victim.gang) / "0" / STARTED_FILE)
        record = read_record(runtime.gang_dir(victim.gang) / GANG_FILE)
        assert started is not None and record is not None
        yield Scene(
            var=var,
            runtime=runtime,
            victim=victim.gang,
            victim_pid=int(started["pid"]),
            victim_port=int(record["master_port"]),
        )
    finally:
        for observed in runtime.observe():
            runtime.kill(GangId(observed.job_id, observed.attempt))
        wait_until(lambda: not runtime.gang_processes(victim.gang), "the victim to die")
        shutil.rmtree(base, ignore_errors=True)


def run_job(scene: Scene, job_id: int, command: str, *, ranks: int = 1) -> list[str]:
    """Run a job to its end; each rank's log."""
    spec = gang(job_id, command, var=scene.var, ranks=ranks)
    scene.runtime.launch(spec)
    wait_until(
        lambda: all(o.phase == "exited" for o in scene.runtime.observe(spec.gang)),
        f"job {job_id} to end",
        explain=lambda: repr(scene.runtime.read_log(spec.gang, 0)),
    )
    return [scene.runtime.read_log(spec.gang, rank).decode() for rank in range(ranks)]


def exit_codes(scene: Scene, job_id: int) -> list[int | None]:
    return [o.exit_code for o in scene.runtime.observe(GangId(job_id, 1))]


def assert_victim_untouched(scene: Scene) -> None:
    """The victim still runs and still listens, from inside its own network namespace."""
    assert psutil.pid_exists(scene.victim_pid)
    listening = Path(f"/proc/{scene.victim_pid}/net/tcp").read_text()
    assert f":{scene.victim_port:04X} 00000000:0000 0A" in listening


def test_a_rank_that_double_forks_and_setsids_dies_with_its_job(scene: Scene) -> None:
    job = GangId(311, 1)
    escape = textwrap.dedent(
        """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execve("/bin/sleep", ["sleep", "300"], {})
            os._exit(0)
        os.wait()
        print("escaped", flush=True)
        time.sleep(300)
        """
    )
    scene.runtime.launch(gang(job.job_id, python(escape), var=scene.var))
    wait_until(lambda: b"escaped" in scene.runtime.read_log(job, 0), "the rank to escape")
    record = read_record(scene.runtime.gang_dir(job) / GANG_FILE)
    assert record is not None and record["sandbox"] is not None

    def escapees() -> list[int]:
        found = []
        for pid in sandboxes.pids(record["sandbox"]):
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(pid).cmdline() == ["sleep", "300"]:
                    found.append(pid)
        return found

    # The grandchild may still be between its fork and its exec when "escaped" prints.
    wait_until(lambda: escapees(), "the escapee to execute sleep")
    members = sandboxes.pids(record["sandbox"])
    # The escapee left the rank's session and carries no marker, yet is the job's.
    [escapee] = escapees()
    assert psutil.Process(escapee).environ() == {}
    assert escapee in {process.pid for process in scene.runtime.gang_processes(job)}

    scene.runtime.signal(job, 5.0)
    scene.runtime.kill(job)

    wait_until(lambda: not is_alive(escapee, None), "the escapee to die", timeout=5)
    # A killed process stays listed in its cgroup until its parent (the rank's init,
    # itself killed) is reaped, so the cgroups empty a moment after the deaths.
    wait_until(
        lambda: sandboxes.pids(record["sandbox"]) == {}, "the rank's cgroups to empty", timeout=5
    )
    # Its keeper reaps the rank's first process; the rest are gone at once.
    wait_until(lambda: not any(is_alive(pid, None) for pid in members), "all to die", timeout=5)
    assert scene.runtime.gang_processes(job) == []
    assert_victim_untouched(scene)


def test_a_rank_that_keeps_forking_dies_whole_with_one_kill_pass(scene: Scene) -> None:
    # sandbox.kill freezes nothing: one SIGKILL pass over the cgroup kills the rank's
    # init, and the kernel then kills the rest of the rank's PID namespace and lets no
    # process fork in it, so children forked while the pass runs die all the same.
    job = GangId(318, 1)
    forker = textwrap.dedent(
        """
        import os, time
        print("forking", flush=True)
        while True:
            try:
                if os.fork() == 0:
                    os.setsid()
                    time.sleep(300)
                    os._exit(0)
            except OSError:
                time.sleep(0.001)
        """
    )
    scene.runtime.launch(gang(job.job_id, python(forker), var=scene.var))
    wait_until(lambda: b"forking" in scene.runtime.read_log(job, 0), "the rank to fork")
    record = read_record(scene.runtime.gang_dir(job) / GANG_FILE)
    assert record is not None
    wait_until(lambda: len(sandboxes.pids(record["sandbox"])) > 20, "the rank to fork more")

    # The sandbox's own kill alone: no process group signal from the runtime before it.
    sandboxes.kill(record["sandbox"])

    wait_until(lambda: sandboxes.pids(record["sandbox"]) == {}, "every process to die")
    wait_until(
        lambda: all(o.phase == "exited" for o in scene.runtime.observe(job)), "the rank to end"
    )
    assert [o.exit_code for o in scene.runtime.observe(job)] == [137]
    assert scene.runtime.gang_processes(job) == []
    assert_victim_untouched(scene)


PEEK = textwrap.dedent(
    """
    import errno, os, socket, sys
    secret = sys.argv[1][::-1]  # given reversed, so that its own command line lacks it
    pids = [name for name in os.listdir("/proc") if name.isdigit()]
    seen = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                seen.append(handle.read())
        except OSError:
            pass
    print("PROCESSES", len(pids), flush=True)
    print("SECRET SEEN" if any(secret.encode() in line for line in seen) else "SECRET HIDDEN")
    with open("/proc/net/tcp") as table:
        print("LISTENING", sum(1 for line in table if line.split()[3:4] == ["0A"]))
    for name, port in zip(("victim", "portal", "redis"), map(int, sys.argv[2:])):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            print(name, "REACHED", flush=True)
        except OSError as error:
            print(name, "REFUSED", errno.errorcode.get(error.errno, error), flush=True)
    """
)


def test_a_rank_sees_no_other_jobs_process_nor_reaches_their_ports_or_the_hosts(
    scene: Scene,
) -> None:
    # The portal's stand-in and the host's Redis (or its stand-in) listen on the host's
    # loopback, and the host reaches them: only the rank cannot.
    with socket.create_server(("127.0.0.1", 0)) as portal, socket.socket() as redis:
        redis_port = 6379
        try:
            socket.create_connection(("127.0.0.1", redis_port), timeout=1).close()
        except OSError:
            redis.bind(("127.0.0.1", 0))
            redis.listen()
            redis_port = redis.getsockname()[1]
        portal_port = portal.getsockname()[1]
        socket.create_connection(("127.0.0.1", portal_port), timeout=1).close()
        [log] = run_job(
            scene,
            312,
            python(
                PEEK,
                VICTIM_API_KEY[::-1],
                str(scene.victim_port),
                str(portal_port),
                str(redis_port),
            ),
        )
    assert exit_codes(scene, 312) == [0], log
    # Its own init, its shell and python: nothing of the victim's, nor of the host's.
    processes_line = next(line for line in log.splitlines() if line.startswith("PROCESSES"))
    assert int(processes_line.split()[1]) <= 4, log
    assert "SECRET HIDDEN" in log
    assert "LISTENING 0" in log
    for name in ("victim", "portal", "redis"):
        assert f"{name} REFUSED ECONNREFUSED" in log, log
    # The host itself still sees the victim's command line, and the victim listens.
    assert f"--api-key={VICTIM_API_KEY}" in " ".join(
        psutil.Process(child.pid).cmdline()[-1]
        for child in psutil.Process(scene.victim_pid).children(recursive=True)
    )
    assert_victim_untouched(scene)


# A rank goes for its own namespace's init, which runs as the rank's user: signals that
# would end or stop it, a trace, and its environment and memory through /proc.
AT_THE_INIT = textwrap.dedent(
    """
    import ctypes, errno, os, signal, time
    print("INIT UID", open("/proc/1/status").read().split("Uid:")[1].split()[0], os.getuid())
    for sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM, signal.SIGINT):
        os.kill(1, sig)
    time.sleep(0.3)
    print("INIT STATE", open("/proc/1/stat").read().split(") ")[1].split()[0])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.ptrace(16, 1, None, None) == 0:
        print("TRACED")
    else:
        print("TRACE REFUSED", errno.errorcode[ctypes.get_errno()])
    for name in ("environ", "mem"):
        try:
            open(f"/proc/1/{name}", "rb").read(1)
            print(name, "READ")
        except OSError as error:
            print(name, "REFUSED", errno.errorcode[error.errno])
    print("STILL HERE", flush=True)
    """
)


def test_a_rank_can_neither_end_stop_trace_nor_read_its_init(scene: Scene) -> None:
    [log] = run_job(scene, 319, python(AT_THE_INIT))
    # Had the init died, the kernel would have killed the rank with it (137, no line).
    assert exit_codes(scene, 319) == [0], log
    uid_line = next(line for line in log.splitlines() if line.startswith("INIT UID"))
    init_uid, rank_uid = uid_line.split()[2:]
    assert init_uid == rank_uid != "0", log
    # Sleeping in its wait, neither stopped (T) nor gone.
    assert "INIT STATE S" in log, log
    assert "TRACE REFUSED EPERM" in log, log
    assert "environ REFUSED EACCES" in log and "mem REFUSED EACCES" in log, log
    assert "STILL HERE" in log
    assert_victim_untouched(scene)


FORK_BOMB = textwrap.dedent(
    """
    import errno, os, time
    children = 0
    try:
        for _ in range(400):
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
            children += 1
        print("NOT LIMITED", children, flush=True)
    except OSError as error:
        print("REFUSED", errno.errorcode[error.errno], "after", children, flush=True)
    """
)


def test_a_rank_that_forks_past_its_pids_limit_is_refused_and_the_host_is_not(
    scene: Scene,
) -> None:
    [log] = run_job(scene, 313, python(FORK_BOMB))
    assert exit_codes(scene, 313) == [0], log
    assert "REFUSED EAGAIN after" in log, log
    children = int(log.split("after")[1].split()[0])
    assert children < PIDS_MAX
    # The rank's sleeping children died with it, and the host forks as before.
    assert scene.runtime.gang_processes(GangId(313, 1)) == []
    assert subprocess.run(["true"], check=False).returncode == 0
    assert_victim_untouched(scene)


WRITE_BIG = textwrap.dedent(
    """
    import errno, os, sys
    path = os.path.join(os.environ["HOME"], "big")
    try:
        with open(path, "wb") as handle:
            handle.write(b"x" * int(sys.argv[1]))
        print("NOT LIMITED", flush=True)
    except OSError as error:
        print("REFUSED", errno.errorcode[error.errno], os.path.getsize(path), flush=True)
    """
)


def test_a_rank_writing_past_the_file_size_limit_gets_efbig_or_sigxfsz(scene: Scene) -> None:
    [log] = run_job(
        scene,
        314,
        python(WRITE_BIG, str(2 * FILE_SIZE_MAX))
        + f"; head -c {2 * FILE_SIZE_MAX} /dev/zero > $HOME/big2; echo shell status $?",
    )
    assert exit_codes(scene, 314) == [0], log
    # Python ignores SIGXFSZ and gets EFBIG; the file stops at the limit.
    assert f"REFUSED EFBIG {FILE_SIZE_MAX}" in log, log
    # A program that does not is ended by SIGXFSZ (25): status 128 + 25.
    assert "shell status 153" in log, log
    work = scene.runtime.gang_dir(GangId(314, 1)) / "0" / "work"
    assert (work / "big2").stat().st_size == FILE_SIZE_MAX
    assert_victim_untouched(scene)


RENDEZVOUS = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=30))
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    print("SUM", int(total), "MASTER", os.environ["MASTER_ADDR"], flush=True)
    dist.destroy_process_group()
    """
)


def test_the_ranks_of_one_gang_still_rendezvous_inside_their_sandbox(scene: Scene) -> None:
    logs = run_job(scene, 315, python(RENDEZVOUS), ranks=2)
    assert exit_codes(scene, 315) == [0, 0], logs
    for log in logs:
        assert "SUM 3 MASTER 127.0.0.1" in log, log
    # Its sandbox went with it: no cgroup, no network namespace left.
    record = read_record(scene.runtime.gang_dir(GangId(315, 1)) / GANG_FILE)
    assert record is not None
    wait_until(
        lambda: not any(Path(folder).exists() for folder in record["sandbox"]["cgroups"].values()),
        "the gang's cgroups to go",
        timeout=5,
    )
    assert not Path(record["sandbox"]["netns"]).exists()
    assert_victim_untouched(scene)


def test_killing_gangs_while_their_keepers_remove_their_cgroups_never_fails(
    scene: Scene,
) -> None:
    # kill() freezes and kills a gang's cgroups while the keepers of its dying ranks
    # remove them: a cgroup that goes meanwhile (ENOENT, or ENODEV once its file is
    # open) has nothing left to kill, and is no error. The race is lost in a few gangs
    # of ten, so ten gangs of four ranks go through it.
    for job_id in range(321, 331):
        spec = gang(job_id, "echo up; exec sleep 60", var=scene.var, ranks=4)
        scene.runtime.launch(spec)
        wait_until(
            lambda gang=spec.gang: all(
                b"up" in scene.runtime.read_log(gang, rank) for rank in range(4)
            ),
            f"gang {job_id} to start",
        )
        record = read_record(scene.runtime.gang_dir(spec.gang) / GANG_FILE)
        assert record is not None

        scene.runtime.kill(spec.gang)

        wait_until(
            lambda gang=spec.gang: all(o.phase == "exited" for o in scene.runtime.observe(gang)),
            f"gang {job_id} to stop",
        )
        assert [o.exit_code for o in scene.runtime.observe(spec.gang)] == [137] * 4
        scene.runtime.forget(spec.gang)
        assert sandboxes.pids(record["sandbox"]) == {}
        assert not any(Path(folder).exists() for folder in record["sandbox"]["cgroups"].values())
    assert_victim_untouched(scene)


@pytest.fixture
def no_sandbox_here(monkeypatch: pytest.MonkeyPatch) -> str:
    reason = "the control plane runs as uid 1000, not root: namespaces and cgroups need root"
    monkeypatch.setattr(
        sandboxes, "support", lambda: sandboxes.SandboxSupport(available=False, reason=reason)
    )
    return reason


def test_a_gang_whose_sandbox_cannot_be_made_runs_none_of_its_ranks(
    runner_account: RunnerAccount, runner_tmp_path: Path
) -> None:
    # The keepers start while the gang's sandbox is made; a limit the kernel refuses
    # fails the making, and each rank, waiting for it, ends before its command runs.
    runtime = LocalRuntime(
        runner_tmp_path / "runs",
        parse_inventory(INVENTORY),
        runner=runner_account,
        sandbox=sandboxes.SandboxConfig(
            mode="on",
            limits=sandboxes.SandboxLimits(pids_max=-5, memory_max=1 << 30, file_size_max=1 << 20),
        ),
    )
    spec = gang(320, "echo ran", var=runner_tmp_path, ranks=3)
    runtime.launch(spec)
    wait_until(
        lambda: all(o.phase == "exited" for o in runtime.observe(spec.gang)),
        "the ranks to end",
    )
    assert [o.exit_code for o in runtime.observe(spec.gang)] == [127, 127, 127]
    for rank in range(3):
        log = runtime.read_log(spec.gang, rank).decode()
        assert "the gang's sandbox could not be made" in log, log
        assert "ran" not in log.splitlines(), log
    launcher_log = (runtime.gang_dir(spec.gang) / "launcher.log").read_text()
    assert "pids.max" in launcher_log and "Invalid argument" in launcher_log, launcher_log
    runtime.forget(spec.gang)


def test_with_sandbox_on_a_machine_that_cannot_make_one_refuses_to_launch(
    no_sandbox_here: str, runner_tmp_path: Path
) -> None:
    runtime = LocalRuntime(
        runner_tmp_path / "runs",
        parse_inventory(INVENTORY),
        sandbox=sandboxes.SandboxConfig(mode="on", limits=LIMITS),
    )
    spec = gang(316, "true", var=runner_tmp_path)
    with pytest.raises(RuntimePermanentError) as refused:
        runtime.launch(spec)
    assert str(refused.value) == (
        f"QM_LOCAL_SANDBOX=on, and this machine cannot sandbox ranks: {no_sandbox_here}"
    )
    # Nothing was made: no gang, no rank started.
    assert not runtime.gang_dir(spec.gang).exists()
    assert runtime.observe() == []


def test_with_sandbox_auto_on_a_machine_that_cannot_make_one_runs_and_says_why(
    no_sandbox_here: str, runner_tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from preemption.runtimes.local import runtime as local_runtime

    local_runtime._warned_without_sandbox = False
    runtime = LocalRuntime(
        runner_tmp_path / "runs",
        parse_inventory(INVENTORY),
        sandbox=sandboxes.SandboxConfig(mode="auto", limits=LIMITS),
    )
    spec = gang(317, "echo ran", var=runner_tmp_path)
    with caplog.at_level(logging.WARNING, logger="preemption.runtimes.local.runtime"):
        runtime.launch(spec)
    wait_until(lambda: runtime.observe(spec.gang)[0].phase == "exited", "the rank to end")
    assert runtime.observe(spec.gang)[0].exit_code == 0
    record = read_record(runtime.gang_dir(spec.gang) / GANG_FILE)
    assert record is not None and record["sandbox"] is None
    assert [r.getMessage() for r in caplog.records] == [
        "ranks of the local runtime run without a sandbox (they can see every process and "
        f"reach every port of this host, with no limits): {no_sandbox_here}"
    ]


@pytest.mark.parametrize(
    ("text", "size"),
    [("123", 123), ("512M", 512 << 20), ("64G", 64 << 30), ("1T", 1 << 40), ("2GiB", 2 << 30)],
)
def test_sizes_read_in_binary_units(text: str, size: int) -> None:
    assert sandboxes.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "-1G", "0", "1.5G", "12X", "lots"])
def test_a_size_that_is_not_one_says_so(text: str) -> None:
    with pytest.raises(ValueError) as refused:
        sandboxes.parse_size(text)
    assert str(refused.value) == f"{text!r} is not a size such as 512M or 64G"
