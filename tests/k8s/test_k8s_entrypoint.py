"""The rank pod's PID 1 (`RANK_ENTRYPOINT`), run by real shells on this host: its exit
status must be the workload's, also when SIGTERM reaches PID 1 just as the workload
exits on its own (a rank that stopped on another rank's signal, whose own eviction
comes late). Before the second wait, dash ended such a rank 143 about once in 25
tries and busybox ash about once in 8, though the workload exited 0."""

from __future__ import annotations

import shutil
import subprocess

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
