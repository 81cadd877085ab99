"""The gang's record says when the runtime stopped it, before any of its pods is evicted.

An Eviction API call carries no mark of who made it. The runtime writes the moment it
signals a gang on the gang's record (its ConfigMap) first and evicts the pods after,
so a worker started since still tells its own stop from a drain's: a pod whose
disruption began before that moment was taken by someone else. The pods' eviction
and their DisruptionTarget conditions here are the API server's own; the node agent
only plays the containers' end.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from preemption.runtimes.base import RuntimeTemporaryError
from preemption.runtimes.kubernetes import KubernetesRuntime
from preemption.runtimes.kubernetes.config import SIGNALLED_ANNOTATION, gang_name, pod_name
from preemption.runtimes.kubernetes.observe import STOP_CLOCK_SLACK_SECONDS
from tools.k8s.agent_state import ANNOTATION_EXIT_ON_TERM, ANNOTATION_TERM_SECONDS
from tools.k8s.gangs import all_in, gang_spec, phases
from tools.k8s.wait import wait_for

MakeRuntime = Callable[..., KubernetesRuntime]


def _disrupted(core: client.CoreV1Api, namespace: str, name: str) -> bool:
    pod = core.read_namespaced_pod(name, namespace)
    return pod.metadata.deletion_timestamp is not None or any(
        c.type == "DisruptionTarget" for c in pod.status.conditions or []
    )


def test_no_pod_is_evicted_before_its_gangs_record_says_the_runtime_stops_it(
    make_runtime: MakeRuntime,
    k8s_api: client.ApiClient,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    core = client.CoreV1Api(k8s_api)
    runtime = make_runtime(
        pod_annotations={ANNOTATION_TERM_SECONDS: "0.5", ANNOTATION_EXIT_ON_TERM: "0"}
    )
    spec = gang_spec(231, {"gpu-node-3": 2})
    gang = spec.gang
    runtime.launch(spec)
    wait_for(lambda: all_in(runtime, gang, "running", 2), timeout=30, what="ranks running")

    # The API server refuses the record's write: nothing is evicted, and the
    # reconciler is told to try again.
    def refused(*args: object, **kwargs: object) -> None:
        raise ApiException(status=503, reason="Service Unavailable")

    with monkeypatch.context() as patched:
        patched.setattr(runtime.cluster.core, "patch_namespaced_config_map", refused)
        with pytest.raises(RuntimeTemporaryError, match=gang_name(gang)):
            runtime.signal(gang, 5)
    assert not any(_disrupted(core, namespace, pod_name(gang, r)) for r in (0, 1))
    assert phases(runtime, gang) == {"running": 2}
    assert all(o.signal_sent_at is None for o in runtime.observe(gang))

    # Once the record can be written, the next call writes it, then evicts.
    before = time.time()
    runtime.signal(gang, 5)
    record = core.read_namespaced_config_map(gang_name(gang), namespace)
    signalled_at = float(record.metadata.annotations[SIGNALLED_ANNOTATION])
    assert before <= signalled_at <= time.time()
    wait_for(lambda: all_in(runtime, gang, "exited", 2), timeout=30, what="ranks exited")
    # The record keeps the moment to the microsecond.
    on_record = pytest.approx(signalled_at, abs=1e-6)
    assert all(o.signal_sent_at == on_record for o in runtime.observe(gang))
    assert runtime.taken_ranks(gang) == {}
    # A worker started since reads the same from the record alone.
    restarted = make_runtime()
    assert all(o.signal_sent_at == on_record for o in restarted.observe(gang))
    assert restarted.taken_ranks(gang) == {}
    assert restarted.guard_victims() == []


def test_a_rank_drained_before_the_runtimes_own_signal_stays_taken_by_the_drain(
    make_runtime: MakeRuntime, k8s_api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(k8s_api)
    # Ranks that take 30 s to wind down: the drained one is still ending when the
    # runtime signals the gang.
    runtime = make_runtime(pod_annotations={ANNOTATION_TERM_SECONDS: "30"})
    spec = gang_spec(232, {"gpu-node-3": 2}, grace_seconds=30)
    gang = spec.gang
    runtime.launch(spec)
    wait_for(lambda: all_in(runtime, gang, "running", 2), timeout=30, what="ranks running")
    drained = pod_name(gang, 0)
    client.CoreV1Api(k8s_api).create_namespaced_pod_eviction(
        drained,
        namespace,
        {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": drained}},
    )
    wait_for(lambda: _disrupted(core, namespace, drained), timeout=10, what="the drain")
    assert runtime.observe(gang)[0].phase == "terminating"
    assert runtime.taken_ranks(gang) == {0: "EvictionByEvictionAPI"}

    # The condition's time is whole seconds: the runtime's own signal comes clearly
    # after the drain began.
    time.sleep(STOP_CLOCK_SLACK_SECONDS + 1.0)
    runtime.signal(gang, 30)
    wait_for(lambda: _disrupted(core, namespace, pod_name(gang, 1)), timeout=10, what="signal")
    for observer in (runtime, make_runtime()):
        observed = observer.observe(gang)
        assert [o.phase for o in observed] == ["terminating", "terminating"]
        assert observer.taken_ranks(gang) == {0: "EvictionByEvictionAPI"}, observer
    runtime.kill(gang)
    wait_for(lambda: all_in(runtime, gang, "exited", 2), timeout=30, what="ranks killed")
    runtime.forget(gang)
