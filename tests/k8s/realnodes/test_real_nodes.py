"""Preemption on real kubelets: what the node agent imitates, shown on the real thing.

Two real nodes (containerd, runc, kubelet v1.34) run the Kubernetes runtime's
rank pods as containers of a small image of the host's shell tools. The ranks'
shell catches SIGTERM and writes when it did into its log, so the time from the
Eviction API call to the workload's handler is measured, not imitated.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from preemption.models import Attempt, JobState
from preemption.reconcile import reconcile_jobs
from preemption.runtimes.base import GangId, RuntimePermanentError
from preemption.runtimes.kubernetes import KubernetesRuntime
from preemption.runtimes.kubernetes.config import GPU_RESOURCE, pod_name
from tests.k8s.conftest import HIGH_PRIORITY
from tests.k8s.test_k8s_disruption import _admitted_job
from tools.k8s.gangs import all_in, gang_spec, kept_log
from tools.k8s.realnodes import RealNodes
from tools.k8s.wait import wait_for

MakeRuntime = Callable[..., KubernetesRuntime]

# A rank that says when it started and when SIGTERM reached it, then exits 0;
# with IGNORE_TERM=$RANK it ignores SIGTERM instead (sleep inherits the ignore).
RANK_COMMAND = r"""
if [ "$RANK" = "${IGNORE_TERM:-none}" ]; then
    trap '' TERM
    echo "ignoring-term"
else
    trap 'echo "caught-term $(date +%s.%N)"; exit 0' TERM
fi
echo "started $(date +%s.%N)"
while :; do sleep 0.1; done
"""
CAUGHT = re.compile(rb"caught-term (\d+\.\d+)")


@pytest.fixture
def real_runtime(make_runtime: MakeRuntime, real_nodes: RealNodes) -> KubernetesRuntime:
    """The runtime with the rank image, and requests two real nodes of 2 CPUs can hold."""
    return make_runtime(
        default_image=real_nodes.rank_image,
        default_cpu_per_gpu="50m",
        default_memory_per_gpu="32Mi",
        default_ephemeral_storage_per_gpu="32Mi",
    )


def _log(runtime: KubernetesRuntime, gang: GangId, rank: int) -> bytes:
    return runtime.read_log(gang, rank)


def _container_status(core: client.CoreV1Api, namespace: str, gang: GangId, rank: int) -> Any:
    pod = core.read_namespaced_pod(pod_name(gang, rank), namespace)
    return pod.status.container_statuses[0]


def _greedy_pod(image: str, node: str) -> dict[str, Any]:
    """A pod of higher priority than the gangs' that needs every GPU of ``node``."""
    small = {"cpu": "10m", "memory": "16Mi", GPU_RESOURCE: "8"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "greedy"},
        "spec": {
            "priorityClassName": HIGH_PRIORITY,
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": [
                {
                    "name": "greedy",
                    "image": image,
                    "command": ["/bin/sleep", "600"],
                    "resources": {"limits": small, "requests": small},
                }
            ],
        },
    }


def _launch_running(runtime: KubernetesRuntime, spec: Any) -> None:
    runtime.launch(spec)
    gang, size = spec.gang, spec.world_size
    wait_for(lambda: all_in(runtime, gang, "running", size), timeout=60, what="ranks running")
    # Running is the container started; its trap is set once it has said so.
    for rank in range(size):
        wait_for(lambda r=rank: b"started" in _log(runtime, gang, r), timeout=30, what="trap set")


