"""A gang's objects in the cluster: created at launch, kept, and removed at forget.

launch() creates the gang record (the ConfigMap that owns everything else), the
events Secret, the cadence-hint ConfigMap, the headless Service, the gang's
NetworkPolicy and one pod per rank (spec.py says what a pod is);
publish_preemption_risk() keeps the hint current; forget() releases the pods'
exit-code finalizers and deletes the record. It never stops a running rank
(evict.py does) and never reads the models.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from preemption.runtimes.base import GangId, GangSpec, RuntimeTemporaryError, mtbp_text
from preemption.runtimes.kubernetes.cluster import Cluster, is_gone, translate
from preemption.runtimes.kubernetes.config import (
    ATTEMPT_LABEL,
    EVENTS_TOKEN_KEY,
    EXIT_CODE_FINALIZER,
    GANG_LABEL,
    JOB_LABEL,
    LAUNCHED_ANNOTATION,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    RISK_KEY,
    RISK_OF_LABEL,
    TEAM_LABEL,
    gang_labels,
    gang_name,
    gang_selector,
    namespace_for,
    pod_name,
    risk_config_map_name,
)
from preemption.runtimes.kubernetes.policies import (
    ensure_namespace,
    ensure_network_policy,
    gang_network_policy,
)
from preemption.runtimes.kubernetes.spec import check_env, check_image, pod_body


def launch(cluster: Cluster, spec: GangSpec) -> None:
    """Create the gang's ConfigMap, Secret, Service and one pod per rank.

    Idempotent: objects that already exist are left alone, and a launch cut
    short half-way is completed by the next call.
    """
    gang = spec.gang
    check_image(cluster.settings, spec)
    check_env(spec)
    namespace = namespace_for(cluster.settings, spec.team)
    if cluster.settings.namespace_per_team and spec.team:
        ensure_namespace(cluster, namespace)
        ensure_network_policy(cluster, namespace)
    name = gang_name(gang)
    owner = _ensure_gang_record(cluster, spec, namespace)
    with cluster.lock:
        cluster.world_sizes[gang] = (namespace, spec.world_size)
    if (owner.metadata.annotations or {}).get(LAUNCHED_ANNOTATION):
        return
    owner_references = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": name,
            "uid": owner.metadata.uid,
            "controller": True,
        }
    ]
    token = spec.env.get(EVENTS_TOKEN_KEY, "")
    cluster.create_ignoring_conflict(
        cluster.core.create_namespaced_secret,
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": f"{name}-events",
                "labels": gang_labels(gang),
                "ownerReferences": owner_references,
            },
            "type": "Opaque",
            "stringData": {EVENTS_TOKEN_KEY: token},
        },
    )
    risk = mtbp_text(spec.mtbp_seconds) if spec.mtbp_seconds is not None else ""
    cluster.create_ignoring_conflict(
        cluster.core.create_namespaced_config_map,
        namespace,
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": risk_config_map_name(gang),
                # Not the gang label: listings of gang records select by it.
                "labels": {
                    MANAGED_BY_LABEL: MANAGED_BY,
                    JOB_LABEL: str(gang.job_id),
                    ATTEMPT_LABEL: str(gang.attempt),
                    RISK_OF_LABEL: gang_name(gang),
                },
                "ownerReferences": owner_references,
            },
            # Empty until the first estimate: the trap then has no hint.
            "data": {RISK_KEY: risk},
        },
    )
    with cluster.lock:
        cluster.published_risk[gang] = risk
    cluster.create_ignoring_conflict(
        cluster.core.create_namespaced_service,
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": name,
                "labels": gang_labels(gang),
                "ownerReferences": owner_references,
            },
            "spec": {
                "clusterIP": "None",
                "selector": {GANG_LABEL: name},
                # Rank 0 must resolve before it is ready: the others wait on it.
                "publishNotReadyAddresses": True,
                "ports": [{"name": "rendezvous", "port": cluster.settings.master_port}],
            },
        },
    )
    cluster.create_ignoring_conflict(
        client.NetworkingV1Api(cluster.api_client).create_namespaced_network_policy,
        namespace,
        gang_network_policy(gang, owner_references),
    )
    existing = {
        pod.metadata.name
        for pod in cluster.core.list_namespaced_pod(
            namespace, label_selector=gang_selector(gang)
        ).items
    }
    bodies = [
        pod_body(cluster.settings, spec, namespace, placement.rank, owner_references)
        for placement in spec.ranks
        if pod_name(gang, placement.rank) not in existing
    ]
    results = list(
        cluster.pool.map(
            lambda body: _try(
                lambda: cluster.create_ignoring_conflict(
                    cluster.core.create_namespaced_pod, namespace, body
                )
            ),
            bodies,
        )
    )
    errors = [error for error in results if error is not None]
    if errors:
        raise errors[0]
    cluster.core.patch_namespaced_config_map(
        name,
        namespace,
        {"metadata": {"annotations": {LAUNCHED_ANNOTATION: f"{time.time():.6f}"}}},
    )


def _ensure_gang_record(cluster: Cluster, spec: GangSpec, namespace: str) -> Any:
    gang = spec.gang
    labels = gang_labels(gang)
    if spec.team:
        labels[TEAM_LABEL] = spec.team
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": gang_name(gang), "labels": labels},
        "data": {
            "world_size": str(spec.world_size),
            "placement": ",".join(f"{p.rank}={p.node}" for p in spec.ranks),
            "priority_class": spec.priority_class,
            "grace_seconds": f"{spec.grace_seconds:g}",
        },
    }
    try:
        return cluster.core.create_namespaced_config_map(namespace, body)
    except ApiException as error:
        if error.status != 409:
            raise translate(error, f"create gang record {gang_name(gang)}") from error
    try:
        return cluster.core.read_namespaced_config_map(gang_name(gang), namespace)
    except ApiException as error:
        raise translate(error, f"read gang record {gang_name(gang)}") from error


def _try(call: Callable[[], None]) -> Exception | None:
    try:
        call()
    except Exception as error:
        return error
    return None


# How many times forget() reads a pod afresh when its finalizers changed under it.
RELEASE_TRIES = 5


def _try_release(cluster: Cluster, namespace: str) -> Callable[[Any], Exception | None]:
    """The call that releases one pod's exit-code finalizer; it returns the error
    (translated) that kept it, or None."""

    def release(pod: Any) -> Exception | None:
        for _ in range(RELEASE_TRIES):
            finalizers = pod.metadata.finalizers or []
            if EXIT_CODE_FINALIZER not in finalizers:
                return None
            remaining = [f for f in finalizers if f != EXIT_CODE_FINALIZER]
            try:
                # Against the version read: the list replaced is exactly the one read,
                # so a finalizer someone else added meanwhile is never dropped.
                cluster.core.patch_namespaced_pod(
                    pod.metadata.name,
                    namespace,
                    [
                        {"op": "test", "path": "/metadata/resourceVersion",
                         "value": pod.metadata.resource_version},
                        {"op": "replace", "path": "/metadata/finalizers", "value": remaining},
                    ],
                )  # fmt: skip
                return None
            except ApiException as error:
                if is_gone(error):
                    return None
                if error.status not in (409, 422):
                    return translate(error, f"release the finalizer of pod {pod.metadata.name}")
            # The pod changed since it was read (its kubelet wrote its status): read it
            # again and release against that version. Listed by name, not read: the
            # worker's role lists pods and has no need to get one.
            name = pod.metadata.name
            try:
                found = cluster.core.list_namespaced_pod(
                    namespace, field_selector=f"metadata.name={name}"
                ).items
            except ApiException as error:
                return translate(error, f"read pod {name}")
            if not found:
                return None
            pod = found[0]
        return RuntimeTemporaryError(
            f"release the finalizer of pod {pod.metadata.name}: it changed "
            f"{RELEASE_TRIES} times while being released"
        )

    return release


def publish_preemption_risk(
    cluster: Cluster, gang: GangId, mtbp_seconds: float, *, team: str
) -> None:
    """Write the gang's cadence hint into its ConfigMap, unless this runtime already
    wrote the same one (after a restart it writes each once more)."""
    del team  # the gang record says where the gang runs
    text = mtbp_text(mtbp_seconds)
    with cluster.lock:
        if cluster.published_risk.get(gang) == text:
            return
    location = cluster.gang_location(gang)
    if location is None:
        return
    try:
        cluster.core.patch_namespaced_config_map(
            risk_config_map_name(gang), location[0], {"data": {RISK_KEY: text}}
        )
    except ApiException as error:
        if is_gone(error):
            # A gang launched before the hint existed, or one being forgotten.
            return
        raise translate(error, f"write the cadence hint of {gang_name(gang)}") from error
    with cluster.lock:
        cluster.published_risk[gang] = text


def forget(cluster: Cluster, gang: GangId) -> None:
    """Release the pods' exit-code finalizers and delete the gang record.

    Deleting the ConfigMap garbage-collects the Service, the Secret and the
    pods through their owner references. A finalizer that could not be released
    raises, with the record kept, so that the next forget tries again: a pod left
    with it would stay Terminating for ever.
    """
    location = cluster.gang_location(gang)
    if location is None:
        return
    namespace = location[0]
    pods = cluster.core.list_namespaced_pod(namespace, label_selector=gang_selector(gang)).items
    errors = [error for error in cluster.pool.map(_try_release(cluster, namespace), pods) if error]
    if errors:
        # The record stays until every finalizer is released: a pod whose finalizer is
        # left would stay Terminating for ever once the record's collection deletes it.
        raise errors[0]
    # The garbage collector would remove it with the gang record; deleting it here
    # does not leave that to a collector that may be slow or, in tests, absent.
    with contextlib.suppress(ApiException):
        cluster.core.delete_namespaced_config_map(risk_config_map_name(gang), namespace)
    with contextlib.suppress(ApiException):
        cluster.core.delete_namespaced_config_map(
            gang_name(gang),
            namespace,
            body=client.V1DeleteOptions(propagation_policy="Background"),
        )
    with cluster.lock:
        cluster.world_sizes.pop(gang, None)
        cluster.signalled.pop(gang, None)
        cluster.blocked.pop(gang, None)
        cluster.published_risk.pop(gang, None)
        # Its kept logs' ConfigMaps go with the gang record (their owner).
        cluster.followed = {key for key in cluster.followed if key[0] != gang}
        cluster.kept_logs = {key: kept for key, kept in cluster.kept_logs.items() if key[0] != gang}
