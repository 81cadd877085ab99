"""The local runtime with real processes, real signals and real files.

Every test launches gangs under its own temporary root and, on teardown, kills whatever
is left of them, so no process outlives a test. Ranks run as the runner user, as they do
when root runs the control plane; tests/security covers what that keeps them from.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest

import preemption.runtimes as runtimes_package
from preemption.runtimes import (
    GangId,
    GangSpec,
    LocalRuntime,
    RankObservation,
    RankPlacement,
    RuntimePermanentError,
    iter_trap_events,
    parse_inventory,
    processes,
)
from preemption.runtimes.gpu_slots import LOCK_FOLDER as GPU_LOCK_FOLDER
from preemption.runtimes.local.launch_server import PROJECT_ROOT, launch_server
from preemption.runtimes.local.ports import MASTER_PORT_FLOOR, ephemeral_port_floor
from preemption.runtimes.local.scan import _group_owner
from preemption.runtimes.processes import ProcessInfo
from preemption.runtimes.records import (
    EXITS_FIFO,
    GANG_FILE,
    GANG_INDEX,
    KEEPER_FILE,
    STARTED_FILE,
    read_record,
    write_record,
)
from preemption.runtimes.runner import RunnerAccount
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(90)

PYTHON = shlex.quote(sys.executable)
SLEEPER = f"{PYTHON} {shlex.quote(str(PROJECT_ROOT / 'examples' / 'sleeper.py'))}"
IGNORE_SIGTERM = f"{PYTHON} {shlex.quote(str(PROJECT_ROOT / 'examples' / 'ignore_sigterm.py'))}"
INVENTORY = "node-a:h100-80gb:8,node-b:h100-80gb:8"

# A rank that listens on a TCP port (MASTER_PORT on rank 0, a free port elsewhere) until
# it is told to stop; with --escape it first forks a child that starts its own session,
# keeps listening on another port and outlives the rank.
LISTENER = textwrap.dedent(
    """
    import os, signal, socket, sys, time

    def listen(port):
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.bind(("127.0.0.1", port))
        server.listen()
        return server

    if "--escape" in sys.argv and os.fork() == 0:
        os.setsid()
        escaped = listen(0)
        print("escaped child", os.getpid(), "port", escaped.getsockname()[1], flush=True)
        time.sleep(120)
        os._exit(0)
    rank = int(os.environ["RANK"])
    server = listen(int(os.environ["MASTER_PORT"]) if rank == 0 else 0)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("listening", server.getsockname()[1], flush=True)
    time.sleep(120)
    """
)


def gang_spec(
    job_id: int,
    command: str,
    *,
    ranks: int = 4,
    attempt: int = 1,
    env: Mapping[str, str] | None = None,
) -> GangSpec:
    """A gang spreading `ranks` ranks over node-a then node-b, half on each."""
    per_node = (ranks + 1) // 2
    placements = tuple(
        RankPlacement(
            rank=rank, node="node-a" if rank < per_node else "node-b", local_rank=rank % per_node
        )
        for rank in range(ranks)
    )
    return GangSpec(
        job_id=job_id,
        attempt=attempt,
        command=command,
        ranks=placements,
        gpus_per_rank=1,
        grace_seconds=10.0,
        priority_class="ai-batch-preemptible",
        env=dict(env or {"QM_JOB_ID": str(job_id), "QM_ATTEMPT": str(attempt)}),
        team="vision",
        flavor="h100-80gb",
    )


def wait_for_log(
    runtime: LocalRuntime, gang: GangId, ranks: int, text: bytes, count: int = 1
) -> None:
    wait_until(
        lambda: all(runtime.read_log(gang, rank).count(text) >= count for rank in range(ranks)),
        what=f"{text!r} x{count} in every rank log",
        explain=lambda: describe_ranks(runtime, gang, ranks),
    )


def describe_ranks(runtime: LocalRuntime, gang: GangId, ranks: int) -> str:
    """Each rank's records, log and live processes, for a failure to explain itself."""
    lines = []
    for rank in range(ranks):
        rank_dir = runtime.gang_dir(gang) / str(rank)
        records = sorted(path.name for path in rank_dir.iterdir()) if rank_dir.is_dir() else []
        lines.append(f"rank {rank}: records {records}, log {runtime.read_log(gang, rank)!r}")
        started = read_record(rank_dir / STARTED_FILE)
        if started is not None:
            lines.append(f"  started {started}")
            lines.extend(
                f"  group member {member} {processes.command_line(member.pid)!r} "
                f"{_signal_masks(member.pid)}"
                for member in processes.live_processes()
                if member.pgid == int(started["pgid"])
            )
    return "\n".join(lines)


