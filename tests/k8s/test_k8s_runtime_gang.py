"""The Kubernetes runtime launches, evicts, kills and observes whole gangs."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from preemption.runtimes.base import GangId, RuntimeTemporaryError
from preemption.runtimes.kubernetes import KubernetesRuntime
from preemption.runtimes.kubernetes.config import (
    EXIT_CODE_FINALIZER,
    gang_name,
    gang_selector,
    pod_name,
)
from preemption.runtimes.kubernetes.observe import gang_guard_victims
from tests.k8s.conftest import delete_namespace
from tools.k8s.agent_state import ANNOTATION_EXIT_ON_TERM, ANNOTATION_RUN, ANNOTATION_TERM_SECONDS
from tools.k8s.gangs import all_in, gang_spec, phases
from tools.k8s.wait import wait_for

MakeRuntime = Callable[..., KubernetesRuntime]


def pods_left(core: client.CoreV1Api, namespace: str) -> list[tuple[str, Any, bool, str]]:
    """The pods of ``namespace``: name, finalizers, whether deleted, phase."""
    return [
        (
            pod.metadata.name,
            pod.metadata.finalizers,
            pod.metadata.deletion_timestamp is not None,
            pod.status.phase,
        )
        for pod in core.list_namespaced_pod(namespace).items
    ]


def test_sixteen_rank_gang_is_bound_to_its_nodes_and_evicted_as_one(
    make_runtime: MakeRuntime, k8s_api: client.ApiClient, namespace: str
):
    runtime = make_runtime(
        pod_annotations={ANNOTATION_TERM_SECONDS: "1.5", ANNOTATION_EXIT_ON_TERM: "0"}
    )
    core = client.CoreV1Api(k8s_api)
    spec = gang_spec(101, {"gpu-node-0": 8, "gpu-node-1": 8})
    gang = spec.gang
    runtime.launch(spec)
    first_uids = {p.metadata.uid for p in core.list_namespaced_pod(namespace).items}
    runtime.launch(spec)  # a second launch changes nothing
    assert {p.metadata.uid for p in core.list_namespaced_pod(namespace).items} == first_uids
    assert len(first_uids) == 16

    wait_for(lambda: all_in(runtime, gang, "running", 16), timeout=60, what="16 ranks running")
    pods = {p.metadata.name: p for p in core.list_namespaced_pod(namespace).items}
    record = core.read_namespaced_config_map(gang_name(gang), namespace)
    for placement in spec.ranks:
        pod = pods[pod_name(gang, placement.rank)]
        # Bound by kube-scheduler (the runtime sets no nodeName) to the placed node.
        assert pod.spec.node_name == placement.node
        scheduled = [c for c in pod.status.conditions if c.type == "PodScheduled"]
        assert scheduled[0].status == "True"
        assert pod.spec.restart_policy == "Never"
        assert pod.spec.priority_class_name == "qm-test-low"
        assert pod.spec.priority == 100
        assert pod.spec.termination_grace_period_seconds == 5
        assert pod.metadata.labels["quartermaster.dev/rank"] == str(placement.rank)
        assert pod.metadata.labels["app.kubernetes.io/managed-by"] == "quartermaster"
        assert pod.metadata.owner_references[0].uid == record.metadata.uid
        assert EXIT_CODE_FINALIZER in pod.metadata.finalizers
        env = {e.name: e for e in pod.spec.containers[0].env}
        assert env["RANK"].value == str(placement.rank)
        assert env["WORLD_SIZE"].value == "16"
        assert env["LOCAL_RANK"].value == str(placement.local_rank)
        assert env["MASTER_ADDR"].value == f"rank-0.qm-101-1.{namespace}.svc.cluster.local"
        assert env["QM_EVENTS_TOKEN"].value_from.secret_key_ref.name == "qm-101-1-events"
        assert pod.spec.containers[0].resources.limits["nvidia.com/gpu"] == "1"
    service = core.read_namespaced_service(gang_name(gang), namespace)
    assert service.spec.cluster_ip == "None"
    assert service.spec.publish_not_ready_addresses is True

    # A pod wanting every GPU of gpu-node-0 cannot fit while the gang holds it.
    probe = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "probe"},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": "gpu-node-0"},
            "containers": [
                {
                    "name": "probe",
                    "image": "none",
                    "resources": {"limits": {"nvidia.com/gpu": "8"}},
                }
            ],
        },
    }
    core.create_namespaced_pod(namespace, probe)

    decided = time.time()
    runtime.signal(gang, 5)
    answered = time.time()
    observed = runtime.observe(gang)
    assert {o.phase for o in observed} <= {"terminating", "exited"}
    assert all(o.signal_sent_at is not None and decided <= o.signal_sent_at <= answered
               for o in observed)  # fmt: skip
    runtime.signal(gang, 5)  # idempotent

    # GPUs are free only when every rank on the node has ended: the probe is bound no
    # sooner than the last of them exited. (Read from the probe's binding time, in whole
    # seconds, rather than from a look right after the signal: on a loaded machine the
    # ranks, which exit at once, may be gone before that look.)
    def probe_bound() -> bool:
        return bool(core.read_namespaced_pod("probe", namespace).spec.node_name)

    wait_for(probe_bound, timeout=30, what="probe scheduled")
    on_node_0 = [o for o in runtime.observe(gang) if o.node == "gpu-node-0"]
    assert {o.phase for o in on_node_0} == {"exited"}
    conditions = core.read_namespaced_pod("probe", namespace).status.conditions
    [scheduled] = [c for c in conditions if c.type == "PodScheduled"]
    bound_at = scheduled.last_transition_time.timestamp()
    assert all(o.exited_at is not None and o.exited_at <= bound_at + 1 for o in on_node_0), (
        bound_at,
        on_node_0,
    )

    wait_for(lambda: all_in(runtime, gang, "exited", 16), timeout=30, what="16 ranks exited")
    # The agent deleted every pod object; the finalizer kept each final status.
    final = runtime.observe(gang)
    assert [o.exit_code for o in final] == [0] * 16
    assert all(o.exited_at is not None for o in final)
    assert all(
        p.metadata.deletion_timestamp is not None
        for p in core.list_namespaced_pod(namespace, label_selector="quartermaster.dev/gang").items
    )
    assert runtime.released_ports([gang])[gang] == []

    runtime.forget(gang)

    def gang_objects_gone() -> bool:
        selector = f"quartermaster.dev/gang={gang_name(gang)}"
        return not (
            core.list_namespaced_pod(namespace, label_selector=selector).items
            or core.list_namespaced_service(namespace, label_selector=selector).items
            or core.list_namespaced_secret(namespace, label_selector=selector).items
            or core.list_namespaced_config_map(namespace, label_selector=selector).items
        )

    wait_for(gang_objects_gone, timeout=30, what="garbage collection of the gang")
    assert runtime.observe(gang) == []


def test_a_disruption_budget_blocks_eviction_until_it_allows(
    make_runtime: MakeRuntime, k8s_api: client.ApiClient, namespace: str
):
    runtime = make_runtime(eviction_retry_seconds=0.6)
    spec = gang_spec(102, {"gpu-node-2": 2})
    gang = spec.gang
    runtime.launch(spec)
    wait_for(lambda: all_in(runtime, gang, "running", 2), timeout=30)
    policy = client.PolicyV1Api(k8s_api)
    policy.create_namespaced_pod_disruption_budget(
        namespace,
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "keep-all"},
            "spec": {
                "minAvailable": 2,
                "selector": {"matchLabels": {"quartermaster.dev/gang": gang_name(gang)}},
            },
        },
    )

    def budget_counted() -> bool:
        status = policy.read_namespaced_pod_disruption_budget("keep-all", namespace).status
        return (
            status is not None and status.observed_generation == 1 and status.current_healthy == 2
        )

    wait_for(budget_counted, timeout=30, what="disruption controller")
    with pytest.raises(RuntimeTemporaryError, match="blocked"):
        runtime.signal(gang, 5)
    blocked = runtime.eviction_blocked(gang)
    assert sorted(blocked) == [0, 1]
    assert all("429" in reason for reason in blocked.values())
    assert phases(runtime, gang) == {"running": 2}

    policy.delete_namespaced_pod_disruption_budget("keep-all", namespace)
    wait_for(lambda: _signal_passes(runtime, gang), timeout=30, what="eviction allowed")
    assert runtime.eviction_blocked(gang) == {}
    wait_for(lambda: all_in(runtime, gang, "exited", 2), timeout=30)
    # Simulated ranks without a trap end like a shell killed by SIGTERM.
    assert [o.exit_code for o in runtime.observe(gang)] == [143, 143]


def _signal_passes(runtime: KubernetesRuntime, gang: GangId) -> bool:
    try:
        runtime.signal(gang, 5)
    except RuntimeTemporaryError:
        return False
    return True


def test_kill_deletes_with_grace_zero_past_the_deadline(make_runtime: MakeRuntime, namespace: str):
    # Ranks that would take 60 s to wind down: only a kill ends them quickly.
    runtime = make_runtime(pod_annotations={ANNOTATION_TERM_SECONDS: "60"})
    spec = gang_spec(103, {"gpu-node-3": 3}, grace_seconds=30)
    gang = spec.gang
    runtime.launch(spec)
    wait_for(lambda: all_in(runtime, gang, "running", 3), timeout=30)
    runtime.signal(gang, 30)
    wait_for(lambda: all_in(runtime, gang, "terminating", 3), timeout=10)
    started = time.monotonic()
    runtime.kill(gang)
    runtime.kill(gang)  # idempotent
    wait_for(lambda: all_in(runtime, gang, "exited", 3), timeout=15)
    assert time.monotonic() - started < 10
    assert [o.exit_code for o in runtime.observe(gang)] == [137, 137, 137]


def test_a_rank_never_scheduled_ends_with_the_gang(make_runtime: MakeRuntime, namespace: str):
    runtime = make_runtime()
    # Rank 1 is placed on a node that does not exist: it stays Pending.
    spec = gang_spec(107, {"gpu-node-3": 1, "no-such-node": 1})
    gang = spec.gang
    runtime.launch(spec)
    wait_for(lambda: phases(runtime, gang) == {"running": 1, "starting": 1}, timeout=30)
    runtime.signal(gang, 5)
    wait_for(lambda: all_in(runtime, gang, "exited", 2), timeout=30)
    assert [(o.exit_code, o.started_at is None) for o in runtime.observe(gang)] == [
        (143, False),
        (None, True),
    ]


def test_forget_releases_a_finalizer_of_a_pod_that_changed_since_it_was_listed(
    make_runtime: MakeRuntime, k8s_api: client.ApiClient, namespace: str
):
    runtime = make_runtime(pod_annotations={ANNOTATION_RUN: "process"})
    core = client.CoreV1Api(k8s_api)
    spec = gang_spec(111, {"gpu-node-2": 2}, command="true")
    gang = spec.gang
    runtime.launch(spec)
    wait_for(lambda: all_in(runtime, gang, "exited", 2), timeout=120)
    selector = gang_selector(gang)
    listed = core.list_namespaced_pod(namespace, label_selector=selector)
    for pod in listed.items:
        # A write after the list, as a kubelet's late status update is.
        core.patch_namespaced_pod(
            pod.metadata.name, namespace, {"metadata": {"labels": {"touched": "yes"}}}
        )
    cluster_core = runtime.cluster.core
    real_list = cluster_core.list_namespaced_pod
    stale = [listed]
    cluster_core.list_namespaced_pod = lambda *args, **kwargs: (
        stale.pop() if stale else real_list(*args, **kwargs)
    )
    try:
        runtime.forget(gang)
    finally:
        cluster_core.list_namespaced_pod = real_list
    assert not stale, "forget read the gang's pods through another call"
    for pod in core.list_namespaced_pod(namespace, label_selector=selector).items:
        assert EXIT_CODE_FINALIZER not in (pod.metadata.finalizers or [])
    # With the finalizers released, the gang record's collection removes the pods.
    wait_for(
        lambda: not core.list_namespaced_pod(namespace, label_selector=selector).items,
        timeout=120,
        what="the forgotten gang's pods to go",
    )


def test_ranks_run_the_command_with_rendezvous_and_trap_environment(
    make_runtime: MakeRuntime, namespace: str
):
    runtime = make_runtime(pod_annotations={ANNOTATION_RUN: "process"})
    command = (
        'echo "rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK token=$QM_EVENTS_TOKEN '
        'omp=$OMP_NUM_THREADS job=$QM_JOB_ID"; exit $((RANK + 4))'
    )
    spec = gang_spec(104, {"gpu-node-2": 1, "gpu-node-3": 1}, command=command)
    gang = spec.gang
    runtime.launch(spec)
    wait_for(lambda: all_in(runtime, gang, "exited", 2), timeout=30)
    observed = runtime.observe(gang)
    assert [o.exit_code for o in observed] == [4, 5]
    assert [o.node for o in observed] == ["gpu-node-2", "gpu-node-3"]
    assert runtime.read_log(gang, 1) == (
        b"rank=1 world=2 local=0 token=secret-token-104 omp=1 job=104\n"
    )
    assert runtime.read_log(gang, 0, offset=5, limit=7) == b"0 world"
    # Both ranks failed on their own: no rank is left waiting, so the gang
    # guard has nobody to stop.
    assert all(o.signal_sent_at is None for o in observed)
    assert gang_guard_victims(observed) == []


def test_watch_relists_when_its_resource_version_expired(
    make_runtime: MakeRuntime, k8s_api: client.ApiClient, namespace: str, control_plane: Any
):
    runtime = make_runtime()
    core = client.CoreV1Api(k8s_api)
    spec = gang_spec(105, {"gpu-node-1": 2})
    gang = spec.gang
    # A watcher that read the gang at this version and was then away too long.
    stale_version = core.list_namespaced_pod(namespace).metadata.resource_version
    runtime.launch(spec)
    wait_for(lambda: all_in(runtime, gang, "running", 2), timeout=30)
    control_plane.compact_etcd()
    stop = threading.Event()
    seen: dict[int, str] = {}

    def consume() -> None:
        for observation in runtime.watch_ranks(
            gang, stop=stop, resource_version=stale_version, timeout_seconds=5
        ):
            seen[observation.rank] = observation.phase

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    # The stale version answers 410 Gone; the ranks arrive from the re-list.
    wait_for(lambda: seen == {0: "running", 1: "running"}, timeout=15, what="relisted ranks")
    assert runtime.relists == 1
    runtime.signal(gang, 5)
    wait_for(lambda: seen == {0: "exited", 1: "exited"}, timeout=20, what="watched exits")
    stop.set()
    reader.join(timeout=10)


RENDEZVOUS = """
import os, socket, sys, time
rank = int(os.environ["RANK"])
address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
if rank == 0:
    server = socket.create_server(address)
    peers = []
    for _ in range(int(os.environ["WORLD_SIZE"]) - 1):
        connection, _ = server.accept()
        peers.append(connection.recv(16).decode())
    print("rank 0 met", ",".join(sorted(peers)))
