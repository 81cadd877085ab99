"""Which log bodies are a kubelet's answer for a container it has removed, and which are
a rank's own log that merely mentions the same words. The answers are the two a real
kubelet v1.34.4 gave in the real-node tests (tests/k8s/realnodes), paths as it wrote them."""

from __future__ import annotations

import pytest

from preemption.runtimes.kubernetes.logs import REMOVED_ANSWER_BYTES, removed_container

POD_LOGS = "/tmp/pytest-of-root/pytest-65/real-nodes0/real-node-0/pod-logs"
FOLDER = f"{POD_LOGS}/qm-real-d6caa513_qm-906-1-r0_63919b3e-a058-45df-bbcc-36d4c8e7c2f4"

ANSWERS = [
    b"unable to retrieve container logs for containerd://"
    b"8cdfe489333df0e0c4d5d2f8a1b0e7c6d5f4e3a2b1c0d9e8f7a6b5c4d3e2f1a0",
    f'failed to try resolving symlinks in path "{FOLDER}/rank/0.log": '
    f"lstat {FOLDER}: no such file or directory".encode(),
    f'failed to try resolving symlinks in path "{FOLDER}/rank/0.log": '
    f"lstat {FOLDER}/rank/0.log: no such file or directory\n".encode(),
]

NOT_ANSWERS = [
    b"",
    b"step 12 loss 0.41\n",
    # A log whose line quotes the answer has other lines around it.
    b"starting\nunable to retrieve container logs for containerd://8cdf\ndone\n",
    ANSWERS[1] + b"\nstep 13 loss 0.40\n",
    # Another error about the same path is not the file being gone.
    f'failed to try resolving symlinks in path "{FOLDER}/rank/0.log": '
    f"lstat {FOLDER}: permission denied".encode(),
]


@pytest.mark.parametrize("body", ANSWERS)
def test_a_kubelets_answer_for_a_removed_container_is_recognised(body: bytes) -> None:
    assert removed_container(body)
    # Every answer fits in what the readers look at to recognise it.
    assert len(body) < REMOVED_ANSWER_BYTES


@pytest.mark.parametrize("body", NOT_ANSWERS)
def test_a_ranks_own_log_is_never_taken_for_the_answer(body: bytes) -> None:
    assert not removed_container(body)
