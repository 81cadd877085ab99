"""A drain of every rank of a gang on real kubelets, and the runtime's own eviction
seen by a restarted control plane.

An Eviction API call carries no mark of who made it. The runtime writes on the gang's
record when it stops the gang before it evicts a pod, so:

* ``kubectl drain`` of the nodes that hold every rank of a 2-rank gang (an Eviction
  of each pod, no grace given) is a disruption, not the runtime's signal, although
  every rank is being evicted. The ranks trap SIGTERM and exit 0, as a trap that
  checkpointed would, and the reconciler requeues the job from its committed
  checkpoint with the drain's words, never as succeeded; its next attempt runs;
* the runtime's own eviction, seen by a fresh KubernetesRuntime (a control plane
  restarted with empty memory just after its evictions), is still its own: no
  disruption, no gang guard.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.utils import timezone
from kubernetes import client

from preemption.models import Attempt, Checkpoint, Job, JobState, PreemptionEvent, Rank
from preemption.reconcile import reconcile_jobs
from preemption.runtimes.base import GangId
from preemption.runtimes.kubernetes import KubernetesRuntime
from preemption.runtimes.kubernetes.config import SIGNALLED_ANNOTATION, gang_name, pod_name

# restricted and small_runtime are fixtures of the containment tests, used here too.
from tests.k8s.realnodes.test_real_containment import (
    NODES,
    MakeRuntime,
    _log_with,
    _wait_exited,
)
from tests.k8s.realnodes.test_real_containment import (
    restricted as restricted,
)
from tests.k8s.realnodes.test_real_containment import (
    small_runtime as small_runtime,
)
from tests.k8s.test_k8s_disruption import _admitted_job
from tools.k8s.gangs import all_in, gang_spec
from tools.k8s.wait import wait_for

# A rank that traps SIGTERM and exits 0, as gracetrap does once it has checkpointed.
RANK_COMMAND = r"""trap 'echo "caught-term"; exit 0' TERM
echo "started attempt $QM_ATTEMPT"
while :; do sleep 0.1; done
"""
SLOW_STOP_RANK_COMMAND = r"""trap 'echo "caught-term"; sleep 4; exit 0' TERM
echo "started attempt $QM_ATTEMPT"
while :; do sleep 0.1; done
"""


def _drain(core: client.CoreV1Api, namespace: str, name: str) -> None:
    """What ``kubectl drain`` does to a pod: an Eviction with no grace of its own."""
    core.create_namespaced_pod_eviction(
        name,
        namespace,
        {"apiVersion": "policy/v1", "kind": "Eviction",
         "metadata": {"name": name, "namespace": namespace}},
    )  # fmt: skip


def _reconcile_until_ended(attempt: Attempt, runtime: KubernetesRuntime) -> None:
    deadline = time.monotonic() + 90
    while Attempt.objects.get(pk=attempt.pk).ended_at is None:
        assert time.monotonic() < deadline, f"the attempt never ended: {runtime.observe()}"
        reconcile_jobs(runtime=runtime)
        time.sleep(0.3)


def test_a_drain_of_every_rank_requeues_the_job_as_disrupted_and_it_resumes(
    world: Any,
    small_runtime: MakeRuntime,
    k8s_api: client.ApiClient,
    restricted: str,
) -> None:
    core = client.CoreV1Api(k8s_api)
    runtime = small_runtime()
    job, attempt = _admitted_job(world, list(NODES))
    Job.objects.filter(pk=job.pk).update(command=RANK_COMMAND)
    reconcile_jobs(runtime=runtime)  # launches
    gang = GangId(job.pk, 1)
    wait_for(lambda: all_in(runtime, gang, "running", 2), timeout=60, what="ranks running")
    for rank in (0, 1):
        _log_with(runtime, gang, rank, b"started attempt 1")
    # The trap's commit of step 12, as the events endpoint records it.
    Checkpoint.objects.create(job=job, attempt=attempt, step=12, committed_at=timezone.now())

    # kubectl drain real-node-0 and real-node-1: every rank of the gang is evicted.
    for rank in (0, 1):
        _drain(core, restricted, pod_name(gang, rank))
    observed = runtime.observe(gang)
    assert all(o.signal_sent_at is None for o in observed), "a drain read as our own signal"
    assert runtime.taken_ranks(gang) == {0: "EvictionByEvictionAPI", 1: "EvictionByEvictionAPI"}
    _wait_exited(runtime, gang, 2)
    assert runtime.guard_victims() == [], "no rank was left running for the guard to stop"
    _reconcile_until_ended(attempt, runtime)

    attempt.refresh_from_db()
    ranks = list(Rank.objects.filter(attempt=attempt).order_by("index"))
    print(f"ranks: {[(r.state, r.exit_code, r.signal_sent_at) for r in ranks]}")
    # Each rank's trap exits 0 on the drain's SIGTERM, as a trap that checkpointed does;
    # on this loaded machine the rank entrypoint now and then ends 143 instead (its
    # child exits while its own trap runs). Either way the job is not done.
    assert {r.exit_code for r in ranks} <= {0, 143}
    assert all(r.signal_sent_at is None for r in ranks)
    assert attempt.end_reason == Attempt.EndReason.PREEMPTED, attempt.end_reason
    assert not PreemptionEvent.objects.filter(job=job).exists()
    job.refresh_from_db()
    print(f"job: {job.state}: {job.waiting_reason}")
    assert job.state == JobState.REQUEUED and job.finished_at is None
    assert job.waiting_reason == (
        "disrupted: nodes real-node-0 and real-node-1 were drained; "
        "requeued from its checkpoint at step 12"
    )
    assert job.resume_step == 13 and job.retries_used == 0

    # The job resumes: admitted again onto the nodes (as the scheduling cycle would),
    # its second attempt runs on the real kubelets.
    second = Attempt.objects.create(job=job, number=2, admitted_at=timezone.now())
    Rank.objects.bulk_create(
        Rank(attempt=second, index=index, node=node) for index, node in enumerate(NODES)
    )
    Job.objects.filter(pk=job.pk).update(state=JobState.ADMITTED)
    reconcile_jobs(runtime=runtime)
    resumed = GangId(job.pk, 2)
    wait_for(lambda: all_in(runtime, resumed, "running", 2), timeout=60, what="attempt 2 running")
    _log_with(runtime, resumed, 0, b"started attempt 2")
    reconcile_jobs(runtime=runtime)
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING
    runtime.kill(resumed)
    _wait_exited(runtime, resumed, 2)


def test_the_runtimes_own_eviction_is_its_own_to_a_restarted_control_plane(
    small_runtime: MakeRuntime, k8s_api: client.ApiClient, restricted: str
) -> None:
    """The worker signals the gang and dies: a fresh runtime, with nothing in memory,
    sees every rank evicted, and the gang's record, written before the evictions,
    says they were its own."""
    core = client.CoreV1Api(k8s_api)
    runtime = small_runtime()
    # The ranks take a few seconds to stop, as a checkpoint would, so that the restarted
    # runtime finds them terminating: ranks that end at once may have exited already.
    spec = gang_spec(
        961, {NODES[0]: 1, NODES[1]: 1}, command=SLOW_STOP_RANK_COMMAND, grace_seconds=10
    )
    runtime.launch(spec)
    gang = spec.gang
    wait_for(lambda: all_in(runtime, gang, "running", 2), timeout=60, what="ranks running")
    for rank in (0, 1):
        _log_with(runtime, gang, rank, b"started")
    runtime.signal(gang, 10)
    record = core.read_namespaced_config_map(gang_name(gang), restricted)
    signalled_at = float(record.metadata.annotations[SIGNALLED_ANNOTATION])
    for rank in (0, 1):
        pod = core.read_namespaced_pod(pod_name(gang, rank), restricted)
        evicted = next(c for c in pod.status.conditions if c.type == "DisruptionTarget")
        # The condition's time is whole seconds of the API server's clock.
        assert evicted.last_transition_time.timestamp() >= int(signalled_at), (evicted, record)

    restarted = small_runtime()
    observed = restarted.observe(gang)
    assert [o.phase for o in observed] == ["terminating", "terminating"], observed
    assert all(o.signal_sent_at == pytest.approx(signalled_at, abs=1e-6) for o in observed)
    assert restarted.taken_ranks(gang) == {}
    assert restarted.guard_victims() == []
    _wait_exited(restarted, gang, 2)
    # The ranks' exit codes are not checked: the rank entrypoint now and then ends 143
    # on this loaded machine (see above), and a signalled rank's code is no failure.
    assert all(o.signal_sent_at is not None for o in restarted.observe(gang))
    assert restarted.taken_ranks(gang) == {}
    assert restarted.guard_victims() == []
    restarted.forget(gang)