def _signal_masks(pid: int) -> str:
    """The process's blocked, ignored, caught and pending signal masks, which psutil does
    not expose: the kernel's status file is the only place that tells them."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "(gone)"
    masks = ("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
    return " ".join(
        line.replace("\t", "") for line in status.splitlines() if line.startswith(masks)
    )


def wait_exited(runtime: LocalRuntime, gang: GangId) -> list[RankObservation]:
    wait_until(
        lambda: all(o.phase == "exited" for o in runtime.observe(gang)), what="every rank to exit"
    )
    return runtime.observe(gang)


@pytest.fixture
def runtime(runner_tmp_path: Path, runner_account: RunnerAccount) -> Iterator[LocalRuntime]:
    local = LocalRuntime(
        runner_tmp_path / "runs", parse_inventory(INVENTORY), runner=runner_account
    )
    yield local
    for gang in {GangId(o.job_id, o.attempt) for o in local.observe()}:
        local.kill(gang)

        def gang_is_gone(gang: GangId = gang) -> bool:
            return not local.gang_processes(gang)

        wait_until(gang_is_gone, what="teardown")


def test_launch_runs_every_rank_of_a_four_rank_gang(runtime: LocalRuntime) -> None:
    spec = gang_spec(1, 'echo "hello from rank $RANK"')
    runtime.launch(spec)
    observations = wait_exited(runtime, spec.gang)

    assert [o.rank for o in observations] == [0, 1, 2, 3]
    assert [o.node for o in observations] == ["node-a", "node-a", "node-b", "node-b"]
    assert [o.exit_code for o in observations] == [0, 0, 0, 0]
    for o in observations:
        assert o.handle.isdigit()
        assert o.started_at is not None and o.exited_at is not None
        assert o.started_at <= o.exited_at
        assert o.signal_sent_at is None
        assert runtime.read_log(spec.gang, o.rank) == f"hello from rank {o.rank}\n".encode()
    assert len({o.handle for o in observations}) == 4


def test_every_rank_sees_rendezvous_and_trap_environment(
    runtime: LocalRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert runtime.runner is not None
    # The control plane's own secrets must not reach workloads; basics and NCCL tuning do.
    monkeypatch.setenv("DATABASE_URL", "postgres://qm:secret@db/qm")
    monkeypatch.setenv("SECRET_KEY", "not-for-workloads")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("PYTHONPATH", "/control/plane/code")
    checkpoints = str(runtime.root.parent / "checkpoints" / "job-2")
    env = {"QM_JOB_ID": "2", "QM_CHECKPOINT_DIR": checkpoints, "USER_FLAG": "on", "RANK": "99"}
    spec = gang_spec(2, "env; echo uid=$(id -u) gid=$(id -g) groups=$(id -G) cwd=$(pwd)", env=env)
    runtime.launch(spec)
    wait_exited(runtime, spec.gang)

    gang_record = read_record(runtime.gang_dir(spec.gang) / GANG_FILE)
    assert gang_record is not None
    master_ports = set()
    for placement in spec.ranks:
        lines = runtime.read_log(spec.gang, placement.rank).decode().splitlines()
        seen = dict(line.split("=", 1) for line in lines if "=" in line)
        # The runtime owns RANK: the spec's RANK=99 must not win.
        assert seen["RANK"] == str(placement.rank)
        assert seen["WORLD_SIZE"] == "4"
        assert seen["LOCAL_RANK"] == str(placement.local_rank)
        assert seen["QM_NODE"] == placement.node
        assert seen["MASTER_ADDR"] == "127.0.0.1"
        assert seen["OMP_NUM_THREADS"] == "1"
        assert seen["PYTHONUNBUFFERED"] == "1"
        assert seen["QM_JOB_ID"] == "2"
        assert seen["QM_CHECKPOINT_DIR"] == checkpoints
        assert seen["USER_FLAG"] == "on"
        rank_dir = runtime.gang_dir(spec.gang) / str(placement.rank)
        assert seen["QM_RANK_DIR"] == str(rank_dir)
        assert seen["NCCL_DEBUG"] == "WARN"
        # The rank's own user and folder, not the control plane's.
        assert seen["HOME"] == seen["TMPDIR"] == str(rank_dir / "work")
        assert seen["USER"] == seen["LOGNAME"] == runtime.runner.name
        assert seen["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
        assert "DATABASE_URL" not in seen and "SECRET_KEY" not in seen
        assert "PYTHONPATH" not in seen
        gid = runtime.runner.job_gid(2)
        # The job's own user as well as its own group.
        assert f"uid={gid} gid={gid} groups={gid} cwd={rank_dir / 'work'}" in lines
        master_ports.add(int(seen["MASTER_PORT"]))
    assert master_ports == {gang_record["master_port"]}


def test_exit_codes_are_recorded_including_death_by_signal(runtime: LocalRuntime) -> None:
    command = (
        'case "$RANK" in '
        "0) exit 0 ;; "
        "1) exit 3 ;; "
        f"2) {SLEEPER} --seconds 0 --exit-code 7 ;; "
        "3) kill -USR1 $$ ;; "
        "esac"
    )
    spec = gang_spec(3, command)
    runtime.launch(spec)
    observations = wait_exited(runtime, spec.gang)

    assert [o.exit_code for o in observations] == [0, 3, 7, 128 + signal.SIGUSR1]


def test_signal_reaches_every_rank_and_the_children_in_its_process_group(
    runtime: LocalRuntime,
) -> None:
    # Each rank runs a background child and a foreground sleeper, both in its group.
    spec = gang_spec(4, f"{SLEEPER} --seconds 60 & {SLEEPER} --seconds 60; wait")
    runtime.launch(spec)
    wait_for_log(runtime, spec.gang, 4, b"ready", count=2)
    assert {o.phase for o in runtime.observe(spec.gang)} == {"running"}

    runtime.signal(spec.gang, grace_seconds=10.0)
    wait_for_log(runtime, spec.gang, 4, b"sigterm_at=", count=2)
    observations = wait_exited(runtime, spec.gang)

    assert [o.exit_code for o in observations] == [0, 0, 0, 0]
    assert all(o.signal_sent_at is not None for o in observations)
    wait_until(lambda: not runtime.gang_processes(spec.gang), what="the children to exit")
    assert runtime.find_orphans(spec.gang) == []


@pytest.mark.parametrize("ranks", [4, 16])
def test_signal_latency_from_call_to_each_rank_handler(runtime: LocalRuntime, ranks: int) -> None:
    spec = gang_spec(5, f"exec {SLEEPER} --seconds 60", ranks=ranks)
    runtime.launch(spec)
    wait_for_log(runtime, spec.gang, ranks, b"ready")

    called_at = time.time()
    runtime.signal(spec.gang, grace_seconds=10.0)
    returned_at = time.time()
    wait_for_log(runtime, spec.gang, ranks, b"sigterm_at=")
    observations = wait_exited(runtime, spec.gang)

    latencies = []
    for rank in range(ranks):
        log = runtime.read_log(spec.gang, rank).decode()
        handled_at = float(log.split("sigterm_at=")[1].split()[0])
        latencies.append(handled_at - called_at)
    print(
        f"\nsignal() took {returned_at - called_at:.6f} s for {ranks} ranks; "
        f"call -> handler per rank: {[f'{latency:.4f}' for latency in latencies]} s, "
        f"max {max(latencies):.6f} s"
    )
    sent = [o.signal_sent_at for o in observations]
    assert all(at is not None and called_at <= at <= returned_at for at in sent)
    assert all(latency > 0 for latency in latencies)
    assert [o.exit_code for o in observations] == [0] * ranks


def test_sigterm_ignoring_workload_survives_signal_and_dies_on_kill(
    runtime: LocalRuntime,
) -> None:
    spec = gang_spec(6, IGNORE_SIGTERM, ranks=2)
    runtime.launch(spec)
    wait_for_log(runtime, spec.gang, 2, b"ready")

    runtime.signal(spec.gang, grace_seconds=0.5)
    wait_for_log(runtime, spec.gang, 2, b"sigterm ignored")
    time.sleep(0.5)
    observations = runtime.observe(spec.gang)
    assert [o.phase for o in observations] == ["terminating", "terminating"]
    assert [o.exit_code for o in observations] == [None, None]

    runtime.kill(spec.gang)
    observations = wait_exited(runtime, spec.gang)
    assert [o.exit_code for o in observations] == [137, 137]
    runtime.kill(spec.gang)
    assert [o.exit_code for o in runtime.observe(spec.gang)] == [137, 137]
    assert runtime.find_orphans(spec.gang) == []


def test_a_fresh_runtime_over_the_same_root_sees_the_same_state(
    runtime: LocalRuntime,
) -> None:
    assert runtime.runner is not None
    # Launch from another process, then SIGKILL that process's whole group, as when a
    # Celery worker dies: the ranks must survive it, and their exits still be recorded.
    launch_script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        sys.path.insert(0, {str(PROJECT_ROOT)!r})
        from preemption.runtimes import GangSpec, LocalRuntime, RankPlacement, parse_inventory
        from preemption.runtimes.runner import find_runner
        runtime = LocalRuntime(
            Path({str(runtime.root)!r}), parse_inventory({INVENTORY!r}),
            runner=find_runner({runtime.runner.name!r}).account,
        )
        runtime.launch(GangSpec(
            job_id=7, attempt=2, command={f"exec {SLEEPER} --seconds 60 --term-exit-code 5"!r},
            ranks=tuple(RankPlacement(rank, "node-a", rank) for rank in range(3)),
            gpus_per_rank=1, grace_seconds=5.0, priority_class="batch", env={{}},
        ))
        print("launched", flush=True)
        time.sleep(60)
        """
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", launch_script], stdout=subprocess.PIPE, start_new_session=True
    )
    assert worker.stdout is not None
    assert worker.stdout.readline() == b"launched\n"
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    worker.stdout.close()

    gang = GangId(7, 2)
    first = LocalRuntime(runtime.root, parse_inventory(INVENTORY), runner=runtime.runner)
    wait_for_log(first, gang, 3, b"ready")
    assert [o.phase for o in first.observe(gang)] == ["running"] * 3
    assert first.observe() == first.observe(gang)

    first.signal(gang, grace_seconds=5.0)
    second = LocalRuntime(runtime.root, parse_inventory(INVENTORY), runner=runtime.runner)
    observations = wait_exited(second, gang)
    assert [o.exit_code for o in observations] == [5, 5, 5]
    assert observations == first.observe(gang)
    assert second.read_log(gang, 1) == first.read_log(gang, 1)
    assert all(o.signal_sent_at is not None for o in observations)