else:
    deadline = time.time() + 20
    while True:
        try:
            with socket.create_connection(address, timeout=2) as connection:
                connection.sendall(f"rank{rank}".encode())
            break
        except OSError:
            if time.time() > deadline:
                sys.exit(3)
            time.sleep(0.1)
"""


def test_ranks_rendezvous_through_master_addr_and_port(
    make_runtime: MakeRuntime, namespace: str, tmp_path: Path
):
    script = tmp_path / "rendezvous.py"
    script.write_text(RENDEZVOUS)
    runtime = make_runtime(pod_annotations={ANNOTATION_RUN: "process"})
    spec = gang_spec(106, {"gpu-node-0": 2, "gpu-node-1": 1}, command=f"{sys.executable} {script}")
    gang = spec.gang
    runtime.launch(spec)
    wait_for(lambda: all_in(runtime, gang, "exited", 3), timeout=60, what="rendezvous done")
    assert [o.exit_code for o in runtime.observe(gang)] == [0, 0, 0]
    assert runtime.read_log(gang, 0) == b"rank 0 met rank1,rank2\n"


def test_namespace_per_team_runs_the_gang_in_a_namespace_it_creates(
    make_runtime: MakeRuntime, k8s_api: client.ApiClient, namespace: str
):
    runtime = make_runtime(namespace_per_team=True, team_namespace_prefix=f"{namespace}-")
    core = client.CoreV1Api(k8s_api)
    spec = gang_spec(108, {"gpu-node-2": 2})
    gang = spec.gang
    team_namespace = f"{namespace}-vision"
    try:

        def launched() -> bool:
            try:
                runtime.launch(spec)
            except RuntimeTemporaryError:
                # A fresh namespace refuses pods until its service account
                # exists; the next launch completes the objects still missing.
                return False
            return True

        # Bounded waits, not timings: a loaded machine's API server and agent are slow.
        wait_for(launched, timeout=120, what="launch in a fresh team namespace")
        assert runtime.namespace_for("vision") == team_namespace
        wait_for(lambda: all_in(runtime, gang, "running", 2), timeout=120)
        assert {p.metadata.namespace for p in core.list_pod_for_all_namespaces(
            label_selector="quartermaster.dev/gang=qm-108-1").items} == {team_namespace}  # fmt: skip
        assert len(runtime.observe()) == 2
        runtime.signal(gang, 5)
        wait_for(lambda: all_in(runtime, gang, "exited", 2), timeout=120)
        runtime.forget(gang)
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: not pods_left(core, team_namespace), timeout=120)
        # Empty, or what holds each pod that stayed.
        assert pods_left(core, team_namespace) == []
    finally:
        delete_namespace(core, team_namespace)


CHECKPOINTING_RANK = """
import signal, sys, time
def stop(*_):
    time.sleep(0.3)  # a checkpoint being written
    print("checkpointed", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("training", flush=True)
time.sleep(60)
"""


def test_sigterm_reaches_the_workload_behind_a_compound_command(
    make_runtime: MakeRuntime, namespace: str, tmp_path: Path
):
    script = tmp_path / "rank.py"
    script.write_text(CHECKPOINTING_RANK)
    runtime = make_runtime(pod_annotations={ANNOTATION_RUN: "process"})
    # The shell runs the workload as a child: only the entrypoint's forwarding
    # gets SIGTERM to it, and the shell reports the workload's own exit code.
    command = f"echo setting up; {sys.executable} {script}; echo must not run"
    spec = gang_spec(109, {"gpu-node-1": 2}, command=command, grace_seconds=20)
    gang = spec.gang
    runtime.launch(spec)
    wait_for(lambda: all(b"training" in runtime.read_log(gang, r) for r in range(2)), timeout=30)
    started = time.monotonic()
    runtime.signal(gang, 20)
    wait_for(lambda: all_in(runtime, gang, "exited", 2), timeout=30)
    assert time.monotonic() - started < 10  # well before the 20 s deadline
    assert [o.exit_code for o in runtime.observe(gang)] == [0, 0]
    for rank in range(2):
        assert runtime.read_log(gang, rank) == b"setting up\ntraining\ncheckpointed\n"