def test_eviction_reaches_each_containers_workload_which_exits_0_completed(
    real_runtime: KubernetesRuntime, k8s_api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(k8s_api)
    spec = gang_spec(
        901, {"real-node-0": 1, "real-node-1": 1}, command=RANK_COMMAND, grace_seconds=10
    )
    gang = spec.gang
    _launch_running(real_runtime, spec)
    pods = {p.metadata.name: p for p in core.list_namespaced_pod(namespace).items}
    assert {pods[pod_name(gang, r)].spec.node_name for r in (0, 1)} == {
        "real-node-0",
        "real-node-1",
    }

    evicted_at = time.time()
    real_runtime.signal(gang, 10)
    wait_for(lambda: all_in(real_runtime, gang, "exited", 2), timeout=30, what="ranks exited")

    delays = []
    for rank in (0, 1):
        status = _container_status(core, namespace, gang, rank)
        # PID 1 has no default action for SIGTERM: exit 0, Completed, before the grace
        # deadline, is the workload's own handler exiting.
        assert status.state.terminated.exit_code == 0
        assert status.state.terminated.reason == "Completed"
        # The kubelet removes an evicted pod's exited container and its log: the
        # handler's line is read from the end the runtime kept, a moment after the exit.
        wait_for(
            lambda r=rank: CAUGHT.search(_log(real_runtime, gang, r)) is not None,
            timeout=15,
            interval=0.25,
            what="the workload's SIGTERM handler line in its log",
        )
        caught = CAUGHT.search(_log(real_runtime, gang, rank))
        assert caught is not None
        delays.append(float(caught.group(1)) - evicted_at)
    assert [o.exit_code for o in real_runtime.observe(gang)] == [0, 0]
    print(f"eviction call -> SIGTERM handler: {', '.join(f'{d * 1000:.0f} ms' for d in delays)}")
    # Well inside the grace period: the workload has most of it left to checkpoint.
    assert all(0 <= delay < 5 for delay in delays), delays
    real_runtime.forget(gang)


def test_a_rank_ignoring_sigterm_is_killed_at_the_grace_deadline_and_the_guard_stops_the_other(
    real_runtime: KubernetesRuntime,
    real_nodes: RealNodes,
    k8s_api: client.ApiClient,
    namespace: str,
) -> None:
    real_image = real_nodes.rank_image
    core = client.CoreV1Api(k8s_api)
    spec = gang_spec(
        902, {"real-node-0": 1, "real-node-1": 1}, command=RANK_COMMAND, grace_seconds=3
    )
    spec = dataclasses.replace(spec, env={**spec.env, "IGNORE_TERM": "0"})
    gang = spec.gang
    _launch_running(real_runtime, spec)
    assert b"ignoring-term" in _log(real_runtime, gang, 0)

    # kube-scheduler takes rank 0's node for a pod of higher priority wanting all its GPUs.
    evicted_at = time.monotonic()
    core.create_namespaced_pod(namespace, _greedy_pod(real_image, "real-node-0"))
    wait_for(
        lambda: real_runtime.observe(gang)[0].phase == "terminating",
        timeout=30,
        what="kube-scheduler to preempt rank 0",
    )

    def rank_0_exited() -> bool:
        return real_runtime.observe(gang)[0].phase == "exited"

    wait_for(rank_0_exited, timeout=30, what="rank 0 killed")
    killed_after = time.monotonic() - evicted_at
    status = _container_status(core, namespace, gang, 0)
    assert status.state.terminated.exit_code == 137
    assert status.state.terminated.reason == "Error"
    print(f"rank ignoring SIGTERM, grace 3 s: exit 137 seen {killed_after:.1f} s after preemption")
    assert 2.5 <= killed_after < 15

    # Rank 1 still runs, waiting on a collective that will never complete.
    assert real_runtime.observe(gang)[1].phase == "running"
    assert real_runtime.guard_victims() == [gang]
    assert real_runtime.enforce_gang_guard(lambda _: 3) == [gang]
    wait_for(lambda: all_in(real_runtime, gang, "exited", 2), timeout=30, what="rank 1 stopped")
    # Its log as the kubelet serves it once the container has exited: on a loaded
    # machine the first read after the exit came back empty.
    wait_for(
        lambda: CAUGHT.search(_log(real_runtime, gang, 1)) is not None,
        timeout=15,
        interval=0.25,
        what="rank 1's SIGTERM handler line in its log",
    )
    assert _container_status(core, namespace, gang, 1).state.terminated.exit_code == 0
    assert [o.exit_code for o in real_runtime.observe(gang)] == [137, 0]
    assert real_runtime.guard_victims() == []
    real_runtime.forget(gang)


def test_a_rank_whose_image_no_node_has_fails_the_attempt_at_the_start_timeout(
    world: Any,
    real_runtime: KubernetesRuntime,
    k8s_api: client.ApiClient,
    namespace: str,
    settings: Any,
) -> None:
    settings.QM_START_TIMEOUT_SECONDS = 3
    job, attempt = _admitted_job(
        world, ["real-node-0", "real-node-1"], image="registry.invalid/vision/absent:1"
    )
    reconcile_jobs(runtime=real_runtime)
    gang = GangId(job.pk, 1)
    pulls = {"ErrImagePull", "ImagePullBackOff"}
    wait_for(
        lambda: (
            {o.waiting_reason for o in real_runtime.observe(gang)} <= pulls
            and all(o.waiting_reason for o in real_runtime.observe(gang))
        ),
        timeout=60,
        what="the kubelets to give up pulling",
    )
    deadline = time.monotonic() + 60
    while Attempt.objects.get(pk=attempt.pk).ended_at is None:
        assert time.monotonic() < deadline, "the stuck attempt never ended"
        reconcile_jobs(runtime=real_runtime)
        time.sleep(0.3)
    attempt.refresh_from_db()
    assert attempt.end_reason == Attempt.EndReason.GANG_GUARD
    job.refresh_from_db()
    assert job.state == JobState.REQUEUED
    assert re.search(r"rank 0 could not start: (ErrImagePull|ImagePullBackOff) for over 3 s",
                     job.waiting_reason), job.waiting_reason  # fmt: skip
    # Nothing of the gang holds a node any more.
    wait_for(
        lambda: (
            not [
                p
                for p in client.CoreV1Api(k8s_api).list_namespaced_pod(namespace).items
                if p.status.phase not in ("Succeeded", "Failed")
            ]
        ),
        timeout=30,
        what="the stuck pods to end",
    )


def test_the_end_of_a_stopped_ranks_log_outlives_the_container_its_kubelet_removes(
    real_runtime: KubernetesRuntime,
    make_runtime: MakeRuntime,
    real_nodes: RealNodes,
    k8s_api: client.ApiClient,
    namespace: str,
) -> None:
    """A kubelet removes the exited containers of a deleted pod, evicted ones too, and
    their logs with them: read afterwards, the log is the kubelet's "unable to retrieve
    container logs". The runtime follows a stopped rank's log until its container ends
    and keeps its end, which any worker reads back."""
    # Ranks that take a moment to stop, as a checkpoint does: a rank that ends the
    # instant it is signalled may be gone before a follow reaches its kubelet on a
    # loaded machine (docs/real-nodes.md), which is not what this test is about.
    spec = gang_spec(
        905, {"real-node-0": 2, "real-node-1": 2}, command=SLOW_STOP_COMMAND, grace_seconds=10
    )
    gang = spec.gang
    core = client.CoreV1Api(k8s_api)
    _launch_running(real_runtime, spec)
    real_runtime.signal(gang, 10)
    wait_for(lambda: all_in(real_runtime, gang, "exited", 4), timeout=30, what="ranks exited")
    another_worker = make_runtime(
        default_image=real_nodes.rank_image,
        default_cpu_per_gpu="50m",
        default_memory_per_gpu="32Mi",
        default_ephemeral_storage_per_gpu="32Mi",
    )
    removed = 0
    for rank in range(4):
        # The follow ends with the container; its end is kept a moment after.
        tail, first_byte = wait_for(
            lambda r=rank: _kept_tail(real_runtime, gang, r), timeout=15, what="the kept end"
        )
        assert first_byte == 0
        assert b"started" in tail and CAUGHT.search(tail) is not None, (rank, tail)
        assert (
            wait_for(lambda r=rank: kept_log(core, namespace, gang, r), timeout=15, what="kept")
            == tail
        )
        # Another worker, with nothing in memory, reads the same from the cluster.
        assert wait_for(
            lambda r=rank: _kept_tail(another_worker, gang, r), timeout=15, what="kept"
        ) == (tail, 0)
        removed += b"unable to retrieve container logs" in _log(real_runtime, gang, rank)
    print(f"containers whose logs the kubelets had removed when read: {removed} of 4")
    real_runtime.forget(gang)


def _kept_tail(runtime: KubernetesRuntime, gang: GangId, rank: int) -> tuple[bytes, int] | None:
    try:
        tail, first_byte = runtime.read_log_tail(gang, rank, 4096)
    except RuntimePermanentError:
        return None  # removed with its container, and its end not kept yet
    return (tail, first_byte) if CAUGHT.search(tail) else None


# A rank that, told to stop, says so, takes a moment as a checkpoint would, then ends.
SLOW_STOP_COMMAND = r"""
trap 'echo "caught-term $(date +%s.%N)"; sleep 2; echo "saved"; exit 0' TERM
echo "started $(date +%s.%N)"
while :; do sleep 0.1; done
"""


def test_the_end_of_a_drained_ranks_log_is_kept_once_the_runtime_sees_it_ending(
    real_runtime: KubernetesRuntime, k8s_api: client.ApiClient, namespace: str
) -> None:
    """Someone else's eviction (a drain) gives the runtime no stop of its own to follow
    the logs from: it follows them from the observation that sees the ranks ending."""
    core = client.CoreV1Api(k8s_api)
    spec = gang_spec(906, {"real-node-0": 1, "real-node-1": 1}, command=SLOW_STOP_COMMAND)
    gang = spec.gang
    _launch_running(real_runtime, spec)
    for rank in (0, 1):
        core.create_namespaced_pod_eviction(
            pod_name(gang, rank),
            namespace,
            {"apiVersion": "policy/v1", "kind": "Eviction",
             "metadata": {"name": pod_name(gang, rank), "namespace": namespace}},
        )  # fmt: skip
    assert [o.phase for o in real_runtime.observe(gang)] == ["terminating", "terminating"]
    wait_for(lambda: all_in(real_runtime, gang, "exited", 2), timeout=30, what="ranks exited")
    for rank in (0, 1):
        # Whether the kubelet has removed the container by now is a race of its own:
        # the end kept in the cluster is there either way.
        kept = wait_for(lambda r=rank: kept_log(core, namespace, gang, r), timeout=15, what="kept")
        assert CAUGHT.search(kept) is not None and kept.endswith(b"saved\n"), kept
        assert real_runtime.read_log_tail(gang, rank, 4096)[0].endswith(b"saved\n")
    real_runtime.forget(gang)
