"""A rank of the sandboxed local runtime allocates past its memory limit, for real.

The control plane is this test process (root); ranks run as the real runner user under a
LocalRuntime with QM_LOCAL_SANDBOX=on and a memory limit of 64 MiB per rank
(QM_RANK_MEMORY_MAX, written to the rank's cgroup). A victim job of another team runs
throughout. The attacker holds ever more memory, 8 MiB at a time, and says how much it
holds after each step: the kernel's OOM killer must end it inside its own cgroup (SIGKILL,
exit 137) well before the host feels it, the rank's exit record must say why, and the
victim and the control plane must run on. (sandbox.py says how the sandbox is made.)
"""

from __future__ import annotations

import shlex
import shutil
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
from preemption.runtimes.records import EXIT_FILE, GANG_FILE, STARTED_FILE, read_record
from preemption.runtimes.runner import RunnerAccount
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

PYTHON = shlex.quote(sys.executable)
MEMORY_MAX = 64 << 20
LIMITS = sandboxes.SandboxLimits(pids_max=64, memory_max=MEMORY_MAX, file_size_max=1 << 20)
VICTIM_JOB = 401

# Holds 8 MiB more at each step, every page written, up to 1 GiB (16 times the limit).
GREEDY = textwrap.dedent(
    """
    held = []
    for step in range(1, 129):
        held.append(b"x" * (8 << 20))
        print("HELD", 8 * step, "MiB", flush=True)
    print("NOT LIMITED", flush=True)
    """
)
VICTIM = 'import time; print("ready", flush=True); time.sleep(300)'


def python(code: str) -> str:
    return f"{PYTHON} -c {shlex.quote(code)}"


def gang(job_id: int, command: str, *, var: Path) -> GangSpec:
    return GangSpec(
        job_id=job_id,
        attempt=1,
        command=command,
        ranks=(RankPlacement(0, "node-a", 0),),
        gpus_per_rank=1,
        grace_seconds=5.0,
        priority_class="ai-batch-preemptible",
        team="victims" if job_id == VICTIM_JOB else "attackers",
        env={"QM_CHECKPOINT_DIR": str(var / "checkpoints" / f"job-{job_id}")},
    )


@dataclass
class Scene:
    var: Path
    runtime: LocalRuntime
    victim: GangId
    victim_pid: int


@pytest.fixture(scope="module")
def scene(runner_account: RunnerAccount) -> Iterator[Scene]:
    found = sandboxes.support()
    assert found.available, found.reason
    base = Path(tempfile.mkdtemp(prefix="qm-sandbox-memory-"))
    base.chmod(0o711)
    var = base / "var"
    var.mkdir(mode=0o711)
    runtime = LocalRuntime(
        var / "runs",
        parse_inventory("node-a:h100-80gb:8"),
        runner=runner_account,
        sandbox=sandboxes.SandboxConfig(mode="on", limits=LIMITS),
    )
    victim = gang(VICTIM_JOB, python(VICTIM), var=var)
    runtime.launch(victim)
    try:
        wait_until(lambda: b"ready" in runtime.read_log(victim.gang, 0), "the victim to start")
        started = read_record(runtime.gang_dir(victim.gang) / "0" / STARTED_FILE)
        assert started is not None
        yield Scene(var=var, runtime=runtime, victim=victim.gang, victim_pid=int(started["pid"]))
    finally:
        for observed in runtime.observe():
            runtime.kill(GangId(observed.job_id, observed.attempt))
        wait_until(lambda: not runtime.gang_processes(victim.gang), "the victim to die")
        shutil.rmtree(base, ignore_errors=True)


def run_to_end(scene: Scene, job_id: int, command: str) -> str:
    spec = gang(job_id, command, var=scene.var)
    scene.runtime.launch(spec)
    wait_until(
        lambda: scene.runtime.observe(spec.gang)[0].phase == "exited",
        f"job {job_id} to end",
        explain=lambda: repr(scene.runtime.read_log(spec.gang, 0)),
    )
    return scene.runtime.read_log(spec.gang, 0).decode()


