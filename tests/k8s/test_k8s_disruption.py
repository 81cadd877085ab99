"""No stuck jobs: a preemption a PodDisruptionBudget blocks is forced at its
deadline, and a rank that cannot start fails its attempt after the start timeout.

Real PodDisruptionBudget, real disruption controller and Eviction API on the
test control plane; the reconciler and the job page run against the database.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from django.test import Client
from django.utils import timezone
from kubernetes import client

from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank
from preemption.reconcile import reconcile_jobs, request_stop
from preemption.runtimes.base import GangId
from preemption.runtimes.kubernetes import KubernetesRuntime
from preemption.runtimes.kubernetes.config import GANG_LABEL, gang_name
from preemption.services import job_submit
from quotas.models import PriorityClass
from tests.conftest import PASSWORD
from tools.k8s.gangs import all_in
from tools.k8s.node_agent import NodeAgent
from tools.k8s.wait import wait_for

MakeRuntime = Callable[..., KubernetesRuntime]


def _admitted_job(world: Any, nodes: list[str], *, image: str = "") -> tuple[Job, Attempt]:
    """A job admitted onto the test cluster's nodes, as the scheduling cycle would leave it."""
    low = PriorityClass.objects.create(
        name="qm-test-low", value=100, preemption_policy="Never", grace_seconds=3
    )
    # The team may use it: every top-level team has a list of its classes.
    world.org.priority_classes.add(low)
    job = job_submit(
        submitter=world.users["researcher"],
        team=world.vision,
        flavor=world.h100,
        ranks=len(nodes),
        gpus_per_rank=1,
        command="sleep infinity",
        priority_class=low,
        name="budgeted",
        image=image,
    )
    attempt = Attempt.objects.create(job=job, number=1, admitted_at=timezone.now())
    Rank.objects.bulk_create(
        Rank(attempt=attempt, index=index, node=node) for index, node in enumerate(nodes)
    )
    Job.objects.filter(pk=job.pk).update(state=JobState.ADMITTED)
    return job, attempt


def test_eviction_blocked_by_a_budget_is_forced_at_the_deadline(
    world: Any, make_runtime: MakeRuntime, k8s_api: client.ApiClient, namespace: str
) -> None:
    runtime = make_runtime(eviction_retry_seconds=0.3)
    job, attempt = _admitted_job(world, ["gpu-node-0", "gpu-node-0"])
    reconcile_jobs(runtime=runtime)  # launches
    gang = GangId(job.pk, 1)
    wait_for(lambda: all_in(runtime, gang, "running", 2), timeout=60, what="ranks running")

    # A budget that allows no disruption of the gang at all.
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
    reconcile_jobs(runtime=runtime)
    # Refused: still running, the preemption waits and says why.
    assert runtime.eviction_blocked(gang)
    assert all_in(runtime, gang, "running", 2)
    event.refresh_from_db()
    assert event.signal_sent_at is None and event.killed_at is None

    deadline = time.monotonic() + 60
    while Attempt.objects.get(pk=attempt.pk).ended_at is None:
        assert time.monotonic() < deadline, "the blocked preemption never ended"
        reconcile_jobs(runtime=runtime)
        time.sleep(0.3)
    event.refresh_from_db()
    assert event.outcome == PreemptionEvent.Outcome.FORCED
    assert event.killed_at is not None and event.killed_at >= event.deadline
    job.refresh_from_db()
    assert job.state == JobState.REQUEUED
    assert Attempt.objects.get(pk=attempt.pk).end_reason == Attempt.EndReason.PREEMPTED

    browser = Client()
    assert browser.login(username="researcher", password=PASSWORD)
    page = browser.get(f"/jobs/{job.pk}/").content.decode()
    assert "forced past a disruption budget" in page


def test_a_rank_that_cannot_pull_its_image_fails_the_attempt_after_the_start_timeout(
    world: Any,
    make_runtime: MakeRuntime,
    k8s_api: client.ApiClient,
    namespace: str,
    node_agent: NodeAgent,
    settings: Any,
) -> None:
    settings.QM_START_TIMEOUT_SECONDS = 3
    runtime = make_runtime()
    job, attempt = _admitted_job(
        world, ["gpu-node-1", "gpu-node-1"], image="registry.example.org/vision/missing:1"
    )
    # The agent, like a kubelet, pulls only from the registry it can reach.
    node_agent.pullable_images = ("registry.invalid/",)
    try:
        reconcile_jobs(runtime=runtime)
        gang = GangId(job.pk, 1)
        wait_for(
            lambda: {o.waiting_reason for o in runtime.observe(gang)} == {"ImagePullBackOff"},
            timeout=30,
            what="ranks waiting on their image",
        )
        reconcile_jobs(runtime=runtime)
        assert Attempt.objects.get(pk=attempt.pk).ended_at is None  # not yet timed out
        deadline = time.monotonic() + 60
        while Attempt.objects.get(pk=attempt.pk).ended_at is None:
            assert time.monotonic() < deadline, "the stuck attempt never ended"
            reconcile_jobs(runtime=runtime)
            time.sleep(0.3)
    finally:
        node_agent.pullable_images = None
    attempt.refresh_from_db()
    assert attempt.end_reason == Attempt.EndReason.GANG_GUARD
    job.refresh_from_db()
    assert job.state == JobState.REQUEUED
    assert "rank 0 could not start: ImagePullBackOff for over 3 s" in job.waiting_reason
    # Its GPUs are free: no pod of the gang is left on the node.
    pods = client.CoreV1Api(k8s_api).list_namespaced_pod(namespace).items
    assert [p for p in pods if p.status.phase not in ("Succeeded", "Failed")] == []


def test_a_launch_cut_short_by_a_missing_priority_class_is_finished_later(
    world: Any, make_runtime: MakeRuntime, k8s_api: client.ApiClient, namespace: str
) -> None:
    runtime = make_runtime()
    job, attempt = _admitted_job(world, ["gpu-node-3"])
    PriorityClass.objects.filter(pk=job.priority_class_id).update(name="qm-test-not-yet")
    reconcile_jobs(runtime=runtime)  # the API server refuses the pod: no such class
    gang = GangId(job.pk, 1)
    assert Attempt.objects.get(pk=attempt.pk).launched_at is None
    assert [o.phase for o in runtime.observe(gang)] == ["starting"]  # the record is there
    scheduling = client.SchedulingV1Api(k8s_api)
    scheduling.create_priority_class(
        {"metadata": {"name": "qm-test-not-yet"}, "value": 100, "preemptionPolicy": "Never"}
    )
    try:
        # The failed launch is retried once its backoff has passed.
        wait_for(
            lambda: (
                reconcile_jobs(runtime=runtime) is not None
                and Attempt.objects.get(pk=attempt.pk).launched_at is not None
            ),
            timeout=30,
            interval=0.3,
            what="the launch to be finished",
        )
        wait_for(lambda: all_in(runtime, gang, "running", 1), timeout=60, what="rank running")
        runtime.kill(gang)
        wait_for(lambda: all_in(runtime, gang, "exited", 1), timeout=30, what="rank exited")
    finally:
        scheduling.delete_priority_class("qm-test-not-yet")
