"""Observing gangs: pods listed or watched, each turned into a RankObservation.

It owns the mapping of a pod to the protocol's phases (with why a rank ended and
why one has not started), the pod watch that keeps a cache of gang pods, the
nodes' inventory, and ``gang_guard_victims``, the rule of which gangs lost a rank
to someone else. It only reads the cluster (the pod watch writes the Cluster's
cache); it never stops a pod and never reads the models.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from preemption.runtimes.base import GangId, NodeInventory, RankObservation, RuntimeTemporaryError
from preemption.runtimes.kubernetes.cluster import Cluster, translate
from preemption.runtimes.kubernetes.config import (
    ATTEMPT_LABEL,
    GANG_LABEL,
    GPU_RESOURCE,
    JOB_LABEL,
    KILLED_ANNOTATION,
    LAUNCHED_ANNOTATION,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    NODE_LABEL,
    RANK_LABEL,
    SIGNALLED_ANNOTATION,
    gang_name,
    gang_selector,
    pod_name,
)

# How far before the moment this runtime stopped a gang (its record's time) the
# DisruptionTarget condition of one of its pods may say it began and still be this
# runtime's own eviction: the condition's time is whole seconds, and the API
# server's clock may run a little behind the control plane's.
STOP_CLOCK_SLACK_SECONDS = 2.0


def observe(cluster: Cluster, gang: GangId | None = None) -> list[RankObservation]:
    """Every rank's state from a fresh listing of pods, gang records and nodes."""
    selector = gang_selector(gang)
    # Gang records first, pods second: launch() marks a record launched only
    # after every pod exists, so a launched record is never paired with a
    # pod listing taken before its pods were created (which would read as
    # every rank lost).
    try:
        # The nodes' readiness does not depend on the gangs: asked for side by side.
        ready = cluster.pool.submit(_ready_nodes, cluster)
        if cluster.settings.namespace_per_team:
            records = cluster.core.list_config_map_for_all_namespaces(label_selector=selector).items
        else:
            records = cluster.core.list_namespaced_config_map(
                cluster.settings.namespace, label_selector=selector
            ).items
        pods = _pods_for(cluster, records, gang)
        ready_nodes = ready.result()
    except ApiException as error:
        raise translate(error, "observe") from error
    pods_by_gang: dict[GangId, dict[int, Any]] = {}
    for pod in pods:
        labels = pod.metadata.labels or {}
        key = GangId(int(labels[JOB_LABEL]), int(labels[ATTEMPT_LABEL]))
        pods_by_gang.setdefault(key, {})[int(labels[RANK_LABEL])] = pod
    stopped = _stopped_at(cluster, records)
    observations: list[RankObservation] = []
    disrupted = {
        (key.job_id, key.attempt, int(labels[RANK_LABEL])): reason
        for pod in pods
        for reason in [_taken_by(pod)]
        if reason is not None
        for labels in [pod.metadata.labels or {}]
        for key in [GangId(int(labels[JOB_LABEL]), int(labels[ATTEMPT_LABEL]))]
        if not _own_stop(pod, stopped.get(key))
    }
    with cluster.lock:
        if gang is None:
            cluster.disrupted = disrupted
        else:
            cluster.disrupted = {
                key: reason
                for key, reason in cluster.disrupted.items()
                if key[:2] != (gang.job_id, gang.attempt)
            } | disrupted
    for record in records:
        labels = record.metadata.labels or {}
        key = GangId(int(labels[JOB_LABEL]), int(labels[ATTEMPT_LABEL]))
        annotations = record.metadata.annotations or {}
        signalled_at = stopped.get(key)
        launched = LAUNCHED_ANNOTATION in annotations
        placement = dict(
            item.split("=", 1)
            for item in (record.data or {}).get("placement", "").split(",")
            if item
        )
        world_size = int((record.data or {}).get("world_size", "0"))
        ranks = pods_by_gang.get(key, {})
        for rank in range(world_size):
            pod = ranks.get(rank)
            if pod is None:
                observations.append(
                    RankObservation(
                        job_id=key.job_id,
                        attempt=key.attempt,
                        rank=rank,
                        node=placement.get(str(rank), ""),
                        # Only forget() removes the exit-code finalizer, so a
                        # pod missing after launch was removed by force.
                        phase="lost" if launched else "starting",
                        exit_code=None,
                        handle=pod_name(key, rank),
                        started_at=None,
                        exited_at=None,
                        signal_sent_at=signalled_at,
                    )
                )
            else:
                observations.append(rank_observation(pod, signalled_at, ready_nodes))
    observations.sort(key=lambda o: (o.job_id, o.attempt, o.rank))
    return observations