def test_a_rank_past_its_memory_limit_is_oom_killed_in_its_cgroup_and_no_one_else_is(
    scene: Scene,
) -> None:
    job = GangId(411, 1)

    log = run_to_end(scene, job.job_id, python(GREEDY))

    # Killed by the kernel (SIGKILL, 128 + 9) before it held its limit, not refused.
    [observed] = scene.runtime.observe(job)
    assert observed.exit_code == 137, log
    assert "NOT LIMITED" not in log
    held = [int(line.split()[1]) for line in log.splitlines() if line.startswith("HELD")]
    assert held and max(held) < MEMORY_MAX >> 20, log
    exit_record = read_record(scene.runtime.gang_dir(job) / "0" / EXIT_FILE)
    assert exit_record is not None
    assert exit_record["signal"] == 9
    assert (exit_record["reason"], exit_record["memory_limit"]) == ("out-of-memory", MEMORY_MAX)
    # The runtime tells the control plane why, with the limit (the words are the
    # control plane's: test_security_sandbox_oom_reason.py).
    assert (observed.end_reason, observed.memory_limit) == ("out-of-memory", MEMORY_MAX)
    # The victim of another team and its cgroup saw no OOM kill, and run on.
    assert psutil.pid_exists(scene.victim_pid)
    record = read_record(scene.runtime.gang_dir(scene.victim) / GANG_FILE)
    assert record is not None
    assert sandboxes.oom_kills(record["sandbox"], 0) == 0
    assert scene.runtime.observe(scene.victim)[0].phase == "running"
    # The control plane still launches: a job after it runs to a clean end.
    assert "after" in run_to_end(scene, 412, "echo after")
    assert [o.exit_code for o in scene.runtime.observe(GangId(412, 1))] == [0]


def test_a_rank_that_stays_under_its_memory_limit_ends_with_no_reason(scene: Scene) -> None:
    job = GangId(413, 1)
    log = run_to_end(scene, job.job_id, python('x = b"x" * (16 << 20); print("held 16 MiB")'))
    assert "held 16 MiB" in log
    exit_record = read_record(scene.runtime.gang_dir(job) / "0" / EXIT_FILE)
    assert exit_record is not None
    assert (exit_record["exit_code"], exit_record["reason"]) == (0, "")
    assert scene.runtime.observe(job)[0].end_reason == ""


def fake_cgroup(tmp_path: Path, version: int, oom_kills: int) -> dict[str, object]:
    """A gang's sandbox record over a folder that stands in for its rank-0 cgroup."""
    controller, name = ("memory", "memory.oom_control") if version == 1 else ("unified", "")
    leaf = tmp_path / "gang" / "0"
    leaf.mkdir(parents=True)
    if version == 1:
        (leaf / name).write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {oom_kills}\n")
    else:
        (leaf / "memory.events").write_text(
            f"low 0\nhigh 0\nmax 5\noom 1\noom_kill {oom_kills}\noom_group_kill 0\n"
        )
    return {"cgroups": {controller: str(tmp_path / "gang")}, "limits": {"memory_max": 3 << 30}}


@pytest.mark.parametrize(
    ("version", "kills", "exit_code", "reason"),
    [
        (1, 1, 137, "out-of-memory"),
        (2, 2, 137, "out-of-memory"),
        # A child killed, and the rank failed on its own: the kill is still why.
        (1, 1, 1, "out-of-memory"),
        # The rank handled its child's death and succeeded: nothing to explain.
        (2, 1, 0, ""),
        (1, 0, 137, ""),
    ],
)
def test_the_end_reason_reads_the_cgroups_oom_kill_count(
    tmp_path: Path, version: int, kills: int, exit_code: int, reason: str
) -> None:
    sandbox = fake_cgroup(tmp_path, version, kills)
    assert sandboxes.end_reason(sandbox, 0, exit_code) == reason


def test_a_cgroup_that_is_gone_tells_no_reason(tmp_path: Path) -> None:
    sandbox = {"cgroups": {"memory": str(tmp_path / "gone")}, "limits": {"memory_max": 1 << 30}}
    assert sandboxes.oom_kills(sandbox, 0) == 0
    assert sandboxes.end_reason(sandbox, 0, 137) == ""


@pytest.mark.parametrize(
    ("size", "words"),
    [
        (64 << 20, "64 MiB"),
        (3 << 30, "3 GiB"),
        (1 << 40, "1 TiB"),
        (1536 << 10, "1536 KiB"),
        (1000, "1000 bytes"),
    ],
)
def test_limits_are_worded_in_the_largest_binary_unit_that_divides_them(
    size: int, words: str
) -> None:
    assert sandboxes.format_size(size) == words
