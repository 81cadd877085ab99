"""Failures on real kubelets: a disruption budget that refuses, and a node that dies.

Jobs go through the reconciler as in production (admitted in the database, then
``reconcile_jobs`` launches, observes and ends them); their ranks are containers
on the two real nodes. What the real kubelet did is printed, for docs/real-nodes.md.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client

from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank
from preemption.reconcile import reconcile_jobs, request_stop
from preemption.runtimes.base import GangId
from preemption.runtimes.kubernetes import KubernetesRuntime
from preemption.runtimes.kubernetes.config import GANG_LABEL, gang_name, pod_name
from tests.k8s.test_k8s_disruption import _admitted_job
from tools.k8s.gangs import all_in
from tools.k8s.realnodes import RealNodes
from tools.k8s.wait import wait_for

MakeRuntime = Callable[..., KubernetesRuntime]

# Catches SIGTERM, says so, exits 0.
TRAPPING_RANK = r"""
trap 'echo "caught-term $(date +%s.%N)"; exit 0' TERM
echo "started"
while :; do sleep 0.1; done
"""


@pytest.fixture
def failure_runtime(make_runtime: MakeRuntime, real_nodes: RealNodes) -> KubernetesRuntime:
    """The runtime with the rank image, and requests two real nodes of 2 CPUs can hold."""
    return make_runtime(
        default_image=real_nodes.rank_image,
        default_cpu_per_gpu="50m",
        default_memory_per_gpu="32Mi",
        default_ephemeral_storage_per_gpu="32Mi",
        eviction_retry_seconds=0.3,
    )


@pytest.fixture
def lost_node(real_nodes: RealNodes) -> Iterator[str]:
    """real-node-1, brought back (kubelet restarted, Ready, GPUs) whatever the test did to it."""
    yield "real-node-1"
    real_nodes.restart_kubelet("real-node-1")


def _launched(world: Any, runtime: KubernetesRuntime) -> tuple[Job, Attempt, GangId]:
    """A two-rank job of trapping ranks on the two real nodes, launched and running."""
    job, attempt = _admitted_job(world, ["real-node-0", "real-node-1"])
    Job.objects.filter(pk=job.pk).update(command=TRAPPING_RANK)
    reconcile_jobs(runtime=runtime)
    gang = GangId(job.pk, 1)
    wait_for(lambda: all_in(runtime, gang, "running", 2), timeout=60, what="ranks running")
    for rank in (0, 1):
        wait_for(
            lambda r=rank: b"started" in runtime.read_log(gang, r), timeout=30, what="trap set"
        )
    return job, attempt, gang


def _reconcile_until_ended(runtime: KubernetesRuntime, attempt: Attempt, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while Attempt.objects.get(pk=attempt.pk).ended_at is None:
        assert time.monotonic() < deadline, "the attempt never ended"
        reconcile_jobs(runtime=runtime)
        time.sleep(0.3)


def test_a_budget_refusing_eviction_holds_the_real_pods_until_the_deadline_then_they_are_killed(
    world: Any,
    failure_runtime: KubernetesRuntime,
    real_nodes: RealNodes,
    k8s_api: client.ApiClient,
    namespace: str,
) -> None:
    job, attempt, gang = _launched(world, failure_runtime)
    policy = client.PolicyV1Api(k8s_api)
    policy.create_namespaced_pod_disruption_budget(
        namespace,
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "keep-all"},
            "spec": {"minAvailable": 2, "selector": {"matchLabels": {GANG_LABEL: gang_name(gang)}}},
        },
    )
    wait_for(
        lambda: (
            policy.read_namespaced_pod_disruption_budget(
                "keep-all", namespace
            ).status.current_healthy
            == 2
        ),
        timeout=30,
        what="the disruption controller to count the gang",
    )

    event = request_stop(job=job, reason="priority", cause="a critical job needs the node")
    assert event is not None and event.grace_seconds == 3
    reconcile_jobs(runtime=failure_runtime)
    # The Eviction API answered 429: the containers never saw SIGTERM.
    blocked = failure_runtime.eviction_blocked(gang)
    assert sorted(blocked) == [0, 1]
    assert all(reason.startswith("429") for reason in blocked.values()), blocked
    assert all_in(failure_runtime, gang, "running", 2)
    for rank in (0, 1):
        assert b"caught-term" not in failure_runtime.read_log(gang, rank)

    _reconcile_until_ended(failure_runtime, attempt, timeout=60)
    event.refresh_from_db()
    assert event.outcome == PreemptionEvent.Outcome.FORCED
    assert event.killed_at is not None and event.killed_at >= event.deadline
    job.refresh_from_db()
    assert job.state == JobState.REQUEUED
    # The deadline's kill deletes the pods with grace 0; the real kubelet still
    # sends SIGTERM first (its minimum grace is 2 s), and a trapping rank exits 0.
    ranks = list(Rank.objects.filter(attempt=attempt).order_by("index"))
    print(f"budget-blocked gang killed at its deadline: {[(r.state, r.exit_code) for r in ranks]}")
    assert [r.state for r in ranks] == ["exited", "exited"]
    assert all(r.exit_code in (0, 137) for r in ranks), [r.exit_code for r in ranks]
    assert not real_nodes.running_pods("real-node-0") & {pod_name(gang, r) for r in (0, 1)}
    assert not real_nodes.running_pods("real-node-1") & {pod_name(gang, r) for r in (0, 1)}
    failure_runtime.forget(gang)


@pytest.mark.parametrize("with_containers", [True, False], ids=["machine-lost", "kubelet-lost"])
def test_a_lost_node_ends_the_attempt_and_the_job_is_requeued(
    world: Any,
    failure_runtime: KubernetesRuntime,
    real_nodes: RealNodes,
    lost_node: str,
    k8s_api: client.ApiClient,
    namespace: str,
    with_containers: bool,
) -> None:
    core = client.CoreV1Api(k8s_api)
    job, attempt, gang = _launched(world, failure_runtime)
    lost_at = time.monotonic()
    real_nodes.lose_node(lost_node, with_containers=with_containers)

    def lost_after() -> float | None:
        conditions = core.read_node(lost_node).status.conditions or []
        ready = next(c for c in conditions if c.type == "Ready")
        return time.monotonic() - lost_at if ready.status != "True" else None

    wait_for(lambda: lost_after() is not None, timeout=30, what="the node to be not Ready")
    not_ready_after = lost_after()
    wait_for(
        lambda: failure_runtime.observe(gang)[1].phase == "lost",
        timeout=30,
        what="rank 1 to be seen lost",
    )
    _reconcile_until_ended(failure_runtime, attempt, timeout=60)
    attempt.refresh_from_db()
    job.refresh_from_db()
    ranks = list(Rank.objects.filter(attempt=attempt).order_by("index"))
    print(
        f"{lost_node} lost ({'kubelet and containers' if with_containers else 'kubelet only'}): "
        f"not Ready after {not_ready_after:.1f} s, attempt ended after "
        f"{time.monotonic() - lost_at:.1f} s ({attempt.end_reason}); "
        f"ranks {[(r.state, r.exit_code) for r in ranks]}; job {job.state}: {job.waiting_reason}"
    )
    assert [r.state for r in ranks] == ["exited", "lost"]
    # The gang guard stopped the rank on the live node: SIGTERM, trapped, exit 0
    # (the loop never ends otherwise).
    assert ranks[0].exit_code == 0 and ranks[0].signal_sent_at is not None
    assert job.state == JobState.REQUEUED
    assert attempt.end_reason == Attempt.EndReason.GANG_GUARD
    causes = list(PreemptionEvent.objects.filter(job=job).values_list("cause", flat=True))
    assert any(re.search(r"rank 1 was lost", cause) for cause in causes), causes

    # What the control plane cannot see: with only the kubelet gone, rank 1 still
    # runs on the lost node while its job is requeued, until a kubelet comes back
    # and finds its pod deleted.
    lost_rank = pod_name(gang, 1)
    assert (lost_rank in real_nodes.running_pods(lost_node)) is not with_containers
    restarted_at = time.monotonic()
    real_nodes.restart_kubelet(lost_node)
    wait_for(
        lambda: lost_rank not in real_nodes.running_pods(lost_node),
        timeout=60,
        what="the restarted kubelet to stop the lost rank",
    )
    print(
        f"{lost_node} back: kubelet Ready with GPUs and the lost rank stopped "
        f"{time.monotonic() - restarted_at:.1f} s after its restart"
    )