def test_launch_is_idempotent_even_when_two_launches_race(runtime: LocalRuntime) -> None:
    spec = gang_spec(8, f"exec {SLEEPER} --seconds 60")
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(runtime.launch, [spec, spec]))
    wait_for_log(runtime, spec.gang, 4, b"ready")
    handles = [o.handle for o in runtime.observe(spec.gang)]
    gang_record = read_record(runtime.gang_dir(spec.gang) / GANG_FILE)

    runtime.launch(spec)
    time.sleep(0.5)
    assert [o.handle for o in runtime.observe(spec.gang)] == handles
    assert read_record(runtime.gang_dir(spec.gang) / GANG_FILE) == gang_record
    for rank in range(4):
        assert runtime.read_log(spec.gang, rank).count(b"ready") == 1
    # Exactly one sleeper per rank runs: one process in each rank's group.
    assert sorted(p.rank for p in runtime.gang_processes(spec.gang)) == [0, 1, 2, 3]


def test_signal_is_idempotent(runtime: LocalRuntime) -> None:
    spec = gang_spec(9, IGNORE_SIGTERM, ranks=3)
    runtime.launch(spec)
    wait_for_log(runtime, spec.gang, 3, b"ready")

    runtime.signal(spec.gang, grace_seconds=30.0)
    wait_for_log(runtime, spec.gang, 3, b"sigterm ignored")
    first_sent = [o.signal_sent_at for o in runtime.observe(spec.gang)]
    runtime.signal(spec.gang, grace_seconds=30.0)
    LocalRuntime(runtime.root, runtime.nodes(), runner=runtime.runner).signal(
        spec.gang, grace_seconds=30.0
    )
    time.sleep(0.5)

    assert [o.signal_sent_at for o in runtime.observe(spec.gang)] == first_sent
    for rank in range(3):
        assert runtime.read_log(spec.gang, rank).count(b"sigterm ignored") == 1


