"""RBAC grants each component exactly the verbs its code calls.

The API requests the runtime makes over gangs' whole lives are recorded on
the client (method and path, turned into RBAC verb, API group and resource)
and compared with the rules in deploy/: every verb used is granted, and
nothing is granted that is not used. Then the real API server judges the
deployed service accounts: the web's cannot create or delete pods.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, utils

from preemption.runtimes.kubernetes import (
    KubernetesRuntime,
    KubernetesRuntimeConfig,
    PriorityClassSpec,
    reconcile_priority_classes,
)
from tests.k8s.conftest import delete_namespace
from tests.k8s.test_k8s_deploy_manifests import installed  # noqa: F401 - a fixture
from tools.k8s.gangs import all_in, gang_spec
from tools.k8s.node_agent import NodeAgent
from tools.k8s.requests import Grant, Recorder, grant_of
from tools.k8s.wait import wait_for

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def granted(*names: tuple[str, str]) -> set[Grant]:
    """Every (group, resource, verb) the named (file, role) rules grant."""
    grants: set[Grant] = set()
    for file, role in names:
        for doc in yaml.safe_load_all((DEPLOY / file).read_text()):
            if doc and doc["kind"] in ("Role", "ClusterRole") and doc["metadata"]["name"] == role:
                for rule in doc["rules"]:
                    for group in rule["apiGroups"]:
                        for resource in rule["resources"]:
                            for verb in rule["verbs"]:
                                grants.add((group, resource, verb))
    return grants


def test_grant_of_table() -> None:
    cases = [
        ("GET", "/api/v1/namespaces/q/pods?labelSelector=x", ("", "pods", "list")),
        ("GET", "/api/v1/pods?labelSelector=x", ("", "pods", "list")),
        ("GET", "/api/v1/namespaces/q/pods?watch=true", ("", "pods", "watch")),
        ("POST", "/api/v1/namespaces/q/pods/p/eviction", ("", "pods/eviction", "create")),
        ("GET", "/api/v1/namespaces/q/pods/p/log?limitBytes=3", ("", "pods/log", "get")),
        ("PATCH", "/api/v1/namespaces/q/configmaps/c", ("", "configmaps", "patch")),
        ("POST", "/api/v1/namespaces", ("", "namespaces", "create")),
        ("DELETE", "/apis/scheduling.k8s.io/v1/priorityclasses/x", ("scheduling.k8s.io", "priorityclasses", "delete")),
        ("POST", "/apis/networking.k8s.io/v1/namespaces/q/networkpolicies", ("networking.k8s.io", "networkpolicies", "create")),
    ]  # fmt: skip
    for method, url, expected in cases:
        assert grant_of(method, "https://h:1" + url) == expected, url


def _gang_life(runtime: KubernetesRuntime, job_id: int, node: str) -> None:
    """Everything the worker does to a gang, from launch to forget."""
    runtime.nodes()
    spec = gang_spec(job_id, {node: 2})
    runtime.launch(spec)
    gang = spec.gang
    wait_for(lambda: all_in(runtime, gang, "running", 2), timeout=60, what="ranks running")
    runtime.guard_victims()
    runtime.disruptions(gang)
    runtime.publish_preemption_risk(gang, 600.0, team=spec.team)
    runtime.signal(gang, 5)
    runtime.kill(gang)
    wait_for(lambda: all_in(runtime, gang, "exited", 2), timeout=30, what="ranks exited")
    runtime.released_ports([gang])
    runtime.read_log(gang, 0)
    runtime.read_log_tail(gang, 1, 4096)
    runtime.forget(gang)


def _recording_runtime(kubeconfig: str, **settings: Any) -> tuple[KubernetesRuntime, Recorder]:
    runtime = KubernetesRuntime.from_kubeconfig(kubeconfig, KubernetesRuntimeConfig(**settings))
    return runtime, Recorder(runtime.api_client)


def test_worker_and_web_rules_match_the_calls(
    kubeconfig: str,
    k8s_api: client.ApiClient,
    namespace: str,
    node_agent: NodeAgent,
    test_priority_classes: Any,
) -> None:
    worker, worker_calls = _recording_runtime(
        kubeconfig, namespace=namespace, default_image="none", watch_pods=True
    )
    web, web_calls = _recording_runtime(kubeconfig, namespace=namespace)
    try:
        spec = gang_spec(701, {"gpu-node-0": 1})
        worker.launch(spec)
        wait_for(lambda: all_in(worker, spec.gang, "running", 1), timeout=60)
        web.read_log(spec.gang, 0)  # what the web process does: read a log
        worker.kill(spec.gang)
        wait_for(lambda: all_in(worker, spec.gang, "exited", 1), timeout=30)
        worker.forget(spec.gang)
        _gang_life(worker, 702, "gpu-node-1")
    finally:
        worker.close()
        web.close()
    # The PriorityClass reconcile: create, patch a drifted description,
    # replace a changed value, delete.
    api = client.ApiClient(k8s_api.configuration)
    reconciler_calls = Recorder(api)
    try:
        reconcile_priority_classes(api, [PriorityClassSpec("qm-rbac-a", 7)])
        reconcile_priority_classes(api, [PriorityClassSpec("qm-rbac-a", 7, description="drift")])
        reconcile_priority_classes(api, [PriorityClassSpec("qm-rbac-a", 8)])
        reconcile_priority_classes(api, [])
    finally:
        api.close()

    used = worker_calls.grants | reconciler_calls.grants
    assert used == granted(
        ("rbac.yaml", "quartermaster-runtime"), ("rbac.yaml", "quartermaster-cluster")
    )
    assert web_calls.grants == granted(("rbac.yaml", "quartermaster-web"))
    assert not {g for g in web_calls.grants if g[1] == "pods" and g[2] in ("create", "delete")}


def test_namespace_per_team_rules_match_the_calls(
    kubeconfig: str, k8s_api: client.ApiClient, node_agent: NodeAgent, test_priority_classes: Any
) -> None:
    prefix = "qm-rbac-"
    worker, calls = _recording_runtime(
        kubeconfig,
        namespace_per_team=True,
        team_namespace_prefix=prefix,
        default_image="none",
        watch_pods=True,
    )
    web, web_calls = _recording_runtime(
        kubeconfig, namespace_per_team=True, team_namespace_prefix=prefix
    )
    try:
        spec = gang_spec(703, {"gpu-node-2": 1})
        worker.launch(spec)
        wait_for(lambda: all_in(worker, spec.gang, "running", 1), timeout=60)
        web.read_log(spec.gang, 0)
        worker.kill(spec.gang)
        wait_for(lambda: all_in(worker, spec.gang, "exited", 1), timeout=30)
        worker.forget(spec.gang)
        _gang_life(worker, 704, "gpu-node-3")
    finally:
        worker.close()
        web.close()
        delete_namespace(client.CoreV1Api(k8s_api), f"{prefix}vision")
    cluster = granted(("rbac.yaml", "quartermaster-cluster"))
    # PriorityClasses are the same calls in both modes (checked above).
    per_team = {g for g in cluster if g[1] == "nodes"} | granted(
        ("rbac-namespace-per-team.yaml", "quartermaster-runtime-per-team")
    )
    assert calls.grants == per_team
    assert web_calls.grants == granted(
        ("rbac-namespace-per-team.yaml", "quartermaster-web-per-team")
    )


def _allowed(
    k8s_api: client.ApiClient, account: str, verb: str, resource: str, sub: str = ""
) -> bool:
    review = client.AuthorizationV1Api(k8s_api).create_subject_access_review(
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": f"system:serviceaccount:quartermaster-system:{account}",
                "resourceAttributes": {
                    "namespace": "quartermaster",
                    "verb": verb,
                    "resource": resource,
                    "subresource": sub,
                },
            },
        }
    )
    return bool(review.status.allowed)


def test_the_api_server_holds_each_component_to_its_rules(
    k8s_api: client.ApiClient,
    installed: None,  # noqa: F811
) -> None:
    for verb in ("create", "delete", "patch"):
        assert not _allowed(k8s_api, "quartermaster-web", verb, "pods")
    assert not _allowed(k8s_api, "quartermaster-web", "create", "pods", "eviction")
    assert _allowed(k8s_api, "quartermaster-web", "get", "pods", "log")
    assert _allowed(k8s_api, "quartermaster-worker", "create", "pods")
    assert _allowed(k8s_api, "quartermaster-worker", "create", "pods", "eviction")
    assert not _allowed(k8s_api, "quartermaster-worker", "get", "secrets")
    assert not _allowed(k8s_api, "quartermaster-worker", "create", "namespaces")
    for verb in ("get", "list", "create"):
        assert not _allowed(k8s_api, "quartermaster-beat", verb, "pods")
    # Namespace-per-team mode adds what only it needs.
    documents = [
        doc
        for doc in yaml.safe_load_all((DEPLOY / "rbac-namespace-per-team.yaml").read_text())
        if doc
    ]
    for doc in documents:
        utils.create_from_dict(k8s_api, doc)
    try:
        assert _allowed(k8s_api, "quartermaster-worker", "create", "namespaces")
        assert not _allowed(k8s_api, "quartermaster-web", "create", "namespaces")
    finally:
        rbac = client.RbacAuthorizationV1Api(k8s_api)
        for doc in documents:
            if doc["kind"] == "ClusterRoleBinding":
                rbac.delete_cluster_role_binding(doc["metadata"]["name"])
            else:
                rbac.delete_cluster_role(doc["metadata"]["name"])