def _stopped_at(cluster: Cluster, records: list[Any]) -> dict[GangId, float]:
    """When this runtime stopped each gang: signalled it, or killed it unsignalled, from
    the gang's record, so that every worker reads the same moment; else from this
    worker's memory of a stop whose record is being written. A signal on record is
    remembered, so a worker started since does not write it again."""
    stopped: dict[GangId, float] = {}
    with cluster.lock:
        for record in records:
            labels = record.metadata.labels or {}
            key = GangId(int(labels[JOB_LABEL]), int(labels[ATTEMPT_LABEL]))
            annotations = record.metadata.annotations or {}
            signalled = annotations.get(SIGNALLED_ANNOTATION)
            killed = annotations.get(KILLED_ANNOTATION)
            at: float | None
            if signalled:
                at = float(signalled)
                cluster.signalled.setdefault(key, at)
            elif killed:
                at = float(killed)
            else:
                at = cluster.signalled.get(key)
            if at is not None:
                stopped[key] = at
    return stopped


def _own_stop(pod: Any, stopped_at: float | None) -> bool:
    """Whether the end of a pod that something other than the rank ended is this
    runtime's own stop: its gang was stopped by this runtime, and the pod's disruption
    did not begin before that (a drain's eviction that came first stays a disruption)."""
    if stopped_at is None:
        return False
    condition = _disruption(pod)
    began = _parse_time(condition.last_transition_time) if condition is not None else None
    return began is None or began >= stopped_at - STOP_CLOCK_SLACK_SECONDS


def _list_pods(cluster: Cluster, selector: str) -> list[Any]:
    if cluster.settings.namespace_per_team:
        return list(cluster.core.list_pod_for_all_namespaces(label_selector=selector).items)
    return list(
        cluster.core.list_namespaced_pod(cluster.settings.namespace, label_selector=selector).items
    )


def _pods_for(cluster: Cluster, records: list[Any], gang: GangId | None) -> list[Any]:
    """The gangs' pods: from the watch cache when it is in sync, else a listing.

    The cache may lag the records just listed: a launched gang whose pods
    are not all in it yet is listed afresh, so a lag never reads as lost
    ranks.
    """
    if not cluster.settings.watch_pods:
        return _list_pods(cluster, gang_selector(gang))
    _start_pod_watch(cluster)
    if not cluster.pod_cache_ready.is_set():
        return _list_pods(cluster, gang_selector(gang))
    with cluster.lock:
        cached = [
            pod
            for pod in cluster.pod_cache.values()
            if gang is None or (pod.metadata.labels or {}).get(GANG_LABEL) == gang_name(gang)
        ]
    present: dict[str, int] = {}
    for pod in cached:
        name = (pod.metadata.labels or {}).get(GANG_LABEL, "")
        present[name] = present.get(name, 0) + 1
    pods = cached
    for record in records:
        annotations = record.metadata.annotations or {}
        world_size = int((record.data or {}).get("world_size", "0"))
        name = record.metadata.name
        if LAUNCHED_ANNOTATION in annotations and present.get(name, 0) < world_size:
            fresh = _list_pods(cluster, f"{MANAGED_BY_LABEL}={MANAGED_BY},{GANG_LABEL}={name}")
            pods = [p for p in pods if p.metadata.labels.get(GANG_LABEL) != name] + fresh
    return pods


def pod_watch_in_sync(cluster: Cluster) -> bool:
    """Whether observe() reads pods from the watch cache right now."""
    return cluster.pod_cache_ready.is_set()


def _start_pod_watch(cluster: Cluster) -> None:
    with cluster.lock:
        if cluster.pod_watch is not None:
            return
        cluster.pod_watch = threading.Thread(
            target=_pod_watch_loop, args=(cluster,), name="qm-k8s-pod-watch", daemon=True
        )
    cluster.pod_watch.start()