def test_a_gang_signalled_right_after_launch_still_ends(runtime: LocalRuntime) -> None:
    # The signal may land before some rank has started, or before its handler is in
    # place; each rank must still end, by the signal or by its handler.
    spec = gang_spec(10, f"exec {SLEEPER} --seconds 60")
    runtime.launch(spec)
    runtime.signal(spec.gang, grace_seconds=5.0)
    observations = wait_exited(runtime, spec.gang)
    assert {o.exit_code for o in observations} <= {0, 128 + signal.SIGTERM}


def test_logs_are_readable_with_offsets(runtime: LocalRuntime) -> None:
    spec = gang_spec(11, "printf 'abcdefghij'; echo \" rank $RANK\" >&2", ranks=2)
    runtime.launch(spec)
    wait_exited(runtime, spec.gang)

    assert runtime.read_log(spec.gang, 1) == b"abcdefghij rank 1\n"
    assert runtime.read_log(spec.gang, 0, offset=3, limit=4) == b"defg"
    assert runtime.read_log(spec.gang, 0, offset=10) == b" rank 0\n"
    assert runtime.read_log(spec.gang, 0, offset=1000) == b""
    with pytest.raises(RuntimePermanentError):
        runtime.read_log(spec.gang, 5)


def test_trap_events_are_read_back_from_a_rank_log(runtime: LocalRuntime) -> None:
    command = (
        'printf \'QM_EVENT {"event": "signal_received", "rank": %s, "at": 1.5}\\n\' "$RANK"; '
        "echo 'QM_EVENT {not json'; "
        'printf \'noise QM_EVENT {"event": "exiting", "code": 0}\\n\''
    )
    spec = gang_spec(12, command, ranks=2)
    runtime.launch(spec)
    wait_exited(runtime, spec.gang)

    events = list(iter_trap_events(runtime.read_log(spec.gang, 1)))
    assert events == [
        {"event": "signal_received", "rank": 1, "at": 1.5},
        {"event": "exiting", "code": 0},
    ]


def test_ports_are_released_after_exit(runtime: LocalRuntime) -> None:
    listener = runtime.root.parent / "listener.py"
    listener.write_text(LISTENER)
    spec = gang_spec(13, f"exec {PYTHON} {shlex.quote(str(listener))}", ranks=3)
    runtime.launch(spec)
    wait_for_log(runtime, spec.gang, 3, b"listening")

    gang_record = read_record(runtime.gang_dir(spec.gang) / GANG_FILE)
    assert gang_record is not None
    held = runtime.released_ports([spec.gang])[spec.gang]
    assert gang_record["master_port"] in held
    assert len(held) == 3

    runtime.signal(spec.gang, grace_seconds=5.0)
    wait_exited(runtime, spec.gang)
    assert runtime.released_ports([spec.gang])[spec.gang] == []
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", gang_record["master_port"]))


