"""Fixtures for tests against a real Kubernetes control plane.

The control plane is session-scoped: one started with
``python -m tools.k8s.controlplane up`` (as ``make test`` does) is reused, and
otherwise the session builds (if needed) and starts its own and stops it at the
end. A node agent plays the kubelet for four 8-GPU nodes. Each test gets a
fresh namespace, deleted (with every pod in it gone) afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kubernetes import client, config  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402

from preemption.runtimes.kubernetes import (  # noqa: E402
    KubernetesRuntime,
    KubernetesRuntimeConfig,
)
from tools.k8s.agent_state import NodeSpec  # noqa: E402
from tools.k8s.controlplane import ControlPlane  # noqa: E402
from tools.k8s.node_agent import NodeAgent  # noqa: E402

BUILD_HELM = REPO_ROOT / "tools" / "k8s" / "build-helm.sh"
GPU_NODES = tuple(NodeSpec(name=f"gpu-node-{i}", gpus=8, flavor="h100") for i in range(4))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test in this folder needs the control plane: mark it ``k8s``."""
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.k8s)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A running control plane: the shared one if it is up, else one for this session."""
    shared = ControlPlane.attach()
    if shared is not None:
        yield shared
        return
    plane = ControlPlane(run_dir=tmp_path_factory.mktemp("k8s-control-plane"), die_with_parent=True)
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def kubeconfig(control_plane: ControlPlane) -> str:
    """Path of the admin kubeconfig."""
    assert control_plane.state is not None
    return control_plane.state.kubeconfig


@pytest.fixture(scope="session")
def k8s_api(kubeconfig: str) -> Iterator[client.ApiClient]:
    """An admin API client with room for many concurrent requests."""
    configuration = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    configuration.connection_pool_maxsize = 32
    api = client.ApiClient(configuration)
    yield api
    api.close()


@contextmanager
def running_agent(
    control_plane: ControlPlane,
    kubeconfig: str,
    nodes: Sequence[NodeSpec],
    work_dir: Path,
    *,
    pool_size: int,
    run_processes: bool = False,
    run_as_pod_users: bool = False,
) -> Iterator[NodeAgent]:
    """A started node agent for ``nodes`` on its own API client, stopped afterwards."""
    configuration = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    configuration.connection_pool_maxsize = pool_size
    api = client.ApiClient(configuration)
    pki = control_plane.pki
    agent = NodeAgent(
        api,
        nodes,
        work_dir=work_dir,
        serving_cert=(pki / "apiserver.crt", pki / "apiserver.key"),
        run_processes=run_processes,
        run_as_pod_users=run_as_pod_users,
    )
    agent.start()
    try:
        yield agent
    finally:
        agent.stop()
        api.close()


@pytest.fixture(scope="session")
def node_agent(
    control_plane: ControlPlane, kubeconfig: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NodeAgent]:
    """The kubelet stand-in for GPU_NODES."""
    with running_agent(
        control_plane, kubeconfig, GPU_NODES, tmp_path_factory.mktemp("node-agent"), pool_size=32
    ) as agent:
        yield agent


@pytest.fixture
def namespace(k8s_api: client.ApiClient, node_agent: NodeAgent) -> Iterator[str]:
    """A fresh namespace with its default service account; removed after the test."""
    with fresh_namespace(k8s_api, "qm-test") as name:
        yield name


@contextmanager
def fresh_namespace(k8s_api: client.ApiClient, prefix: str) -> Iterator[str]:
    """A new namespace named `prefix-<random>`, once its default service account
    exists; deleted, with everything in it, on leaving."""
    core = client.CoreV1Api(k8s_api)
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    deadline = time.monotonic() + 30
    while True:
        try:
            core.read_namespaced_service_account("default", name)
            break
        except ApiException as error:
            if error.status != 404 or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    try:
        yield name
    finally:
        delete_namespace(core, name)


def delete_namespace(core: client.CoreV1Api, name: str, timeout: float = 60.0) -> None:
    """Delete a namespace and wait until it is gone, pods and gang records with it, so
    their GPUs are free and no later listing across namespaces still sees them."""
    core.delete_namespace(name)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            core.read_namespace(name)
        except ApiException as error:
            if error.status == 404:
                return
            raise
        for pod in core.list_namespaced_pod(name).items:
            # A test may end before forget(): release exit-code finalizers so
            # the namespace controller can finish.
            if pod.metadata.finalizers:
                try:
                    core.patch_namespaced_pod(
                        pod.metadata.name,
                        name,
                        [{"op": "replace", "path": "/metadata/finalizers", "value": []}],
                    )
                except ApiException as error:
                    if error.status not in (404, 409, 422):
                        raise
        time.sleep(0.2)
    raise TimeoutError(f"namespace {name} was not removed")


LOW_PRIORITY = "qm-test-low"
HIGH_PRIORITY = "qm-test-high"


@pytest.fixture(scope="session")
def test_priority_classes(k8s_api: client.ApiClient) -> Iterator[dict[str, int]]:
    """Two PriorityClasses for gang tests, deliberately not owned by Quartermaster."""
    scheduling = client.SchedulingV1Api(k8s_api)
    classes = {LOW_PRIORITY: 100, HIGH_PRIORITY: 1000}
    for name, value in classes.items():
        try:
            scheduling.create_priority_class(
                {
                    "apiVersion": "scheduling.k8s.io/v1",
                    "kind": "PriorityClass",
                    "metadata": {"name": name},
                    "value": value,
                    "preemptionPolicy": "PreemptLowerPriority",
                }
            )
        except ApiException as error:
            if error.status != 409:
                raise
    yield classes
    for name in classes:
        try:
            scheduling.delete_priority_class(name)
        except ApiException as error:
            if error.status != 404:
                raise


@pytest.fixture
def make_runtime(
    kubeconfig: str, namespace: str, test_priority_classes: dict[str, int]
) -> Iterator[Callable[..., KubernetesRuntime]]:
    """Build KubernetesRuntimes on the test namespace; closed after the test."""
    made: list[KubernetesRuntime] = []

    def make(**settings: Any) -> KubernetesRuntime:
        settings.setdefault("namespace", namespace)
        settings.setdefault("default_image", "registry.invalid/never-pulled:1")
        runtime = KubernetesRuntime.from_kubeconfig(kubeconfig, KubernetesRuntimeConfig(**settings))
        made.append(runtime)
        return runtime

    yield make
    for runtime in made:
        runtime.close()


@dataclass(frozen=True)
class Helm:
    """The helm binary and an environment that keeps its config and cache in a temporary folder."""

    binary: str
    env: dict[str, str]

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.binary, *args], capture_output=True, text=True, timeout=300, env=self.env
        )


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """Helm, built from the Go module proxy if it is not cached yet."""
    built = subprocess.run(["bash", str(BUILD_HELM)], capture_output=True, text=True, timeout=3600)
    assert built.returncode == 0, built.stderr[-4000:]
    binary = built.stdout.strip().splitlines()[-1]
    assert os.access(binary, os.X_OK), binary
    home = tmp_path_factory.mktemp("helm-home")
    env = dict(os.environ)
    for kind in ("CACHE", "CONFIG", "DATA"):
        env[f"HELM_{kind}_HOME"] = str(home / kind.lower())
    return Helm(binary, env)
