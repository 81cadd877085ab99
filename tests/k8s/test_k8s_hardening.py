"""Rank pods meet the Pod Security Standard "restricted", as the real API server judges it.

Namespaces here carry ``pod-security.kubernetes.io/enforce: restricted``, so
kube-apiserver's PodSecurity admission refuses a non-compliant pod at create.
NetworkPolicy objects are checked as objects only: the test control plane has
no CNI plugin, so nothing enforces them here.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from preemption.runtimes.base import RuntimePermanentError
from preemption.runtimes.kubernetes import KubernetesRuntime
from preemption.runtimes.kubernetes.config import (
    GANG_LABEL,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    gang_name,
    team_namespace,
)
from preemption.runtimes.kubernetes.policies import NETWORK_POLICY_NAME, namespace_labels
from tests.k8s.conftest import delete_namespace
from tools.k8s.gangs import all_in, gang_spec
from tools.k8s.wait import wait_for

MakeRuntime = Callable[..., KubernetesRuntime]


@pytest.fixture
def restricted(k8s_api: client.ApiClient, namespace: str) -> str:
    client.CoreV1Api(k8s_api).patch_namespace(
        namespace, {"metadata": {"labels": namespace_labels()}}
    )
    return namespace


def test_every_rank_pod_is_admitted_as_restricted(
    make_runtime: MakeRuntime, k8s_api: client.ApiClient, restricted: str
) -> None:
    core = client.CoreV1Api(k8s_api)
    runtime = make_runtime(
        job_uid_base=4242,
        cpu_per_gpu={"h100": "12"},
        memory_per_gpu={"h100": "100Gi"},
        events_cidrs=("10.20.0.0/16",),
        events_port=8443,
    )
    spec = gang_spec(401, {"gpu-node-0": 2, "gpu-node-1": 2}, gpus_per_rank=2)
    runtime.launch(spec)  # any refused pod would raise here
    wait_for(lambda: all_in(runtime, spec.gang, "running", 4), timeout=60, what="4 ranks running")
    pods = core.list_namespaced_pod(restricted).items
    assert len(pods) == 4
    for pod in pods:
        assert pod.spec.automount_service_account_token is False
        assert pod.spec.security_context.run_as_non_root is True
        # Job 401 runs as the base plus its id.
        assert pod.spec.security_context.run_as_user == 4242 + 401
        assert pod.spec.security_context.seccomp_profile.type == "RuntimeDefault"
        container = pod.spec.containers[0]
        context = container.security_context
        assert context.allow_privilege_escalation is False
        assert context.capabilities.drop == ["ALL"]
        assert context.seccomp_profile.type == "RuntimeDefault"
        expected = {
            "nvidia.com/gpu": "2",
            "cpu": "24",
            "memory": "200Gi",
            "ephemeral-storage": "40Gi",
        }
        assert container.resources.requests == expected
        assert container.resources.limits == expected

    # The same pod without the hardening is refused by the API server itself.
    bare = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "not-hardened"},
        "spec": {"containers": [{"name": "c", "image": "registry.invalid/x:1"}]},
    }
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod(restricted, bare)
    assert refused.value.status == 403
    message = json.loads(refused.value.body)["message"]
    assert 'violates PodSecurity "restricted:latest"' in message
    assert "runAsNonRoot" in message and "allowPrivilegeEscalation" in message
    assert "not-hardened" not in {
        p.metadata.name for p in core.list_namespaced_pod(restricted).items
    }

    # NetworkPolicies: the namespace default-deny, and one per gang.
    networking = client.NetworkingV1Api(k8s_api)
    runtime.ensure_network_policy(restricted)
    runtime.ensure_network_policy(restricted)  # idempotent
    other = gang_spec(402, {"gpu-node-2": 1})
    runtime.launch(other)
    policies = {
        p.metadata.name: p for p in networking.list_namespaced_network_policy(restricted).items
    }
    assert set(policies) == {NETWORK_POLICY_NAME, gang_name(spec.gang), gang_name(other.gang)}
    default = policies[NETWORK_POLICY_NAME].spec
    assert default.pod_selector.match_labels == {MANAGED_BY_LABEL: MANAGED_BY}
    assert default.policy_types == ["Ingress", "Egress"]
    assert not default.ingress
    [dns, events] = default.egress
    assert {p.port for p in dns.ports} == {53}
    assert [peer.ip_block.cidr for peer in events.to] == ["10.20.0.0/16"]
    assert [p.port for p in events.ports] == [8443]
    for gang in (spec.gang, other.gang):
        policy = policies[gang_name(gang)].spec
        own = {GANG_LABEL: gang_name(gang)}
        assert policy.pod_selector.match_labels == own
        assert [peer.pod_selector.match_labels for peer in policy.ingress[0]._from] == [own]
        assert [peer.pod_selector.match_labels for peer in policy.egress[0].to] == [own]
    # A gang's policy is garbage-collected with its gang record.
    record = client.CoreV1Api(k8s_api).read_namespaced_config_map(gang_name(spec.gang), restricted)
    owners = policies[gang_name(spec.gang)].metadata.owner_references
    assert [o.uid for o in owners] == [record.metadata.uid]


def test_an_image_outside_the_team_allow_list_is_refused(
    make_runtime: MakeRuntime, k8s_api: client.ApiClient, namespace: str
) -> None:
    runtime = make_runtime(image_allowlist={"vision": ("registry.example.org/vision/",)})
    spec = gang_spec(403, {"gpu-node-0": 1})
    with pytest.raises(RuntimePermanentError, match="not allowed for team vision"):
        runtime.launch(spec)
    core = client.CoreV1Api(k8s_api)
    assert core.list_namespaced_pod(namespace).items == []
    assert (
        core.list_namespaced_config_map(
            namespace, label_selector=f"{MANAGED_BY_LABEL}={MANAGED_BY}"
        ).items
        == []
    )


def test_team_namespaces_are_valid_distinct_and_restricted(
    make_runtime: MakeRuntime, k8s_api: client.ApiClient
) -> None:
    core = client.CoreV1Api(k8s_api)
    prefix = f"qm-{uuid.uuid4().hex[:6]}-"
    runtime = make_runtime(namespace_per_team=True, team_namespace_prefix=prefix)
    created = []
    try:
        for job_id, team in ((404, "Team_A"), (405, "team_a")):
            spec = gang_spec(job_id, {"gpu-node-3": 1})
            spec = type(spec)(**{**{n: getattr(spec, n) for n in spec.__slots__}, "team": team})
            runtime.launch(spec)
            name = team_namespace(prefix, team)
            created.append(name)
            labels = core.read_namespace(name).metadata.labels
            assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
            policies = client.NetworkingV1Api(k8s_api).list_namespaced_network_policy(name).items
            assert NETWORK_POLICY_NAME in {p.metadata.name for p in policies}
            wait_for(lambda s=spec: all_in(runtime, s.gang, "running", 1), timeout=60)
        assert len(set(created)) == 2
    finally:
        for name in created:
            delete_namespace(core, name)