def _pod_watch_loop(cluster: Cluster) -> None:
    """Keep ``pod_cache`` in line with the cluster: list, then watch from
    the listing's version; list again on 410 Gone or any error."""
    selector = f"{MANAGED_BY_LABEL}={MANAGED_BY},{GANG_LABEL}"
    namespace = None if cluster.settings.namespace_per_team else cluster.settings.namespace
    method: Callable[..., Any]
    kwargs: dict[str, Any] = {"label_selector": selector}
    if namespace is None:
        method = cluster.core.list_pod_for_all_namespaces
    else:
        method = cluster.core.list_namespaced_pod
        kwargs["namespace"] = namespace
    version: str | None = None
    while not cluster.closing.is_set():
        try:
            if version is None:
                cluster.pod_cache_ready.clear()
                listing = method(**kwargs)
                with cluster.lock:
                    cluster.relists += 1
                    cluster.pod_cache = {_pod_key(p): p for p in listing.items}
                version = listing.metadata.resource_version
                cluster.pod_cache_ready.set()
            for event in watch.Watch().stream(
                method,
                resource_version=version,
                timeout_seconds=30,
                allow_watch_bookmarks=True,
                **kwargs,
            ):
                obj = event["object"]
                if event["type"] == "ERROR":
                    version = None
                    break
                if event["type"] == "BOOKMARK":
                    version = obj["metadata"]["resourceVersion"]
                    continue
                version = obj.metadata.resource_version
                with cluster.lock:
                    if event["type"] == "DELETED":
                        cluster.pod_cache.pop(_pod_key(obj), None)
                    else:
                        cluster.pod_cache[_pod_key(obj)] = obj
                if cluster.closing.is_set():
                    return
        except Exception:
            # 410 Gone or a broken connection: start over from a listing,
            # and meanwhile let observe() list for itself.
            version = None
            cluster.pod_cache_ready.clear()
            cluster.closing.wait(0.5)


def _ready_nodes(cluster: Cluster) -> set[str]:
    ready = set()
    for node in cluster.core.list_node().items:
        for condition in node.status.conditions or []:
            if condition.type == "Ready" and condition.status == "True":
                ready.add(node.metadata.name)
    return ready


def disruptions(cluster: Cluster, gang: GangId) -> dict[int, str]:
    """Ranks carrying a DisruptionTarget condition, with its reason.

    ``PreemptionByScheduler`` means kube-scheduler took the rank's node for
    a higher-priority pod; ``EvictionByEvictionAPI`` is an eviction (ours
    or a drain); ``DeletionByTaintManager`` follows a lost node. A pod the
    kubelet's eviction manager evicted for passing its ephemeral-storage limit
    carries no such condition (seen on a real kubelet v1.34), only the pod's
    reason ``Evicted`` and the kubelet's message: ``Evicted: <message>``.
    """
    location = cluster.gang_location(gang)
    if location is None:
        return {}
    pods = cluster.core.list_namespaced_pod(location[0], label_selector=gang_selector(gang)).items
    found = {}
    for pod in pods:
        reason = _taken_by(pod)
        if reason is not None:
            found[int(pod.metadata.labels[RANK_LABEL])] = reason
    return found


def watch_ranks(
    cluster: Cluster,
    gang: GangId | None = None,
    *,
    stop: threading.Event,
    resource_version: str | None = None,
    timeout_seconds: int = 30,
) -> Iterator[RankObservation]:
    """Yield rank observations as pods change, until ``stop`` is set.

    Starts from a listing (yielding every rank) unless ``resource_version``
    is given; when the API server answers 410 Gone (the version fell out of
    its window) it lists again and carries on from the new version.
    Node readiness is taken at each listing. ``relists`` counts listings.
    """
    selector = gang_selector(gang)
    namespace = None if cluster.settings.namespace_per_team else cluster.settings.namespace
    cluster.relists = 0
    ready_nodes: set[str] = set()

    def listing() -> tuple[list[Any], str]:
        cluster.relists += 1
        if namespace is None:
            result = cluster.core.list_pod_for_all_namespaces(label_selector=selector)
        else:
            result = cluster.core.list_namespaced_pod(namespace, label_selector=selector)
        return result.items, result.metadata.resource_version

    version = resource_version
    while not stop.is_set():
        if version is None:
            ready_nodes = _ready_nodes(cluster)
            pods, version = listing()
            for pod in pods:
                yield rank_observation(pod, _signal_time(cluster, pod), ready_nodes)
            continue
        if not ready_nodes:
            ready_nodes = _ready_nodes(cluster)
        kwargs: dict[str, Any] = {
            "label_selector": selector,
            "resource_version": version,
            "timeout_seconds": timeout_seconds,
            "allow_watch_bookmarks": True,
        }
        method: Callable[..., Any]
        if namespace is None:
            method = cluster.core.list_pod_for_all_namespaces
        else:
            method = cluster.core.list_namespaced_pod
            kwargs["namespace"] = namespace
        try:
            for event in watch.Watch().stream(method, **kwargs):
                obj = event["object"]
                if event["type"] == "ERROR":
                    code = obj.get("code") if isinstance(obj, dict) else None
                    if code == 410:
                        version = None
                        break
                    raise RuntimeTemporaryError(f"pod watch error: {obj}")
                if event["type"] == "BOOKMARK":
                    # Bookmarks arrive as plain dicts: they only move the version on.
                    version = obj["metadata"]["resourceVersion"]
                    continue
                version = obj.metadata.resource_version
                if event["type"] == "DELETED":
                    continue
                yield rank_observation(obj, _signal_time(cluster, obj), ready_nodes)
                if stop.is_set():
                    return
        except ApiException as error:
            if error.status == 410:
                version = None
                continue
            raise translate(error, "watch pods") from error