def test_orphan_scan_finds_a_child_that_escaped_its_rank(runtime: LocalRuntime) -> None:
    listener = runtime.root.parent / "listener.py"
    listener.write_text(LISTENER)
    spec = gang_spec(14, f"exec {PYTHON} {shlex.quote(str(listener))} --escape", ranks=2)
    runtime.launch(spec)
    wait_for_log(runtime, spec.gang, 2, b"listening")
    wait_for_log(runtime, spec.gang, 2, b"escaped child")
    # While the ranks run, their processes are not orphans.
    assert runtime.find_orphans(spec.gang) == []

    runtime.signal(spec.gang, grace_seconds=5.0)
    assert [o.exit_code for o in wait_exited(runtime, spec.gang)] == [0, 0]
    orphans = runtime.find_orphans(spec.gang)
    assert sorted(o.rank for o in orphans) == [0, 1]
    ranks_pgids = {int(o.handle) for o in runtime.observe(spec.gang)}
    assert all(o.pgid not in ranks_pgids and o.sid == o.pid for o in orphans)
    assert len(runtime.released_ports([spec.gang])[spec.gang]) == 2

    runtime.kill(spec.gang)
    wait_until(lambda: not runtime.find_orphans(spec.gang), what="the orphans to die")
    assert runtime.released_ports([spec.gang])[spec.gang] == []
    assert [o.exit_code for o in runtime.observe(spec.gang)] == [0, 0]


def test_orphan_scan_finds_a_child_left_in_the_rank_group(runtime: LocalRuntime) -> None:
    spec = gang_spec(15, "sleep 60 & echo child $!", ranks=2)
    runtime.launch(spec)
    wait_exited(runtime, spec.gang)
    orphans = runtime.find_orphans(spec.gang)
    children = {int(runtime.read_log(spec.gang, rank).split()[1]) for rank in range(2)}
    assert {o.pid for o in orphans} == children
    runtime.kill(spec.gang)
    wait_until(lambda: not runtime.find_orphans(spec.gang), what="the orphans to die")


def test_the_process_scan_reads_no_environment_of_a_process_older_than_the_gang(
    runtime: LocalRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scan runs for every finished gang, over every process of the machine: only
    # processes started after the gang's keepers can be its own.
    older = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.05)
        spec = gang_spec(25, f"exec {SLEEPER} --seconds 60", ranks=2)
        runtime.launch(spec)
        wait_for_log(runtime, spec.gang, 2, b"ready")
        read: list[int] = []
        real = processes.environ_value

        def counted(pid: int, name: str) -> str | None:
            read.append(pid)
            return real(pid, name)

        monkeypatch.setattr(processes, "environ_value", counted)
        found = runtime.gang_processes(spec.gang)
        assert sorted(process.rank for process in found) == [0, 1]
        assert older.pid not in read
        assert os.getpid() not in read and 1 not in read
    finally:
        older.kill()
        older.wait()


def test_a_rank_whose_keeper_died_is_lost(runtime: LocalRuntime) -> None:
    spec = gang_spec(16, f"exec {SLEEPER} --seconds 60", ranks=2)
    runtime.launch(spec)
    wait_for_log(runtime, spec.gang, 2, b"ready")
    rank_dir = runtime.gang_dir(spec.gang) / "1"
    keeper = read_record(rank_dir / KEEPER_FILE)
    started = read_record(rank_dir / STARTED_FILE)
    assert keeper is not None and started is not None

    os.kill(keeper["pid"], signal.SIGKILL)
    time.sleep(0.2)
    # The rank runs on without its keeper, so it is not lost yet.
    assert [o.phase for o in runtime.observe(spec.gang)] == ["running", "running"]
    os.killpg(started["pgid"], signal.SIGKILL)
    wait_until(lambda: runtime.observe(spec.gang)[1].phase == "lost", what="rank 1 to be lost")
    lost = runtime.observe(spec.gang)[1]
    assert lost.exit_code is None and lost.exited_at is None


def test_forget_drops_a_finished_gang_but_keeps_its_logs(runtime: LocalRuntime) -> None:
    running = gang_spec(17, f"exec {SLEEPER} --seconds 60", ranks=1)
    runtime.launch(running)
    wait_for_log(runtime, running.gang, 1, b"ready")
    with pytest.raises(RuntimePermanentError):
        runtime.forget(running.gang)

    spec = gang_spec(18, "echo done", ranks=2)
    runtime.launch(spec)
    wait_exited(runtime, spec.gang)
    runtime.forget(spec.gang)
    runtime.forget(spec.gang)

    assert runtime.observe(spec.gang) == []
    assert {o.job_id for o in runtime.observe()} == {17}
    assert runtime.read_log(spec.gang, 1) == b"done\n"
    runtime.launch(spec)
    time.sleep(0.3)
    assert runtime.observe(spec.gang) == []
    assert runtime.read_log(spec.gang, 1) == b"done\n"


