"""The cadence hint on the local runtime: the control plane (root) writes each gang's
file, its ranks (the runner user, the job's group) read it, and nothing a job plants
in the gang's path turns that write to another job's files."""

from __future__ import annotations

import dataclasses
import os
import shlex
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from preemption.runtimes import GangId, LocalRuntime, RuntimePermanentError
from preemption.runtimes.local.folders import MTBP_FILE
from preemption.runtimes.runner import RunnerAccount
from tests.preemption.runtimes.test_runtime_local import (
    gang_spec,
    runtime,  # noqa: F401 - the fixture
    wait_for_log,
    wait_until,
)

pytestmark = pytest.mark.timeout(90)

# Prints the hint file each time it changes, and whether it may read another path
# (argv[1]) or plant a link beside its own hint; runs until signalled.
READER = textwrap.dedent(
    """
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    hint = os.environ["QM_PREEMPTION_MTBP_FILE"]
    for name, probe in (
        ("other", lambda: open(sys.argv[1]).read()),
        ("plant", lambda: os.symlink(sys.argv[1], hint + ".planted")),
    ):
        try:
            probe()
            print(name, "allowed", flush=True)
        except OSError as error:
            print(name, "refused", error.errno, flush=True)
    seen = None
    while True:
        text = open(hint).read().strip()
        if text != seen:
            print("hint", text, flush=True)
            seen = text
        time.sleep(0.05)
    """
)


def reader(other: Path) -> str:
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(READER)} {shlex.quote(str(other))}"


def hint_path(local: LocalRuntime, gang: GangId) -> Path:
    return local.gang_dir(gang) / MTBP_FILE


def launch(local: LocalRuntime, job_id: int, command: str, mtbp: float) -> GangId:
    spec = dataclasses.replace(gang_spec(job_id, command, ranks=2), mtbp_seconds=mtbp)
    local.launch(spec)
    return spec.gang


def test_ranks_read_their_hint_and_follow_its_replacement_but_not_another_jobs(
    runtime: LocalRuntime,  # noqa: F811
    runner_account: RunnerAccount,
) -> None:
    other = launch(runtime, 71, "sleep 60", 86400.0)
    gang = launch(runtime, 70, reader(hint_path(runtime, other)), 600.0)
    wait_for_log(runtime, gang, 2, b"hint 600.0")
    for rank in range(2):
        log = runtime.read_log(gang, rank)
        # errno 13: EACCES. Another job's folder is closed to this job's group, and the
        # gang's own folder is the control plane's.
        assert b"other refused 13" in log and b"plant refused 13" in log
    info = hint_path(runtime, gang).lstat()
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o640
    assert info.st_uid == os.geteuid() and info.st_gid == runner_account.job_gid(70)

    runtime.publish_preemption_risk(gang, 120.0, team="vision")
    wait_for_log(runtime, gang, 2, b"hint 120.0")
    # The same value again writes nothing: the file keeps its inode.
    inode = hint_path(runtime, gang).stat().st_ino
    runtime.publish_preemption_risk(gang, 120.0, team="vision")
    assert hint_path(runtime, gang).stat().st_ino == inode
    assert hint_path(runtime, other).read_text() == "86400.0\n"
    assert sorted(p.name for p in runtime.gang_dir(gang).iterdir() if p.name.startswith(".")) == []


def test_a_link_at_the_hint_name_is_replaced_never_followed(
    runtime: LocalRuntime,  # noqa: F811
) -> None:
    victim = launch(runtime, 73, "sleep 60", 86400.0)
    gang = launch(runtime, 72, "sleep 60", 600.0)
    hint = hint_path(runtime, gang)
    hint.unlink()
    hint.symlink_to(hint_path(runtime, victim))

    runtime.publish_preemption_risk(gang, 120.0, team="vision")

    assert hint_path(runtime, victim).read_text() == "86400.0\n"
    assert not hint.is_symlink() and hint.read_text() == "120.0\n"


def test_a_link_or_a_foreign_folder_in_the_gang_path_is_refused(
    runtime: LocalRuntime,  # noqa: F811
    runner_account: RunnerAccount,
) -> None:
    victim = launch(runtime, 75, "sleep 60", 86400.0)
    gang = launch(runtime, 74, "sleep 60", 600.0)
    wait_until(lambda: all(o.phase == "running" for o in runtime.observe(gang)), what="running")
    attempt_dir = runtime.gang_dir(gang)
    moved = attempt_dir.with_name("moved")
    attempt_dir.rename(moved)
    attempt_dir.symlink_to(runtime.gang_dir(victim))
    try:
        with pytest.raises(RuntimePermanentError, match="not a folder"):
            runtime.publish_preemption_risk(gang, 120.0, team="vision")
        assert hint_path(runtime, victim).read_text() == "86400.0\n"
    finally:
        attempt_dir.unlink()
        moved.rename(attempt_dir)

    # A folder in the path that is not the control plane's (here the runner's).
    os.chown(attempt_dir, runner_account.uid, -1)
    try:
        with pytest.raises(RuntimePermanentError, match=f"belongs to uid {runner_account.uid}"):
            runtime.publish_preemption_risk(gang, 120.0, team="vision")
        assert hint_path(runtime, gang).read_text() == "600.0\n"
    finally:
        os.chown(attempt_dir, os.geteuid(), -1)
