"""Stopping a gang's pods: the signal (an eviction of every rank) and the kill.

An Eviction API call carries no mark of who made it, so the gang's record says
first when this runtime stopped the gang (SIGNALLED_ANNOTATION, or KILLED_ANNOTATION
for a kill), and only then are the pods evicted or deleted: no stop of this
runtime's is ever seen without its record, not even by a worker started after it,
and a disruption of a rank that began before that moment is someone else's
(observe.py compares the two). One write for the gang rather than one per pod: the
API server applies the evictions sooner, and the kubelets see each pod change once.
It calls the API server and records what it did in the Cluster's caches; it never
reads the models and decides nothing about which gang to stop.
"""

from __future__ import annotations

import math
import time

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from preemption.runtimes.base import GangId, RuntimeTemporaryError
from preemption.runtimes.kubernetes.cluster import (
    Cluster,
    error_text,
    is_gone,
    is_temporary,
    translate,
)
from preemption.runtimes.kubernetes.config import (
    GRACE_ANNOTATION,
    KILLED_ANNOTATION,
    SIGNALLED_ANNOTATION,
    gang_name,
    pod_name,
)


def signal(cluster: Cluster, gang: GangId, grace_seconds: float) -> None:
    """Evict every rank at once with ``gracePeriodSeconds``, once the gang's record
    says this runtime signalled it; retry 429 with backoff.

    Idempotent: ranks already gone count as done, and a second call only
    re-issues evictions (the API server never lengthens a grace period).
    Raises RuntimeTemporaryError naming the ranks a PodDisruptionBudget
    still protects after ``eviction_retry_seconds``.
    """
    location = cluster.gang_location(gang)
    if location is None:
        return
    namespace, world_size = location
    grace = max(0, math.ceil(grace_seconds))
    now = time.time()
    with cluster.lock:
        first_signal = gang not in cluster.signalled
        cluster.signalled.setdefault(gang, now)
    if first_signal:
        try:
            _record_signal_once(cluster, gang, namespace, now, grace_seconds)
        except Exception:
            # Nothing was evicted: the next call writes the record again.
            with cluster.lock:
                if cluster.signalled.get(gang) == now:
                    del cluster.signalled[gang]
            raise
    deadline = time.monotonic() + cluster.settings.eviction_retry_seconds
    outcomes = list(
        cluster.pool.map(
            lambda rank: (
                rank,
                *_evict(cluster, namespace, pod_name(gang, rank), grace, deadline),
            ),
            range(world_size),
        )
    )
    with cluster.lock:
        cluster.last_eviction_answered_at = max(answered for _, _, answered in outcomes)
    blocked = {rank: message for rank, message, _ in outcomes if message is not None}
    with cluster.lock:
        if blocked:
            cluster.blocked[gang] = blocked
        else:
            cluster.blocked.pop(gang, None)
    if blocked:
        ranks = ", ".join(str(rank) for rank in sorted(blocked))
        reason = next(iter(blocked.values()))
        raise RuntimeTemporaryError(
            f"eviction of {gang_name(gang)} ranks {ranks} blocked: {reason}"
        )


def _record_signal_once(
    cluster: Cluster, gang: GangId, namespace: str, at: float, grace_seconds: float
) -> None:
    """Write on the gang's record when this runtime signalled it, unless a worker
    before this one did (its time stands, and this worker adopts it). Raises
    RuntimeTemporaryError where the record cannot be read or written: no pod is
    evicted before its record says who evicts it."""
    try:
        record = cluster.core.read_namespaced_config_map(gang_name(gang), namespace)
    except ApiException as error:
        if is_gone(error):
            return
        raise translate(error, f"read {gang_name(gang)}") from error
    except (urllib3.exceptions.HTTPError, OSError) as error:
        raise RuntimeTemporaryError(f"API server unreachable: {error}") from error
    annotations = record.metadata.annotations or {}
    if SIGNALLED_ANNOTATION in annotations:
        with cluster.lock:
            cluster.signalled[gang] = float(annotations[SIGNALLED_ANNOTATION])
        return
    _write_record(
        cluster,
        gang,
        namespace,
        {SIGNALLED_ANNOTATION: f"{at:.6f}", GRACE_ANNOTATION: f"{grace_seconds:g}"},
    )


def _write_record(
    cluster: Cluster, gang: GangId, namespace: str, annotations: dict[str, str]
) -> None:
    """Annotate the gang's record; a record already gone (the gang forgotten) is no
    error, any other failure is the protocol's (RuntimeTemporaryError mostly)."""
    try:
        cluster.core.patch_namespaced_config_map(
            gang_name(gang),
            namespace,
            {"metadata": {"annotations": annotations}},
            _preload_content=False,
        )
    except ApiException as error:
        if not is_gone(error):
            raise translate(error, f"annotate {gang_name(gang)}") from error
    except (urllib3.exceptions.HTTPError, OSError) as error:
        raise RuntimeTemporaryError(f"API server unreachable: {error}") from error


def _evict(
    cluster: Cluster, namespace: str, name: str, grace: int, deadline: float
) -> tuple[str | None, float]:
    """Evict one pod: (None when done, else why it is still blocked; when answered)."""
    body = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": namespace},
        "deleteOptions": {"gracePeriodSeconds": grace},
    }
    pause = 0.05
    while True:
        try:
            # The answer's body is not needed: skip deserializing it.
            cluster.core.create_namespaced_pod_eviction(
                name, namespace, body, _preload_content=False
            )
            return None, time.monotonic()
        except ApiException as error:
            if is_gone(error):
                return None, time.monotonic()
            blocked = f"{error.status} {error.reason}: {error_text(error)}"
            if not is_temporary(error) or time.monotonic() + pause > deadline:
                return blocked, time.monotonic()
        except (urllib3.exceptions.HTTPError, OSError) as error:
            if time.monotonic() + pause > deadline:
                return f"API server unreachable: {error}", time.monotonic()
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


def eviction_blocked(cluster: Cluster, gang: GangId) -> dict[int, str]:
    """Ranks whose last eviction a PodDisruptionBudget refused, with the reason."""
    with cluster.lock:
        return dict(cluster.blocked.get(gang, {}))


def kill(cluster: Cluster, gang: GangId) -> None:
    """Delete every rank's pod with grace 0, once the gang's record says so. Idempotent."""
    location = cluster.gang_location(gang)
    if location is None:
        return
    namespace, world_size = location
    killed_at = time.time()
    # A gang killed unsignalled (stuck at its start) is stopped by this runtime from
    # now: its ranks' deletions are then never read as a disruption.
    _write_record(cluster, gang, namespace, {KILLED_ANNOTATION: f"{killed_at:.6f}"})
    with cluster.lock:
        cluster.signalled.setdefault(gang, killed_at)
    body = client.V1DeleteOptions(grace_period_seconds=0)

    def delete(rank: int) -> Exception | None:
        try:
            cluster.core.delete_namespaced_pod(pod_name(gang, rank), namespace, body=body)
        except ApiException as error:
            if not is_gone(error):
                return translate(error, f"delete {pod_name(gang, rank)}")
        return None

    errors = [e for e in cluster.pool.map(delete, range(world_size)) if e is not None]
    if errors:
        raise errors[0]
