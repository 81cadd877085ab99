"""The test control plane and its node agent behave like a cluster with kubelets."""

from __future__ import annotations

import time
from typing import Any

from kubernetes import client

from tools.k8s.agent_state import ANNOTATION_RUN
from tools.k8s.node_agent import NodeAgent
from tools.k8s.wait import wait_for


def process_pod(name: str, script: str, *, grace: int = 30, gpus: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": {ANNOTATION_RUN: "process"}},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": grace,
            "containers": [
                {
                    "name": "main",
                    "image": "none",
                    "command": ["/bin/sh", "-c", script],
                    "env": [
                        {"name": "GREETING", "value": "hello"},
                        {
                            "name": "POD_NAME",
                            "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                        },
                    ],
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ],
        },
    }


def pod_log(core: client.CoreV1Api, name: str, namespace: str) -> str:
    """The pod's log so far: empty while its container has not started (the API server
    answers 400 or 404 until the node serves a log), and an empty log comes back as None."""
    try:
        return core.read_namespaced_pod_log(name, namespace) or ""
    except client.exceptions.ApiException as error:
        if error.status in (400, 404):
            return ""
        raise


def terminated(core: client.CoreV1Api, name: str, namespace: str) -> Any:
    pod = core.read_namespaced_pod(name, namespace)
    for status in pod.status.container_statuses or []:
        if status.state.terminated is not None:
            return pod
    return None


def test_nodes_are_ready_with_gpu_capacity(k8s_api: client.ApiClient, node_agent: NodeAgent):
    core = client.CoreV1Api(k8s_api)
    nodes = {node.metadata.name: node for node in core.list_node().items}
    assert set(node_agent.nodes) <= set(nodes)
    for name in node_agent.nodes:
        node = nodes[name]
        assert node.status.allocatable["nvidia.com/gpu"] == "8"
        ready = [c for c in node.status.conditions if c.type == "Ready"]
        assert ready[0].status == "True"
        assert not node.spec.taints


def test_process_pod_runs_its_command_and_reports_the_exit_code(
    k8s_api: client.ApiClient, namespace: str
):
    core = client.CoreV1Api(k8s_api)
    core.create_namespaced_pod(
        namespace, process_pod("exits-3", 'echo "$GREETING from $POD_NAME"; exit 3')
    )
    pod = wait_for(lambda: terminated(core, "exits-3", namespace))
    assert pod.spec.node_name.startswith("gpu-node-")
    assert pod.status.phase == "Failed"
    assert pod.status.container_statuses[0].state.terminated.exit_code == 3
    # The log travels API server -> node agent's kubelet endpoint, as kubectl logs does.
    log = core.read_namespaced_pod_log("exits-3", namespace, container="main")
    assert log == "hello from exits-3\n"


def test_graceful_deletion_sends_sigterm_then_deletes_the_object(
    k8s_api: client.ApiClient, namespace: str
):
    core = client.CoreV1Api(k8s_api)
    script = "trap 'echo got TERM; exit 0' TERM; echo started; while true; do sleep 0.05; done"
    core.create_namespaced_pod(namespace, process_pod("traps-term", script))
    wait_for(lambda: core.read_namespaced_pod("traps-term", namespace).status.phase == "Running")
    wait_for(lambda: "started" in pod_log(core, "traps-term", namespace))
    core.delete_namespaced_pod(
        "traps-term", namespace, body=client.V1DeleteOptions(grace_period_seconds=20)
    )
    started = time.monotonic()

    def gone() -> bool:
        return not [p for p in core.list_namespaced_pod(namespace).items]

    wait_for(gone, timeout=15)
    # It left well inside its 20 s grace: SIGTERM arrived at once.
    assert time.monotonic() - started < 10


def test_sigkill_at_the_grace_deadline(k8s_api: client.ApiClient, namespace: str):
    core = client.CoreV1Api(k8s_api)
    script = "trap '' TERM; echo started; while true; do sleep 0.05; done"
    pod = process_pod("ignores-term", script, grace=2)
    # Keep the object after deletion so the final status can be read.
    pod["metadata"]["finalizers"] = ["quartermaster.dev/test-hold"]
    core.create_namespaced_pod(namespace, pod)
    wait_for(lambda: "started" in pod_log(core, "ignores-term", namespace))
    started = time.monotonic()
    core.delete_namespaced_pod("ignores-term", namespace)
    pod = wait_for(lambda: terminated(core, "ignores-term", namespace), timeout=15)
    elapsed = time.monotonic() - started
    assert pod.status.container_statuses[0].state.terminated.exit_code == 137
    assert 1.5 <= elapsed < 8
