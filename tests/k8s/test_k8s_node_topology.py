"""Topology labels on real Node objects reach the engine: the Kubernetes runtime reads
each node's domain at every level from the label keys QM_TOPOLOGY_LABELS configures,
the periodic sync writes them into the portal's nodes, and the next snapshot carries
them. A label removed from the Node is removed from the engine's input too."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client

from preemption import runtime as runtime_module
from preemption.runtimes.kubernetes import KubernetesRuntime
from preemption.snapshot import build_snapshot
from quotas.models import Node

RACK_KEY = "example.org/rack"
BLOCK_KEY = "example.org/block"
LEVELS = {"block": BLOCK_KEY, "rack": RACK_KEY}


@pytest.fixture
def labelled_nodes(k8s_api: client.ApiClient) -> Iterator[client.CoreV1Api]:
    """gpu-node-0 and -1 in rack r0, gpu-node-2 in rack r1, all in block b0; gpu-node-3
    without topology labels. The labels are taken off again afterwards."""
    core = client.CoreV1Api(k8s_api)
    layout = {"gpu-node-0": "r0", "gpu-node-1": "r0", "gpu-node-2": "r1"}
    for name, rack in layout.items():
        core.patch_node(name, {"metadata": {"labels": {BLOCK_KEY: "b0", RACK_KEY: rack}}})
    try:
        yield core
    finally:
        for name in layout:
            core.patch_node(name, {"metadata": {"labels": {BLOCK_KEY: None, RACK_KEY: None}}})


def test_node_labels_reach_the_engine_input(
    world: Any,
    settings: Any,
    labelled_nodes: client.CoreV1Api,
    make_runtime: Callable[..., KubernetesRuntime],
) -> None:
    settings.QM_RUNTIME = "kubernetes"
    settings.QM_TOPOLOGY_LABELS = LEVELS
    assert runtime_module.kubernetes_config().topology_labels == LEVELS
    for index in range(4):
        Node.objects.create(name=f"gpu-node-{index}", flavor=world.h100, gpus=8)
    runtime_module.use_runtime(make_runtime(topology_labels=LEVELS))
    try:
        assert runtime_module.sync_node_topology() == ["gpu-node-0", "gpu-node-1", "gpu-node-2"]
        topology = {node.name: dict(node.topology) for node in build_snapshot().nodes}
        assert topology["gpu-node-0"] == {"block": "b0", "rack": "r0"}
        assert topology["gpu-node-1"] == {"block": "b0", "rack": "r0"}
        assert topology["gpu-node-2"] == {"block": "b0", "rack": "r1"}
        assert topology["gpu-node-3"] == {}
        # The node moves out of its rack: the next sync takes the rack away.
        labelled_nodes.patch_node("gpu-node-2", {"metadata": {"labels": {RACK_KEY: None}}})
        assert runtime_module.sync_node_topology() == ["gpu-node-2"]
        topology = {node.name: dict(node.topology) for node in build_snapshot().nodes}
        assert topology["gpu-node-2"] == {"block": "b0"}
    finally:
        runtime_module.use_runtime(None)