def test_the_gang_index_lists_each_live_gang_with_its_port_and_is_built_for_an_old_root(
    runtime: LocalRuntime,
) -> None:
    running = gang_spec(21, f"exec {SLEEPER} --seconds 60", ranks=1)
    done = gang_spec(22, "true", ranks=1)
    runtime.launch(running)
    runtime.launch(done)
    wait_exited(runtime, done.gang)
    ports = {}
    for gang in (running.gang, done.gang):
        record = read_record(runtime.gang_dir(gang) / GANG_FILE)
        assert record is not None
        ports[gang] = record["master_port"]
    assert ports[running.gang] != ports[done.gang]
    index = runtime.root / GANG_INDEX

    def listed() -> list[str]:
        return sorted(name for name in os.listdir(index) if not name.startswith("."))

    assert listed() == sorted(f"{g.job_id}.1.{port}" for g, port in ports.items())
    assert index.stat().st_mode & 0o777 == 0o700  # no rank may list the jobs

    runtime.forget(done.gang)
    assert listed() == [f"21.1.{ports[running.gang]}"]
    assert {o.job_id for o in runtime.observe()} == {21}

    # A root written before the index: a fresh runtime walks the job folders once.
    shutil.rmtree(index)
    fresh = LocalRuntime(runtime.root, parse_inventory(INVENTORY), runner=runtime.runner)
    assert [(o.job_id, o.phase) for o in fresh.observe()] == [(21, "running")]
    assert listed() == [f"21.1.{ports[running.gang]}"]
    assert sorted(p.name for p in runtime.root.iterdir()) == sorted(
        ["21", "22", GANG_INDEX, GPU_LOCK_FOLDER]
    )

    # A launch never picks a port the index promised to another gang, even when the
    # index holds all but one of the ports it picks from at random.
    floor = ephemeral_port_floor()
    for port in range(MASTER_PORT_FLOOR, floor):
        if port != floor - 1:
            (index / f"9{port}.1.{port}").touch()
    promised = set(range(MASTER_PORT_FLOOR, floor - 1)) | {ports[running.gang]}
    spec = gang_spec(23, "true", ranks=1)
    fresh.launch(spec)
    record = read_record(fresh.gang_dir(spec.gang) / GANG_FILE)
    assert record is not None
    assert record["master_port"] not in promised
    assert f"23.1.{record['master_port']}" in listed()
    assert [o.job_id for o in fresh.observe()] == [21, 23]


def test_launch_rejects_specs_it_can_never_run(runtime: LocalRuntime) -> None:
    unknown_node = GangSpec(
        job_id=19,
        attempt=1,
        command="true",
        ranks=(RankPlacement(0, "node-z", 0),),
        gpus_per_rank=1,
        grace_seconds=1.0,
        priority_class="batch",
        env={},
    )
    with pytest.raises(RuntimePermanentError, match="node-z"):
        runtime.launch(unknown_node)
    gap = GangSpec(
        job_id=19,
        attempt=1,
        command="true",
        ranks=(RankPlacement(0, "node-a", 0), RankPlacement(2, "node-a", 1)),
        gpus_per_rank=1,
        grace_seconds=1.0,
        priority_class="batch",
        env={},
    )
    with pytest.raises(RuntimePermanentError, match=r"0\.\.1"):
        runtime.launch(gap)
    assert runtime.observe() == []
    assert runtime.nodes() == parse_inventory(INVENTORY)


def test_one_call_tells_the_ports_of_many_gangs_apart(runtime: LocalRuntime) -> None:
    """One scan of the process table answers for every gang of the call: the gang
    whose ranks left escaped children behind holds their ports, the other none."""
    listener = runtime.root.parent / "listener.py"
    listener.write_text(LISTENER)
    escaping = gang_spec(15, f"exec {PYTHON} {shlex.quote(str(listener))} --escape", ranks=2)
    clean = gang_spec(16, f"exec {PYTHON} {shlex.quote(str(listener))}", ranks=2)
    for spec in (escaping, clean):
        runtime.launch(spec)
    wait_for_log(runtime, escaping.gang, 2, b"escaped child")
    wait_for_log(runtime, clean.gang, 2, b"listening")
    unknown = GangId(405, 1)
    while_running = runtime.released_ports([escaping.gang, clean.gang, unknown])
    assert len(while_running[escaping.gang]) == 4 and len(while_running[clean.gang]) == 2
    assert not set(while_running[escaping.gang]) & set(while_running[clean.gang])
    assert while_running[unknown] == []

    for spec in (escaping, clean):
        runtime.signal(spec.gang, grace_seconds=5.0)
        wait_exited(runtime, spec.gang)
    after = runtime.released_ports([escaping.gang, clean.gang])
    assert len(after[escaping.gang]) == 2 and after[clean.gang] == []
    runtime.kill(escaping.gang)
    wait_until(lambda: not runtime.find_orphans(escaping.gang), what="the orphans to die")
    assert runtime.released_ports([escaping.gang, clean.gang]) == {
        escaping.gang: [],
        clean.gang: [],
    }


