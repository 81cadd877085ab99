"""deploy/ manifests: accepted by a real API server, and RBAC enough for the runtime."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, utils
from kubernetes.client.exceptions import ApiException

from preemption.runtimes.kubernetes import (
    KubernetesRuntime,
    KubernetesRuntimeConfig,
    PriorityClassSpec,
    reconcile_priority_classes,
)
from tools.k8s.gangs import all_in, gang_spec
from tools.k8s.node_agent import NodeAgent
from tools.k8s.wait import wait_for

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = (
    "namespaces.yaml",
    "rbac.yaml",
    "config.yaml",
    "checkpoints.yaml",
    "web.yaml",
    "worker.yaml",
    "beat.yaml",
)


def documents(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / name).read_text()) if doc]


@pytest.fixture
def installed(k8s_api: client.ApiClient, node_agent: NodeAgent) -> Iterator[None]:
    """Namespaces and RBAC from deploy/ applied for real; removed afterwards."""
    for name in ("namespaces.yaml", "rbac.yaml"):
        for doc in documents(name):
            utils.create_from_dict(k8s_api, doc)
    yield
    core = client.CoreV1Api(k8s_api)
    rbac = client.RbacAuthorizationV1Api(k8s_api)
    rbac.delete_cluster_role_binding("quartermaster-cluster")
    rbac.delete_cluster_role("quartermaster-cluster")
    for namespace in ("quartermaster", "quartermaster-system"):
        core.delete_namespace(namespace)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        names = {ns.metadata.name for ns in core.list_namespace().items}
        if not names & {"quartermaster", "quartermaster-system"}:
            return
        for pod in core.list_namespaced_pod("quartermaster").items:
            if pod.metadata.finalizers:
                try:
                    core.patch_namespaced_pod(
                        pod.metadata.name,
                        "quartermaster",
                        [{"op": "replace", "path": "/metadata/finalizers", "value": []}],
                    )
                except ApiException as error:
                    if error.status not in (404, 409, 422):
                        raise
        time.sleep(0.2)
    raise TimeoutError("deploy namespaces were not removed")


def service_account_client(k8s_api: client.ApiClient, kubeconfig_ca: str) -> client.ApiClient:
    """An API client that authenticates as the portal worker's service account."""
    core = client.CoreV1Api(k8s_api)
    token = core.create_namespaced_service_account_token(
        "quartermaster-worker",
        "quartermaster-system",
        {"spec": {"expirationSeconds": 3600}},
    ).status.token
    configuration = client.Configuration()
    configuration.host = k8s_api.configuration.host
    configuration.ssl_ca_cert = kubeconfig_ca
    configuration.api_key = {"authorization": f"Bearer {token}"}
    configuration.connection_pool_maxsize = 32
    return client.ApiClient(configuration)


def test_workload_manifests_pass_server_side_validation(k8s_api: client.ApiClient, installed: None):
    for name in ("config.yaml", "checkpoints.yaml", "web.yaml", "worker.yaml", "beat.yaml"):
        for doc in documents(name):
            # A dry run goes through defaulting, validation and admission.
            utils.create_from_dict(k8s_api, doc, dry_run="All")
    deployments = [
        doc for name in MANIFESTS for doc in documents(name) if doc["kind"] == "Deployment"
    ]
    assert {d["metadata"]["name"] for d in deployments} == {
        "quartermaster-web",
        "quartermaster-worker",
        "quartermaster-beat",
    }
    web = next(d for d in deployments if d["metadata"]["name"] == "quartermaster-web")
    container = web["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for deployment in deployments:
        probe_container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert "livenessProbe" in probe_container and "readinessProbe" in probe_container


def test_the_runtime_works_with_exactly_the_deployed_permissions(
    k8s_api: client.ApiClient, installed: None, control_plane: Any, test_priority_classes: Any
):
    api = service_account_client(k8s_api, str(control_plane.pki / "ca.crt"))
    runtime = KubernetesRuntime(
        api,
        KubernetesRuntimeConfig(namespace="quartermaster", default_image="none"),
    )
    try:
        assert {n.name for n in runtime.nodes()} >= {"gpu-node-0", "gpu-node-1"}
        spec = gang_spec(301, {"gpu-node-0": 1, "gpu-node-1": 1})
        gang = spec.gang
        runtime.launch(spec)
        wait_for(lambda: all_in(runtime, gang, "running", 2), timeout=60)
        assert b"simulated container" in runtime.read_log(gang, 0)
        runtime.signal(gang, 5)
        runtime.kill(gang)
        wait_for(lambda: all_in(runtime, gang, "exited", 2), timeout=30)
        runtime.forget(gang)
        wait_for(lambda: runtime.observe(gang) == [], timeout=30)

        result = reconcile_priority_classes(api, [PriorityClassSpec("qm-rbac-check", 7)])
        assert result.created == ("qm-rbac-check",)
        assert reconcile_priority_classes(api, []).deleted == ("qm-rbac-check",)

        # And nothing beyond: the service account cannot read Secrets.
        with pytest.raises(ApiException) as refused:
            client.CoreV1Api(api).list_namespaced_secret("quartermaster")
        assert refused.value.status == 403
    finally:
        runtime.close()