def _signal_time(cluster: Cluster, pod: Any) -> float | None:
    labels = pod.metadata.labels or {}
    key = GangId(int(labels[JOB_LABEL]), int(labels[ATTEMPT_LABEL]))
    with cluster.lock:
        return cluster.signalled.get(key)


def nodes(cluster: Cluster) -> list[NodeInventory]:
    """Nodes with allocatable GPUs, their flavor from the flavor label and their
    topology from the configured topology labels."""
    try:
        items = cluster.core.list_node().items
    except ApiException as error:
        raise translate(error, "list nodes") from error
    inventory = []
    for node in items:
        gpus = int((node.status.allocatable or {}).get(GPU_RESOURCE, "0"))
        if gpus <= 0:
            continue
        labels = node.metadata.labels or {}
        flavor = labels.get(cluster.settings.flavor_label, "")
        topology = tuple(
            (level, labels[key])
            for level, key in cluster.settings.topology_labels.items()
            if labels.get(key)
        )
        inventory.append(
            NodeInventory(name=node.metadata.name, flavor=flavor, gpus=gpus, topology=topology)
        )
    return sorted(inventory, key=lambda n: n.name)


def taken_ranks(cluster: Cluster, gang: GangId) -> dict[int, str]:
    """The gang's ranks that something other than this runtime and the rank itself
    ended or is ending, as the latest observe() saw them, with the reason (a
    DisruptionTarget condition's, such as ``EvictionByEvictionAPI`` for a drain, or
    ``Evicted: <the kubelet's message>``). No API call: it reads what observe() kept."""
    with cluster.lock:
        return {
            rank: reason
            for (job_id, attempt, rank), reason in cluster.disrupted.items()
            if (job_id, attempt) == (gang.job_id, gang.attempt)
        }


def _parse_time(value: Any) -> float | None:
    if value is None:
        return None
    return float(value.timestamp())


def _pod_key(pod: Any) -> str:
    return f"{pod.metadata.namespace}/{pod.metadata.name}"


def _disruption(pod: Any) -> Any | None:
    for condition in pod.status.conditions or []:
        if condition.type == "DisruptionTarget" and condition.status == "True":
            return condition
    return None


def _taken_by(pod: Any) -> str | None:
    """Why something other than the rank ended or is ending its pod, or None: the
    DisruptionTarget condition's reason, else the kubelet's own eviction (the pod's
    reason ``Evicted``, which a limit eviction sets without a condition)."""
    condition = _disruption(pod)
    if condition is not None:
        return str(condition.reason)
    if pod.status.reason == "Evicted":
        return f"Evicted: {(pod.status.message or '').strip()}"
    return None


def _end_reason(pod: Any) -> str:
    """Why an ended pod ended, where the protocol has a name for it: "disk-limit" when
    the kubelet evicted it past its ephemeral-storage limit (its message, as kubelet
    v1.34 words it: "Pod ephemeral local storage usage exceeds the total limit of
    containers 16Mi." or "Container rank exceeded its local ephemeral storage limit")."""
    if pod.status.reason == "Evicted" and "ephemeral" in (pod.status.message or ""):
        return "disk-limit"
    return ""