def test_a_reused_process_group_belongs_to_the_latest_rank_that_started_before_it() -> None:
    earlier, later = GangId(1, 1), GangId(2, 1)
    groups = {500: [(100.0, earlier, 0), (200.0, later, 3)]}

    def process(created_at: float, pgid: int = 500) -> ProcessInfo:
        return ProcessInfo(pid=9, pgid=pgid, sid=1, created_at=created_at)

    # Both recorded leaders have exited: the members left belong by their start.
    assert _group_owner(groups, process(150.0), {}) == (earlier, 0)
    assert _group_owner(groups, process(250.0), {}) == (later, 3)
    assert _group_owner(groups, process(50.0), {}) is None
    assert _group_owner(groups, process(250.0, pgid=501), {}) is None
    # A live leader names the group's owner: the rank that recorded it, or nobody.
    assert _group_owner(groups, process(250.0), {500: 100.5}) == (earlier, 0)
    assert _group_owner(groups, process(250.0), {500: 200.0}) == (later, 3)
    assert _group_owner(groups, process(950.0), {500: 900.0}) is None


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    """A process that leads a group of its own, with a child in it, and is no rank's."""
    process = subprocess.Popen(["/bin/sh", "-c", "sleep 60 & wait"], start_new_session=True)
    try:
        wait_until(
            lambda: len(psutil.Process(process.pid).children()) == 1, what="the stranger's child"
        )
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_a_group_number_reused_by_a_stranger_is_never_signalled_or_taken_for_the_gang(
    runtime: LocalRuntime, stranger: subprocess.Popen[bytes]
) -> None:
    """Rank 0 exited and rank 1 was lost (its keeper and group killed), and the number
    each one's group had now leads a stranger's group, as after the pid space wrapped. Stopping
    or killing the gang, or scanning it for leftovers, must not reach the stranger."""
    spec = gang_spec(19, f"exec {SLEEPER} --seconds 60", ranks=2)
    runtime.launch(spec)
    wait_for_log(runtime, spec.gang, 2, b"ready")
    gang_dir = runtime.gang_dir(spec.gang)
    os.killpg(int(_started(gang_dir, 0)["pgid"]), signal.SIGTERM)
    lost = _started(gang_dir, 1)
    os.kill(int(read_record(gang_dir / "1" / KEEPER_FILE)["pid"]), signal.SIGKILL)
    os.killpg(int(lost["pgid"]), signal.SIGKILL)
    wait_until(
        lambda: [o.phase for o in runtime.observe(spec.gang)] == ["exited", "lost"],
        what="rank 0 to exit and rank 1 to be lost",
    )
    leader = psutil.Process(stranger.pid)
    stranger_members = {stranger.pid, *(child.pid for child in leader.children())}
    for rank in (0, 1):
        # The ranks ran under the stranger's number until ten minutes before it started.
        record = _started(gang_dir, rank)
        write_record(
            gang_dir / str(rank) / STARTED_FILE,
            {
                **record,
                "pid": stranger.pid,
                "pgid": stranger.pid,
                "created_at": leader.create_time() - 600.0,
            },
        )

    assert runtime.gang_processes(spec.gang) == []
    assert runtime.find_orphans(spec.gang) == []
    runtime.signal(spec.gang, grace_seconds=1.0)
    runtime.notice(spec.gang, "SIGUSR2")
    runtime.kill(spec.gang)
    time.sleep(0.5)
    assert all(psutil.pid_exists(pid) for pid in stranger_members)
    assert stranger.poll() is None
    assert [o.phase for o in runtime.observe(spec.gang)] == ["exited", "lost"]


def _started(gang_dir: Path, rank: int) -> dict[str, Any]:
    record = read_record(gang_dir / str(rank) / STARTED_FILE)
    assert record is not None, f"rank {rank} has no start record"
    return record


def test_signal_and_kill_of_an_unknown_gang_do_nothing(runtime: LocalRuntime) -> None:
    gang = GangId(404, 1)
    runtime.signal(gang, grace_seconds=1.0)
    runtime.kill(gang)
    assert runtime.observe(gang) == []
    assert runtime.released_ports([gang])[gang] == []
    assert runtime.find_orphans(gang) == []


def test_a_job_numbered_like_an_old_one_is_never_taken_for_its_gang(
    runtime: LocalRuntime,
) -> None:
    """The runs folder outlived the database: the old gang's records stay its own."""
    old = gang_spec(
        18,
        "exec true",
        ranks=2,
        env={"QM_CHECKPOINT_DIR": str(runtime.root.parent / "checkpoints" / "job-18-aa")},
    )
    runtime.launch(old)
    wait_exited(runtime, old.gang)
    new = gang_spec(
        18,
        "exec true",
        ranks=2,
        env={"QM_CHECKPOINT_DIR": str(runtime.root.parent / "checkpoints" / "job-18-bb")},
    )
    with pytest.raises(RuntimePermanentError, match="checkpoint folder"):
        runtime.launch(new)
    # The same gang launched again is still the same gang, and starts nothing.
    runtime.launch(old)
    assert [o.exit_code for o in runtime.observe(old.gang)] == [0, 0]


def test_relaunching_a_gang_id_with_another_command_is_refused(runtime: LocalRuntime) -> None:
    first = gang_spec(20, "echo first", ranks=1)
    runtime.launch(first)
    wait_exited(runtime, first.gang)
    with pytest.raises(RuntimePermanentError, match="another command"):
        runtime.launch(gang_spec(20, "echo second", ranks=1))
    runtime.launch(first)
    assert runtime.read_log(first.gang, 0) == b"first\n"
    assert [o.exit_code for o in runtime.observe(first.gang)] == [0]


