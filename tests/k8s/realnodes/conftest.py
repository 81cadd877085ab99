"""Real kubelets for the Kubernetes tests: two nodes with containerd and runc.

``real_nodes`` starts them once per session on the session's control plane
(``tools.k8s.realnodes``) and takes them down at the end; a machine that cannot
run them (not root, no overlayfs, no containerd) skips these tests and says why.
The ``namespace`` here does not start the node agent: pods of these tests run
on the real nodes only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from preemption.runtimes.kubernetes import KubernetesRuntimeConfig
from tests.k8s.conftest import fresh_namespace
from tools.k8s.controlplane import REPO_ROOT, ControlPlane
from tools.k8s.realnodes import RealNodes, unavailable_reason

REAL_NODE_NAMES = ("real-node-0", "real-node-1")
# The drill's nodes (drills.setup names them so): 4 GPUs each, so 8 ranks span both.
DRILL_NODE_NAMES = ("drill-node-0", "drill-node-1")
DRILL_GPUS_PER_NODE = 4


def _report(config: pytest.Config, line: str) -> None:
    """A line in the terminal whether or not output is captured."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)


def require_real_nodes() -> None:
    """Skip, loudly and with the reason, where this machine cannot run a kubelet (not
    root, no overlayfs, no containerd...): the one place the real-node tier skips."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"REAL NODES CANNOT RUN ON THIS MACHINE: {reason}")


@pytest.fixture(scope="session")
def real_nodes(
    request: pytest.FixtureRequest,
    control_plane: ControlPlane,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RealNodes]:
    """Two real nodes (containerd + kubelet v1.34) with 8 GPUs each, Ready."""
    require_real_nodes()
    nodes = RealNodes(control_plane, tmp_path_factory.mktemp("real-nodes"), names=REAL_NODE_NAMES)
    nodes.start()
    _report(
        request.config,
        "real nodes up: "
        + ", ".join(f"{step} {seconds:.1f} s" for step, seconds in nodes.timings.items()),
    )
    try:
        yield nodes
    finally:
        nodes.stop()
        _report(request.config, f"real nodes down in {nodes.timings['stop']:.1f} s")


@pytest.fixture
def namespace(k8s_api: client.ApiClient, real_nodes: RealNodes) -> Iterator[str]:
    """A fresh namespace with its default service account (no node agent); removed after."""
    with fresh_namespace(k8s_api, "qm-real") as name:
        yield name


@pytest.fixture
def drill_folder(tmp_path: Path) -> Path:
    """A folder every container of the nodes may write to (the drill's QM_VAR_DIR)."""
    folder = tmp_path / "var"
    folder.mkdir()
    return folder


@pytest.fixture
def drill_nodes(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory, drill_folder: Path
) -> Iterator[RealNodes]:
    """drill-node-0 and drill-node-1, 4 GPUs each, whose containers see the host's Python."""
    require_real_nodes()
    python_prefix = Path(os.path.realpath(sys.executable)).parents[1]
    nodes = RealNodes(
        control_plane,
        # Short: containerd's socket paths below it must stay under 104 characters.
        tmp_path_factory.mktemp("nodes"),
        names=DRILL_NODE_NAMES,
        gpus=DRILL_GPUS_PER_NODE,
        flavor="drill-gpu",
        host_mounts=(
            ("/usr", False),
            (str(python_prefix), False),
            (str(REPO_ROOT), False),
            (str(drill_folder), True),
        ),
        image_aliases=(KubernetesRuntimeConfig().default_image,),
    )
    nodes.start()
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture
def drill_namespace(k8s_api: client.ApiClient, drill_nodes: RealNodes) -> Iterator[str]:
    """A fresh namespace for the drill's pods, on the drill's nodes."""
    with fresh_namespace(k8s_api, "qm-drill") as name:
        yield name