def rank_observation(
    pod: Any, signalled_at: float | None, ready_nodes: set[str] | None = None
) -> RankObservation:
    """Map one rank pod to a RankObservation.

    Terminal phases are ``exited`` with the container's exit code; a pod on a
    node that is not Ready is ``lost``; a pod being deleted or marked with a
    DisruptionTarget condition is ``terminating``.

    ``signalled_at`` is when this runtime stopped the gang, from the gang's record
    (written before any of its pods is evicted or deleted) or this worker's memory.
    An Eviction API call carries no mark of who made it, so an eviction of a pod of
    a gang this runtime never stopped is someone else's (``kubectl drain``, the
    kubelet, kube-scheduler), whether of one rank or of every rank: its signal is
    not recorded as sent, and the gang guard and the reconciler see a disruption.
    """
    labels = pod.metadata.labels or {}
    started_at = exited_at = None
    exit_code = None
    running = False
    for status in pod.status.container_statuses or []:
        if status.state is None:
            continue
        if status.state.running is not None:
            running = True
            started_at = _parse_time(status.state.running.started_at)
        if status.state.terminated is not None:
            exit_code = int(status.state.terminated.exit_code)
            started_at = _parse_time(status.state.terminated.started_at)
            exited_at = _parse_time(status.state.terminated.finished_at)
    if exit_code is None and pod.status.phase == "Failed":
        # The rank never started: a failed init container (its checkpoint folder) ended it.
        for status in pod.status.init_container_statuses or []:
            terminated = status.state.terminated if status.state is not None else None
            if terminated is not None and terminated.exit_code:
                exit_code = int(terminated.exit_code)
                exited_at = _parse_time(terminated.finished_at)
    node = pod.spec.node_name or labels.get(NODE_LABEL, "")
    if pod.status.phase in ("Succeeded", "Failed"):
        phase = "exited"
    elif pod.metadata.deletion_timestamp is not None and not pod.spec.node_name:
        # Deleted before kube-scheduler bound it: it never ran and never will,
        # and no kubelet will ever report on it. Only the finalizer keeps it.
        phase = "exited"
    elif ready_nodes is not None and pod.spec.node_name and pod.spec.node_name not in ready_nodes:
        phase = "lost"
    elif pod.metadata.deletion_timestamp is not None or _disruption(pod) is not None:
        phase = "terminating"
    elif running:
        phase = "running"
    else:
        phase = "starting"
    return RankObservation(
        waiting_reason=_waiting_reason(pod) if phase == "starting" else "",
        end_reason=_end_reason(pod) if phase == "exited" else "",
        job_id=int(labels[JOB_LABEL]),
        attempt=int(labels[ATTEMPT_LABEL]),
        rank=int(labels[RANK_LABEL]),
        node=node,
        phase=phase,
        exit_code=exit_code,
        handle=pod.metadata.name,
        started_at=started_at,
        exited_at=exited_at,
        signal_sent_at=signalled_at,
    )


def _waiting_reason(pod: Any) -> str:
    """Why a pod that has not started is waiting: its containers' reason (an init
    container's first: the rank's then only says PodInitializing), else unschedulable."""
    statuses = [*(pod.status.init_container_statuses or []), *(pod.status.container_statuses or [])]
    for status in statuses:
        waiting = status.state.waiting if status.state is not None else None
        if waiting is not None and waiting.reason != "PodInitializing":
            return str(waiting.reason or "")
    for condition in pod.status.conditions or []:
        if condition.type == "PodScheduled" and condition.status == "False":
            return str(condition.reason or "Unschedulable")
    return ""


def gang_guard_victims(
    observations: Iterable[RankObservation],
    *,
    disrupted: Collection[tuple[int, int, int]] = (),
) -> list[GangId]:
    """Gangs whose remaining ranks must be stopped because one rank was taken away.

    A gang qualifies when one of its ranks is lost, or is terminating or
    exited with a non-zero code although Quartermaster never signalled it
    (kube-scheduler preempted it, its node went away, someone deleted it), while
    another rank is still starting or running unsignalled: that rank would
    otherwise wait forever on a collective. A rank that finished with exit code
    0 is a normal end and takes no one down with it, unless ``disrupted`` (job,
    attempt, rank triples of pods with a DisruptionTarget condition) says it
    was preempted and merely exited cleanly.
    """
    by_gang: dict[GangId, list[RankObservation]] = {}
    for observation in observations:
        by_gang.setdefault(GangId(observation.job_id, observation.attempt), []).append(observation)
    victims = []
    for gang, ranks in sorted(by_gang.items(), key=lambda item: (item[0].job_id, item[0].attempt)):
        taken = any(
            rank.phase == "lost"
            or (
                rank.signal_sent_at is None
                and (
                    rank.phase == "terminating"
                    or (
                        rank.phase == "exited"
                        and (
                            rank.exit_code not in (0, None)
                            or (rank.job_id, rank.attempt, rank.rank) in disrupted
                        )
                    )
                )
            )
            for rank in ranks
        )
        waiting = any(
            rank.phase in ("starting", "running") and rank.signal_sent_at is None for rank in ranks
        )
        if taken and waiting:
            victims.append(gang)
    return victims