def test_read_log_of_a_rank_not_yet_started_is_empty(runtime: LocalRuntime) -> None:
    spec = gang_spec(21, "echo hi", ranks=2)
    runtime.launch(spec)
    wait_exited(runtime, spec.gang)
    # A rank that has not written yet, or whose folder is not even claimed yet (as in
    # the middle of a launch), reads as an empty log.
    (runtime.gang_dir(spec.gang) / "0" / "rank.log").unlink()
    assert runtime.read_log(spec.gang, 0) == b""
    shutil.rmtree(runtime.gang_dir(spec.gang) / "1")
    assert runtime.read_log(spec.gang, 1) == b""
    with pytest.raises(RuntimePermanentError):
        runtime.read_log(spec.gang, 2)
    with pytest.raises(RuntimePermanentError):
        runtime.read_log(GangId(404, 1), 0)


def test_one_launcher_serves_every_launch_and_a_dead_one_is_replaced(
    runtime: LocalRuntime,
) -> None:
    # Each launch is a fork of this process's launcher, not an interpreter's start-up.
    first = gang_spec(21, "sleep 30", ranks=2)
    runtime.launch(first)
    wait_until(
        lambda: [o.phase for o in runtime.observe(first.gang)] == ["running", "running"],
        what="both ranks to run",
    )
    server = launch_server(runtime.python)
    assert server.process is not None
    launcher = psutil.Process(server.process.pid)
    assert "--serve" in launcher.cmdline()
    # The keepers belong to init, not to the launcher: it never reaps them, and a keeper
    # never holds its pipes.
    for rank in range(2):
        keeper = read_record(runtime.gang_dir(first.gang) / str(rank) / KEEPER_FILE)
        assert keeper is not None
        assert psutil.Process(int(keeper["pid"])).ppid() != launcher.pid
    second = gang_spec(22, "echo second", ranks=2)
    runtime.launch(second)
    assert [o.exit_code for o in wait_exited(runtime, second.gang)] == [0, 0]
    assert server.process is not None and server.process.pid == launcher.pid

    # Killed between two launches: the next launch starts another and runs its gang.
    launcher.kill()
    launcher.wait(timeout=10)
    third = gang_spec(23, "echo third", ranks=2)
    runtime.launch(third)
    assert [o.exit_code for o in wait_exited(runtime, third.gang)] == [0, 0]
    assert server.process is not None and server.process.pid != launcher.pid

    # Its input closed, the launcher exits at once, though the first gang still runs.
    replacement = server.process
    server.stop()
    assert replacement.returncode == 0
    assert {o.phase for o in runtime.observe(first.gang)} == {"running"}


def test_every_rank_exit_is_announced_once_its_record_is_written(runtime: LocalRuntime) -> None:
    stop = threading.Event()
    seen: list[list[str]] = []
    announced: list[int] = []
    spec = gang_spec(24, "exit 3", ranks=2)

    def on_exit(job_ids: list[int]) -> None:
        # What the reconciler would read at this moment.
        seen.append([o.phase for o in runtime.observe(spec.gang)])
        announced.extend(job_ids)

    watcher = threading.Thread(target=runtime.watch_exits, args=(stop, on_exit))
    watcher.start()
    try:
        wait_until((runtime.root / EXITS_FIFO).exists, what="the exits pipe")
        runtime.launch(spec)
        wait_until(lambda: "exited" in (seen[-1] if seen else []), what="an announced exit")
        wait_until(lambda: seen[-1] == ["exited", "exited"], what="both exits announced")
        assert [o.exit_code for o in runtime.observe(spec.gang)] == [3, 3]
        # Each keeper names its job, so the reconciler looks at that job alone.
        assert set(announced) == {24}
    finally:
        stop.set()
        watcher.join(timeout=10)
    assert not watcher.is_alive()


def test_the_exits_pipe_is_refused_when_something_else_sits_at_its_name(
    runtime: LocalRuntime,
) -> None:
    runtime.root.mkdir(parents=True, exist_ok=True)
    planted = runtime.root / EXITS_FIFO
    planted.write_text("not a pipe")
    with pytest.raises(RuntimePermanentError, match="is not this control plane's exits pipe"):
        runtime.watch_exits(threading.Event(), lambda job_ids: None)
    planted.unlink()
    elsewhere = runtime.root.parent / "elsewhere.fifo"
    os.mkfifo(elsewhere)
    elsewhere.chmod(0o666)
    planted.symlink_to(elsewhere)
    # A link is never followed: the pipe it points to is neither opened nor changed.
    with pytest.raises(OSError) as refused:
        runtime.watch_exits(threading.Event(), lambda job_ids: None)
    assert refused.value.errno == errno.ELOOP
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o666


def test_the_launcher_starts_without_loading_the_runtimes() -> None:
    # Every launch starts this interpreter: it loads the records and /proc readers
    # it needs, not the runtimes (nor the trap protocol) the package offers.
    probe = (
        "import sys, preemption.runtimes.launcher; "
        "print(sorted(m for m in sys.modules if m.startswith(('preemption', 'gracetrap'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert loaded == repr(
        [
            "preemption",
            "preemption.runtimes",
            "preemption.runtimes.capped_log",
            "preemption.runtimes.launcher",
            "preemption.runtimes.processes",
            "preemption.runtimes.records",
            "preemption.runtimes.sandbox",
        ]
    )
    assert runtimes_package.LocalRuntime is LocalRuntime
    with pytest.raises(AttributeError, match="no attribute 'Kubelet'"):
        runtimes_package.Kubelet  # noqa: B018
