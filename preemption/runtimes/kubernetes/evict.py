"""Stopping a gang's pods: the signal (an eviction of every rank) and the kill.

Each rank pod is first marked with STOP_REQUESTED_ANNOTATION, so this runtime's own
stop is never taken for a disruption (``stop_marked_at`` reads the mark back). It
calls the API server and records what it did in the Cluster's caches; it never
reads the models and decides nothing about which gang to stop.
"""

from __future__ import annotations

import math
import time
from typing import Any

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
    ATTEMPT_LABEL,
    GRACE_ANNOTATION,
    KILLED_ANNOTATION,
    SIGNALLED_ANNOTATION,
    STOP_REQUESTED_ANNOTATION,
    gang_name,
    pod_name,
)


def signal(cluster: Cluster, gang: GangId, grace_seconds: float) -> None:
    """Evict every rank at once with ``gracePeriodSeconds``; retry 429 with backoff.

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
        signalled_at = cluster.signalled.setdefault(gang, now)
    mark = stop_mark(gang.attempt, "signal", signalled_at)
    deadline = time.monotonic() + cluster.settings.eviction_retry_seconds
    outcomes = list(
        cluster.pool.map(
            lambda rank: (
                rank,
                *_evict(cluster, namespace, pod_name(gang, rank), grace, deadline, mark),
            ),
            range(world_size),
        )
    )
    with cluster.lock:
        cluster.last_eviction_answered_at = max(answered for _, _, answered in outcomes)
    if first_signal:
        # Recorded in the cluster so a restarted worker still knows when the
        # gang was told to stop. It follows the evictions rather than
        # delaying them: until it lands, the pods' DisruptionTarget
        # conditions already say they are being evicted.
        _annotate_signal_once(cluster, gang, namespace, now, grace_seconds)
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


def _annotate_signal_once(
    cluster: Cluster, gang: GangId, namespace: str, at: float, grace_seconds: float
) -> None:
    try:
        record = cluster.core.read_namespaced_config_map(gang_name(gang), namespace)
    except ApiException:
        return
    annotations = record.metadata.annotations or {}
    if SIGNALLED_ANNOTATION in annotations:
        with cluster.lock:
            cluster.signalled[gang] = float(annotations[SIGNALLED_ANNOTATION])
        return
    cluster.annotate(
        gang,
        namespace,
        {SIGNALLED_ANNOTATION: f"{at:.6f}", GRACE_ANNOTATION: f"{grace_seconds:g}"},
    )


def _evict(
    cluster: Cluster, namespace: str, name: str, grace: int, deadline: float, mark: str
) -> tuple[str | None, float]:
    """Mark one pod as stopped by this runtime, then evict it: (None when done, else
    why it is still blocked; when answered). The mark goes first, so no eviction of
    this runtime's is ever seen unmarked, not even by a worker started after it."""
    body = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": namespace},
        "deleteOptions": {"gracePeriodSeconds": grace},
    }
    pause = 0.05
    marked = False
    while True:
        try:
            if not marked:
                _mark_stop(cluster, namespace, name, mark)
                marked = True
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


def _mark_stop(cluster: Cluster, namespace: str, name: str, mark: str) -> None:
    """Annotate a rank pod with this runtime's stop (see STOP_REQUESTED_ANNOTATION)."""
    cluster.core.patch_namespaced_pod(
        name,
        namespace,
        {"metadata": {"annotations": {STOP_REQUESTED_ANNOTATION: mark}}},
        _preload_content=False,
    )


def eviction_blocked(cluster: Cluster, gang: GangId) -> dict[int, str]:
    """Ranks whose last eviction a PodDisruptionBudget refused, with the reason."""
    with cluster.lock:
        return dict(cluster.blocked.get(gang, {}))


def kill(cluster: Cluster, gang: GangId) -> None:
    """Delete every rank's pod with grace 0. Idempotent."""
    location = cluster.gang_location(gang)
    if location is None:
        return
    namespace, world_size = location
    killed_at = time.time()
    cluster.annotate(gang, namespace, {KILLED_ANNOTATION: f"{killed_at:.6f}"})
    body = client.V1DeleteOptions(grace_period_seconds=0)
    with cluster.lock:
        signalled_at = cluster.signalled.get(gang)
    # A pod this runtime signalled keeps its signal's mark; one it kills unsignalled
    # (a gang stuck at its start) is marked as killed, so neither reads as a disruption.
    mark = (
        stop_mark(gang.attempt, "signal", signalled_at)
        if signalled_at is not None
        else stop_mark(gang.attempt, "kill", killed_at)
    )

    def delete(rank: int) -> Exception | None:
        try:
            _mark_stop(cluster, namespace, pod_name(gang, rank), mark)
            cluster.core.delete_namespaced_pod(pod_name(gang, rank), namespace, body=body)
        except ApiException as error:
            if not is_gone(error):
                return translate(error, f"delete {pod_name(gang, rank)}")
        return None

    errors = [e for e in cluster.pool.map(delete, range(world_size)) if e is not None]
    if errors:
        raise errors[0]


def stop_mark(attempt: int, kind: str, at: float) -> str:
    """The value of STOP_REQUESTED_ANNOTATION: "<attempt>/<kind>/<when>"."""
    return f"{attempt}/{kind}/{at:.6f}"


def stop_marked_at(pod: Any) -> float | None:
    """When this runtime asked to stop the pod, from its STOP_REQUESTED_ANNOTATION,
    or None when it never did (or the mark is not one of its own)."""
    mark = (pod.metadata.annotations or {}).get(STOP_REQUESTED_ANNOTATION)
    if not mark:
        return None
    attempt, _, rest = mark.partition("/")
    if attempt != (pod.metadata.labels or {}).get(ATTEMPT_LABEL):
        return None
    try:
        return float(rest.rpartition("/")[2])
    except ValueError:
        return None
