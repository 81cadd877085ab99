"""What a jobs namespace enforces, and the cluster's PriorityClasses.

It owns the namespaces' labels (Pod Security "restricted"), the default-deny
NetworkPolicy of a jobs namespace and each gang's own, the PriorityClass
reconcile that makes the cluster's classes match the portal's. Nothing here
touches a rank pod (PodDisruptionBudgets are the cluster's own: evict.py meets
them), and it never reads the models: the portal hands it plain values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from preemption.runtimes.base import GangId
from preemption.runtimes.kubernetes.cluster import Cluster, translate
from preemption.runtimes.kubernetes.config import (
    GANG_LABEL,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    KubernetesRuntimeConfig,
    gang_name,
)


def ensure_namespace(cluster: Cluster, namespace: str) -> None:
    """Create a team's jobs namespace (with namespace_labels) if it is missing."""
    try:
        cluster.core.create_namespace(
            {"metadata": {"name": namespace, "labels": namespace_labels()}}
        )
    except ApiException as error:
        if error.status != 409:
            raise translate(error, f"create namespace {namespace}") from error


def ensure_network_policy(cluster: Cluster, namespace: str) -> None:
    """Create the jobs namespace's default-deny NetworkPolicy if it is missing."""
    networking = client.NetworkingV1Api(cluster.api_client)
    body = network_policy(cluster.settings)
    try:
        networking.create_namespaced_network_policy(namespace, body)
    except ApiException as error:
        if error.status != 409:
            raise translate(error, f"create network policy in {namespace}") from error


@dataclass(frozen=True, slots=True)
class PriorityClassSpec:
    """A portal priority class as Kubernetes should have it."""

    name: str
    value: int
    preemption_policy: str = "PreemptLowerPriority"  # or "Never"
    description: str = ""


@dataclass(frozen=True, slots=True)
class PriorityClassReconcileResult:
    """What one PriorityClass reconcile changed, by class name.

    ``replaced`` classes had an immutable field (value, preemptionPolicy)
    changed, so they were deleted and created again. ``unowned`` lists desired
    names already taken by a class Quartermaster does not manage: those are
    left exactly as they are.
    """

    created: tuple[str, ...] = ()
    replaced: tuple[str, ...] = ()
    updated: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()
    unowned: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        """Whether the cluster was written to at all."""
        return bool(self.created or self.replaced or self.updated or self.deleted)


def namespace_labels() -> dict[str, str]:
    """Labels of a jobs namespace: managed by Quartermaster, Pod Security "restricted".

    The API server's PodSecurity admission then refuses any pod there that
    is not hardened, whoever creates it.
    """
    return {
        MANAGED_BY_LABEL: MANAGED_BY,
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest",
    }


NETWORK_POLICY_NAME = "quartermaster-ranks"


def network_policy(settings: KubernetesRuntimeConfig) -> dict[str, Any]:
    """The default-deny NetworkPolicy of a jobs namespace.

    It selects every rank pod and allows no ingress, and egress only to DNS
    (so rank 0's name resolves) and to the portal's events URL
    (``events_cidrs``). NetworkPolicies add up, and a policy cannot say "pods
    with the same label value as mine", so each gang gets its own policy from
    ``gang_network_policy`` that lets its ranks, and only them, reach each other.
    """
    egress: list[dict[str, Any]] = [
        {
            "to": [
                {"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}
            ],
            "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
        }
    ]
    if settings.events_cidrs:
        egress.append(
            {
                "to": [{"ipBlock": {"cidr": cidr}} for cidr in settings.events_cidrs],
                "ports": [{"protocol": "TCP", "port": settings.events_port}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": NETWORK_POLICY_NAME, "labels": {MANAGED_BY_LABEL: MANAGED_BY}},
        "spec": {
            "podSelector": {"matchLabels": {MANAGED_BY_LABEL: MANAGED_BY}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],
            "egress": egress,
        },
    }


def gang_network_policy(gang: GangId, owner_references: list[dict[str, Any]]) -> dict[str, Any]:
    """The NetworkPolicy that lets one gang's ranks reach each other (and no one else them)."""
    same_gang = [{"podSelector": {"matchLabels": {GANG_LABEL: gang_name(gang)}}}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": gang_name(gang),
            "labels": {MANAGED_BY_LABEL: MANAGED_BY, GANG_LABEL: gang_name(gang)},
            "ownerReferences": owner_references,
        },
        "spec": {
            "podSelector": {"matchLabels": {GANG_LABEL: gang_name(gang)}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": same_gang}],
            "egress": [{"to": same_gang}],
        },
    }


# -- PriorityClass reconcile -----------------------------------------------------


def reconcile_priority_classes(
    api_client: client.ApiClient, desired: Sequence[PriorityClassSpec]
) -> PriorityClassReconcileResult:
    """Make the cluster's Quartermaster-owned PriorityClasses match ``desired``.

    Owned classes carry ``app.kubernetes.io/managed-by=quartermaster``. A missing
    class is created; a changed value or preemptionPolicy (immutable in
    Kubernetes) replaces the object; a changed description is patched; an owned
    class no longer desired is deleted. A class of the same name that
    Quartermaster does not own is never touched. Running it twice changes
    nothing the second time; edits or deletions by others are undone.
    """
    scheduling = client.SchedulingV1Api(api_client)
    existing = {item.metadata.name: item for item in scheduling.list_priority_class().items}
    wanted = {spec.name: spec for spec in desired}
    created: list[str] = []
    replaced: list[str] = []
    updated: list[str] = []
    deleted: list[str] = []
    unowned: list[str] = []

    def body(spec: PriorityClassSpec) -> dict[str, Any]:
        return {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": spec.name, "labels": {MANAGED_BY_LABEL: MANAGED_BY}},
            "value": spec.value,
            "preemptionPolicy": spec.preemption_policy,
            "globalDefault": False,
            "description": spec.description,
        }

    def create(spec: PriorityClassSpec) -> bool:
        """Create a class; False when another reconciler (a second worker) was first.

        The class it created is checked on the next run like any other.
        """
        try:
            scheduling.create_priority_class(body(spec))
        except ApiException as error:
            if error.status != 409:
                raise
            return False
        return True

    for name, spec in sorted(wanted.items()):
        current = existing.get(name)
        if current is None:
            if create(spec):
                created.append(name)
            continue
        if (current.metadata.labels or {}).get(MANAGED_BY_LABEL) != MANAGED_BY:
            unowned.append(name)
            continue
        if current.value != spec.value or current.preemption_policy != spec.preemption_policy:
            try:
                scheduling.delete_priority_class(
                    name,
                    body=client.V1DeleteOptions(
                        preconditions=client.V1Preconditions(uid=current.metadata.uid)
                    ),
                )
            except ApiException as error:
                if error.status != 404:
                    raise
            if create(spec):
                replaced.append(name)
        elif (current.description or "") != spec.description or current.global_default:
            scheduling.patch_priority_class(
                name, {"description": spec.description, "globalDefault": False}
            )
            updated.append(name)
    for name, current in sorted(existing.items()):
        if name in wanted:
            continue
        if (current.metadata.labels or {}).get(MANAGED_BY_LABEL) != MANAGED_BY:
            continue
        with contextlib.suppress(ApiException):
            scheduling.delete_priority_class(name)
        deleted.append(name)
    return PriorityClassReconcileResult(
        created=tuple(created),
        replaced=tuple(replaced),
        updated=tuple(updated),
        deleted=tuple(deleted),
        unowned=tuple(unowned),
    )
