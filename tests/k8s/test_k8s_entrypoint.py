"""The rank pod's PID 1 (`RANK_ENTRYPOINT`), run by real shells on this host: its exit
status must be the workload's, also when SIGTERM reaches PID 1 just as the workload
exits on its own (a rank that stopped on another rank's signal, whose own eviction
comes late). Before the second wait, dash ended such a rank 143 about once in 25
tries and busybox ash about once in 8, though the workload exited 0."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from preemption.runtimes.kubernetes.spec import RANK_ENTRYPOINT

SHELLS = {
    "dash": ["/bin/dash"],
    "busybox-ash": [shutil.which("busybox") or "busybox", "sh"],
}
# The workload signals PID 1 (its parent's parent is the child shell's parent) and
# exits 0 at once, so the signal and the exit race each other in PID 1.
SIGNAL_AS_IT_EXITS = "kill -TERM $PPID; exit 0"


def _run(shell: list[str], workload: str) -> int:
    return subprocess.run(
        [*shell, "-c", RANK_ENTRYPOINT, "qm-rank", workload],
        start_new_session=True,
        capture_output=True,
        timeout=30,
    ).returncode


@pytest.mark.parametrize("shell", SHELLS, ids=list(SHELLS))
def test_a_workload_exiting_0_as_pid_1_is_signalled_is_recorded_0(shell: str) -> None:
    if shutil.which(SHELLS[shell][0]) is None:
        pytest.fail(f"{SHELLS[shell][0]} is missing: bin/test-services installs it")
    codes = [_run(SHELLS[shell], SIGNAL_AS_IT_EXITS) for _ in range(200)]
    assert codes == [0] * 200, {code: codes.count(code) for code in set(codes)}


@pytest.mark.parametrize("shell", SHELLS, ids=list(SHELLS))
@pytest.mark.parametrize(
    ("workload", "code"),
    [
        ("exit 3", 3),
        ("exit 127", 127),
        ("trap 'exit 0' TERM; kill -TERM $PPID; sleep 0.2; exit 9", 0),
    ],
    ids=["failure", "127", "trapped-term"],
)
def test_the_workloads_own_status_is_pid_1s(shell: str, workload: str, code: int) -> None:
    assert _run(SHELLS[shell], workload) == code


# A background command whose SIGTERM handler takes half a second, beside a foreground
# one that exits at once: the rank may end only once the background one has written.
SLOW_BACKGROUND = """(trap 'sleep 0.5; echo saved > "$QM_TEST_OUT"; exit 0' TERM; sleep 30 & wait) &
sh -c 'trap "exit 0" TERM; echo ready > "$QM_TEST_READY"; sleep 30 & wait'
"""


@pytest.mark.parametrize("shell", SHELLS, ids=list(SHELLS))
def test_a_background_command_finishes_its_handler_before_the_rank_ends(
    shell: str, tmp_path: Path
) -> None:
    out, ready = tmp_path / "out", tmp_path / "ready"
    rank = subprocess.Popen(
        [*SHELLS[shell], "-c", RANK_ENTRYPOINT, "qm-rank", SLOW_BACKGROUND],
        start_new_session=True,
        env={**os.environ, "QM_TEST_OUT": str(out), "QM_TEST_READY": str(ready)},
    )
    try:
        deadline = time.monotonic() + 10
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready.exists(), "the foreground command never started"
        time.sleep(0.2)  # the background subshell has set its trap by now
        rank.send_signal(signal.SIGTERM)  # as the kubelet signals PID 1
        assert rank.wait(timeout=10) == 0
        # Read the moment PID 1 is gone: in a container, what is left dies with it.
        assert out.read_text() == "saved\n"
    finally:
        if rank.poll() is None:
            os.killpg(rank.pid, signal.SIGKILL)
