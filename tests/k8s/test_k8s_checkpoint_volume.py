"""Checkpoints survive a move to another node only on the checkpoint volume.

The node agent gives each node its own root filesystem and backs each
PersistentVolumeClaim with one folder every node sees, so these tests fail if
a rank's checkpoint lands anywhere but the volume.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterator

import pytest
from kubernetes import client

from preemption.runtimes.base import RuntimePermanentError
from preemption.runtimes.kubernetes import KubernetesRuntime, KubernetesRuntimeConfig
from tools.k8s.agent_state import ANNOTATION_RUN
from tools.k8s.gangs import all_in, gang_spec
from tools.k8s.node_agent import NodeAgent
from tools.k8s.volumes import bound_claim, delete_claim
from tools.k8s.wait import wait_for

MakeRuntime = Callable[..., KubernetesRuntime]
CLAIM = "qm-checkpoints"
MOUNT = "/checkpoints"

# Attempt 1 writes 64 KiB of random state when SIGTERM comes, as a trap would,
# and says "wrote" only once its handler is in place (the test signals on that
# line); attempt 2 prints the SHA-256 of what it finds, or "missing".
TRAIN = (
    f"{sys.executable} -c '"
    "import hashlib, os, signal, sys, time\n"
    'd = os.environ["QM_CHECKPOINT_DIR"]\n'
    'p = os.path.join(d, "state-" + os.environ["RANK"])\n'
    'if os.environ["QM_ATTEMPT"] == "1":\n'
    "    state = os.urandom(65536)\n"
    "    def save(*_):\n"
    "        os.makedirs(d, exist_ok=True)\n"
    '        open(p + ".tmp", "wb").write(state)\n'
    '        os.replace(p + ".tmp", p)\n'
    "        sys.exit(0)\n"
    "    signal.signal(signal.SIGTERM, save)\n"
    '    print("wrote", hashlib.sha256(state).hexdigest(), flush=True)\n'
    "    while True: time.sleep(0.1)\n"
    "else:\n"
    '    print("read", hashlib.sha256(open(p, "rb").read()).hexdigest()'
    ' if os.path.exists(p) else "missing", flush=True)\n'
    "'"
)


@pytest.fixture
def claim(k8s_api: client.ApiClient, namespace: str) -> Iterator[str]:
    volume = bound_claim(k8s_api, namespace, CLAIM)
    yield CLAIM
    delete_claim(k8s_api, namespace, CLAIM, volume)


def _env(job_id: int, attempt: int) -> dict[str, str]:
    return {"QM_CHECKPOINT_DIR": f"{MOUNT}/job-{job_id}", "QM_ATTEMPT": str(attempt)}


def _run_two_attempts(runtime: KubernetesRuntime, job_id: int) -> tuple[list[str], list[str]]:
    """Attempt 1 on gpu-node-0, preempted; attempt 2 on gpu-node-1. Both ranks' log lines."""
    first = gang_spec(job_id, {"gpu-node-0": 2}, command=TRAIN, grace_seconds=10)
    first = type(first)(**{**_fields(first), "env": {**first.env, **_env(job_id, 1)}})
    runtime.launch(first)
    wait_for(lambda: all_in(runtime, first.gang, "running", 2), timeout=60, what="ranks running")
    wait_for(
        lambda: all(b"wrote" in runtime.read_log(first.gang, r) for r in range(2)),
        timeout=60,
        what="state generated",
    )
    runtime.signal(first.gang, 10)
    wait_for(lambda: all_in(runtime, first.gang, "exited", 2), timeout=60, what="ranks exited")
    assert [o.exit_code for o in runtime.observe(first.gang)] == [0, 0]
    wrote = [runtime.read_log(first.gang, r).decode() for r in range(2)]
    runtime.forget(first.gang)

    second = gang_spec(job_id, {"gpu-node-1": 2}, command=TRAIN, attempt=2)
    second = type(second)(**{**_fields(second), "env": {**second.env, **_env(job_id, 2)}})
    runtime.launch(second)
    wait_for(lambda: all_in(runtime, second.gang, "exited", 2), timeout=60, what="resumed")
    read = [runtime.read_log(second.gang, r).decode() for r in range(2)]
    runtime.forget(second.gang)
    return wrote, read


def _fields(spec: object) -> dict[str, object]:
    return {name: getattr(spec, name) for name in spec.__slots__}  # type: ignore[attr-defined]


def test_gang_preempted_on_one_node_resumes_bit_exact_on_another(
    make_runtime: MakeRuntime, claim: str, node_agent: NodeAgent, namespace: str
) -> None:
    runtime = make_runtime(
        checkpoint_claim=claim,
        checkpoint_mount_path=MOUNT,
        require_checkpoint_claim=True,
        pod_annotations={ANNOTATION_RUN: "process"},
    )
    wrote, read = _run_two_attempts(runtime, 501)
    digests = [line.split()[1] for log in wrote for line in log.splitlines() if "wrote" in line]
    resumed = [line.split()[1] for log in read for line in log.splitlines() if "read" in line]
    assert len(digests) == 2 and len(set(digests)) == 2
    assert resumed == digests  # each rank found exactly its own bytes on node B
    shared = node_agent.claim_folder(namespace, claim) / "job-501"
    assert sorted(p.name for p in shared.iterdir()) == ["state-0", "state-1"]
    assert hashlib.sha256((shared / "state-0").read_bytes()).hexdigest() == digests[0]
    assert runtime.checkpoint_is_durable(f"{MOUNT}/job-501/step_3")
    assert not runtime.checkpoint_is_durable("/tmp/job-501/step_3")
    assert not runtime.checkpoint_is_durable(f"{MOUNT}/../tmp/step_3")


def test_checkpoint_outside_the_volume_is_not_there_on_another_node(
    make_runtime: MakeRuntime, node_agent: NodeAgent
) -> None:
    runtime = make_runtime(pod_annotations={ANNOTATION_RUN: "process"})
    wrote, read = _run_two_attempts(runtime, 502)
    assert all("wrote" in log for log in wrote)
    # Written into gpu-node-0's own filesystem: gone for the attempt on gpu-node-1,
    # and the runtime does not count it as resumable either.
    assert all(log.split() == ["read", "missing"] for log in read), read
    assert not runtime.checkpoint_is_durable(f"{MOUNT}/job-502/step_3")
    assert (node_agent.node_root("gpu-node-0") / "checkpoints/job-502/state-0").exists()


def test_production_refuses_to_start_without_a_checkpoint_volume(kubeconfig: str) -> None:
    with pytest.raises(RuntimePermanentError, match="no checkpoint volume is configured"):
        KubernetesRuntime.from_kubeconfig(
            kubeconfig, KubernetesRuntimeConfig(require_checkpoint_claim=True)
        )
