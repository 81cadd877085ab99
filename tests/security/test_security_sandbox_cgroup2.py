"""The sandbox's cgroup v2 path, on this cgroup v1 machine, as far as it can be taken.

Why not a whole sandboxed gang on v2: this machine mounts every controller on v1
(pids, memory, freezer each a hierarchy of its own) and the unified hierarchy at
/sys/fs/cgroup/unified with no controller at all (cgroup.controllers is empty: a
controller bound to a v1 hierarchy cannot be enabled in v2). `sandbox.support()` so picks
v1 here, and a v2 rank's limits (pids.max, memory.max, memory.swap.max) cannot be written
anywhere on this host, so `sandbox.create` cannot make a v2 gang, nor can the OOM kill
be seen in memory.events. Mounting cgroup2 elsewhere would give the same hierarchy, with
the same missing controllers.

What v2 needs beyond the controllers is here, and tested: the unified hierarchy's
cgroup.procs, cgroup.events and cgroup.kill (Linux 5.14). Two ranks' processes join
their cgroups through `sandbox.join_cgroups` (the first step of `sandbox.enter`) and each
escapes as a hostile rank would: a double fork, `setsid`, exec of `sleep` with an empty
environment. `sandbox.pids` must find every one under its rank; `sandbox.kill` of one
rank must kill all of that rank's and none of the other's (its cgroup.kill), and of the
gang all that is left, at the gang's folder, so that the kernel reports the gang's
cgroup empty (populated 0) and no process of either rank is alive.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from preemption.runtimes import sandbox as sandboxes
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


def unified_mount() -> Path:
    """Where the unified hierarchy is mounted (/sys/fs/cgroup/unified here, beside the
    v1 hierarchies; /sys/fs/cgroup on a host with v2 alone)."""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2] == "cgroup2":
            return Path(fields[1])
    raise AssertionError("no cgroup2 hierarchy is mounted")


UNIFIED = unified_mount()

ESCAPE = textwrap.dedent(
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


def own_unified_cgroup() -> Path:
    """This process's cgroup in the unified hierarchy mounted at UNIFIED."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return UNIFIED / line[3:].lstrip("/")
    raise AssertionError("this process is in no unified cgroup")


@pytest.fixture
def gang_sandbox() -> Iterator[dict[str, Any]]:
    """A gang's sandbox record over a gang folder of two ranks in the unified hierarchy."""
    assert (UNIFIED / "cgroup.procs").exists(), f"no cgroup2 hierarchy at {UNIFIED}"
    folder = own_unified_cgroup() / f"quartermaster-test-{uuid.uuid4().hex[:10]}"
    for path in (folder, folder / "0", folder / "1"):
        path.mkdir()
    assert (folder / "cgroup.kill").exists(), "this kernel has no cgroup.kill (Linux 5.14)"
    try:
        yield {"version": 2, "cgroups": {"unified": str(folder)}}
    finally:
        with_processes = sandboxes.pids({"cgroups": {"unified": str(folder)}})
        for pid in with_processes:
            os.kill(pid, 9)
        wait_until(lambda: not sandboxes.pids({"cgroups": {"unified": str(folder)}}), "empty")
        for path in (folder / "0", folder / "1", folder):
            path.rmdir()


def start_rank(sandbox: dict[str, Any], rank: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", ESCAPE],
        stdout=subprocess.PIPE,
        preexec_fn=lambda: sandboxes.join_cgroups(sandbox, rank),
    )


def escapees(members: dict[int, int], rank: int) -> list[int]:
    found = []
    for pid, member_rank in members.items():
        try:
            if member_rank == rank and psutil.Process(pid).cmdline() == ["sleep", "300"]:
                found.append(pid)
        except psutil.NoSuchProcess:
            pass
    return found


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_every_process_of_a_rank_is_in_its_v2_cgroup_and_cgroup_kill_leaves_none(
    gang_sandbox: dict[str, Any],
) -> None:
    ranks = [start_rank(gang_sandbox, rank) for rank in (0, 1)]
    try:
        for process in ranks:
            assert process.stdout is not None
            assert process.stdout.readline() == b"escaped\n"
        wait_until(
            lambda: all(escapees(sandboxes.pids(gang_sandbox), rank) for rank in (0, 1)),
            "each rank's escapee to execute sleep",
        )
        members = sandboxes.pids(gang_sandbox)
        [escapee_0] = escapees(members, 0)
        [escapee_1] = escapees(members, 1)
        # Each escapee left its rank's session and carries no environment, yet its
        # rank's cgroup holds it, as it holds the rank's first process.
        assert psutil.Process(escapee_1).environ() == {}
        assert os.getsid(escapee_1) != os.getsid(ranks[1].pid)
        assert members[ranks[0].pid] == 0 and members[ranks[1].pid] == 1

        sandboxes.kill(gang_sandbox, 1)

        assert ranks[1].wait(timeout=5) == -9
        wait_until(lambda: not alive(escapee_1), "rank 1's escapee to die")
        assert set(sandboxes.pids(gang_sandbox, 1)) == set()
        # The other rank's processes are untouched.
        assert alive(escapee_0) and ranks[0].poll() is None

        sandboxes.kill(gang_sandbox)

        assert ranks[0].wait(timeout=5) == -9
        wait_until(lambda: not alive(escapee_0), "rank 0's escapee to die")
        folder = Path(gang_sandbox["cgroups"]["unified"])
        wait_until(
            lambda: "populated 0" in (folder / "cgroup.events").read_text(),
            "the gang's cgroup to be empty",
        )
        assert sandboxes.pids(gang_sandbox) == {}
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.wait()
            if process.stdout is not None:
                process.stdout.close()
