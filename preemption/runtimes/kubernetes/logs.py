"""Reading a rank's container log through the API server: a slice, or its tail; and
keeping the end of a stopped rank's log, which its kubelet deletes with it.

A kubelet removes the exited containers of a pod that is deleted, evictions included,
as soon as it has stopped them (kubelet ``cleanUpContainersInPod``: "when an evicted
or deleted pod has already synced, all containers can be removed"), and their logs
with them: read afterwards, the log API answers one line of the kubelet's as the log's
body, "unable to retrieve container logs for <container>" once the container is gone,
or "failed to try resolving symlinks in path <its log>: ... no such file or directory"
while the runtime still lists a container whose log folder is gone. So when the runtime stops
a gang, ``keep_logs`` follows each rank's log until its container ends and keeps its
last KEPT_LOG_BYTES in a ConfigMap of the rank's own (owned by the gang record, so the
garbage collector removes it with the gang), where any worker reads it back.
It never changes a pod and never reads the models.
"""

from __future__ import annotations

import base64
import logging
import re
from collections.abc import Iterator

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from preemption.runtimes.base import GangId, RuntimePermanentError, RuntimeTemporaryError
from preemption.runtimes.kubernetes.cluster import Cluster, is_gone, translate
from preemption.runtimes.kubernetes.config import (
    ATTEMPT_LABEL,
    CONTAINER_NAME,
    JOB_LABEL,
    KEPT_LOG_FIRST_BYTE_ANNOTATION,
    KEPT_LOG_OF_LABEL,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    RANK_LABEL,
    gang_name,
    kept_log_name,
    pod_name,
)

logger = logging.getLogger(__name__)

LOG_CHUNK_BYTES = 64 * 1024
# What a ConfigMap keeps of a stopped rank's log: its whole size is at most 1 MiB,
# and binaryData is base64 (4 bytes for 3).
KEPT_LOG_BYTES = 512 * 1024
# The bodies a kubelet answers for the log of a container it has removed: one line,
# whose second form quotes the log's path twice (each at most PATH_MAX).
REMOVED_CONTAINER = re.compile(
    rb"(?:unable to retrieve container logs for [a-z]+://[0-9a-f]+"
    rb'|failed to try resolving symlinks in path "[^"\n]+\.log": '
    rb"lstat [^\n]+: no such file or directory)\s*"
)
REMOVED_ANSWER_BYTES = 2 * 4096 + 128
# How long a follow may wait for a line beyond its rank's grace before giving up.
FOLLOW_SLACK_SECONDS = 60


def read_log(
    cluster: Cluster, gang: GangId, rank: int, offset: int = 0, limit: int = 1 << 20
) -> bytes:
    """A slice of one rank's container log, through the API server; of a container its
    kubelet removed, of the end kept when it was stopped (empty where none was).

    The pod log API has no offset, so the log is streamed and the bytes
    before ``offset`` are dropped as they arrive: memory holds one chunk
    and the slice, never the log. An offset past ``log_scan_bytes`` is
    refused, so no request makes a process stream a huge log.
    """
    if offset < 0 or limit < 0:
        raise RuntimePermanentError(f"bad log range: offset {offset}, limit {limit}")
    if offset + limit > cluster.settings.log_scan_bytes:
        raise RuntimePermanentError(
            f"a live log is read up to byte {cluster.settings.log_scan_bytes} only; "
            "the end of every rank's log is kept when its attempt ends"
        )
    kept = bytearray()
    # The kubelet's answer for a removed container is one line.
    head = bytearray()
    # At least the kubelet's whole answer, to tell it from a log that starts alike.
    for position, chunk in _stream_log(
        cluster, gang, rank, max(offset + limit, REMOVED_ANSWER_BYTES)
    ):
        if position < REMOVED_ANSWER_BYTES:
            head += chunk
        start = max(0, offset - position)
        if start < len(chunk):
            kept += chunk[start : start + limit - len(kept)]
    if len(head) < REMOVED_ANSWER_BYTES and removed_container(bytes(head)):
        # The container is gone: the part of its log's end kept when it was stopped.
        end, first_byte = _kept_log(cluster, gang, rank)
        if end is None:
            return b""
        start = max(0, offset - first_byte)
        return end[start : start + limit]
    return bytes(kept)


def read_log_tail(cluster: Cluster, gang: GangId, rank: int, max_bytes: int) -> tuple[bytes, int]:
    """The last ``max_bytes`` of a rank's log and the offset they start at.

    Streams the whole log once, keeping at most about twice ``max_bytes``. Where the
    kubelet has removed the container, the end kept when the rank was stopped
    (``keep_logs``); where none was kept, RuntimePermanentError says the log is gone.
    """
    tail = bytearray()
    head = bytearray()
    total = 0
    for _, chunk in _stream_log(cluster, gang, rank, None):
        if total < REMOVED_ANSWER_BYTES:
            head += chunk
        total += len(chunk)
        tail += chunk
        if len(tail) > 2 * max_bytes:
            del tail[: len(tail) - max_bytes]
    if total < REMOVED_ANSWER_BYTES and removed_container(bytes(head)):
        kept, first_byte = _kept_log(cluster, gang, rank)
        if kept is None:
            raise RuntimePermanentError(
                f"the log of {pod_name(gang, rank)} went with its container, which its "
                "kubelet removed once the pod was deleted, and none of it was kept"
            )
        shown = kept[-max_bytes:] if max_bytes else b""
        return shown, first_byte + len(kept) - len(shown)
    kept = bytes(tail[-max_bytes:]) if max_bytes else b""
    return kept, total - len(kept)


def removed_container(body: bytes) -> bool:
    """Whether a log's body is a kubelet's answer for a container it has removed."""
    return REMOVED_CONTAINER.fullmatch(body) is not None


def keep_logs(
    cluster: Cluster, gang: GangId, namespace: str, world_size: int, grace: float
) -> None:
    """Follow each rank's log, from now until its container ends, and keep its end.

    Returns at once: the follows run on threads and connections of their own, at most
    ``log_followers`` at a time, one per rank however often the gang is stopped."""
    for rank in range(world_size):
        with cluster.lock:
            if (gang, rank) in cluster.followed:
                continue
            cluster.followed.add((gang, rank))
        cluster.log_followers.submit(_follow, cluster, gang, namespace, rank, grace)


def _follow(cluster: Cluster, gang: GangId, namespace: str, rank: int, grace: float) -> None:
    core = client.CoreV1Api(cluster.log_client)
    name = pod_name(gang, rank)
    try:
        response = core.read_namespaced_pod_log(
            name,
            namespace,
            container=CONTAINER_NAME,
            follow=True,
            _preload_content=False,
            _headers={"Accept-Encoding": "identity"},
            _request_timeout=(10, grace + FOLLOW_SLACK_SECONDS),
        )
    except (ApiException, urllib3.exceptions.HTTPError, OSError) as error:
        logger.info("the log of %s could not be followed: %s", name, error)
        _unfollowed(cluster, gang, rank)
        return
    tail = bytearray()
    total = 0
    try:
        for chunk in response.stream(LOG_CHUNK_BYTES, decode_content=True):
            total += len(chunk)
            tail += chunk
            if len(tail) > 2 * KEPT_LOG_BYTES:
                del tail[: len(tail) - KEPT_LOG_BYTES]
    except (urllib3.exceptions.HTTPError, OSError) as error:
        # Cut short: the end is not the container's end, so nothing is kept, and a
        # later stop of the gang follows the rank again.
        logger.info("following the log of %s was cut short: %s", name, error)
        _unfollowed(cluster, gang, rank)
        return
    finally:
        response.release_conn()
    kept = bytes(tail[-KEPT_LOG_BYTES:])
    if total < REMOVED_ANSWER_BYTES and removed_container(kept):
        logger.info("the log of %s was gone before it could be followed", name)
        return
    first_byte = total - len(kept)
    with cluster.lock:
        cluster.kept_logs[(gang, rank)] = (kept, first_byte)
    try:
        record = cluster.core.read_namespaced_config_map(gang_name(gang), namespace)
        cluster.create_ignoring_conflict(
            cluster.core.create_namespaced_config_map,
            namespace,
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": kept_log_name(gang, rank),
                    # Not the gang label: listings of gang records select by it.
                    "labels": {
                        MANAGED_BY_LABEL: MANAGED_BY,
                        JOB_LABEL: str(gang.job_id),
                        ATTEMPT_LABEL: str(gang.attempt),
                        RANK_LABEL: str(rank),
                        KEPT_LOG_OF_LABEL: gang_name(gang),
                    },
                    "annotations": {KEPT_LOG_FIRST_BYTE_ANNOTATION: str(first_byte)},
                    "ownerReferences": [
                        {
                            "apiVersion": "v1",
                            "kind": "ConfigMap",
                            "name": gang_name(gang),
                            "uid": record.metadata.uid,
                        }
                    ],
                },
                "binaryData": {"log": base64.b64encode(kept).decode()},
            },
        )
    except (ApiException, RuntimeTemporaryError, RuntimePermanentError, OSError):
        # This worker keeps it in memory still; another finds none and says so.
        return
    except urllib3.exceptions.HTTPError:
        return


def _unfollowed(cluster: Cluster, gang: GangId, rank: int) -> None:
    with cluster.lock:
        cluster.followed.discard((gang, rank))


def _kept_log(cluster: Cluster, gang: GangId, rank: int) -> tuple[bytes | None, int]:
    """The end of a stopped rank's log that ``keep_logs`` kept, and where it starts:
    from this worker's memory, else from its ConfigMap; (None, 0) when none was kept."""
    with cluster.lock:
        kept = cluster.kept_logs.get((gang, rank))
    if kept is not None:
        return kept
    location = cluster.gang_location(gang)
    if location is None:
        return None, 0
    try:
        record = cluster.core.read_namespaced_config_map(kept_log_name(gang, rank), location[0])
    except ApiException as error:
        # The portal's web server may read logs but no ConfigMap (deploy/rbac.yaml).
        if is_gone(error) or error.status == 403:
            return None, 0
        raise translate(error, f"read {kept_log_name(gang, rank)}") from error
    content = base64.b64decode((record.binary_data or {}).get("log", ""))
    annotations = record.metadata.annotations or {}
    return content, int(annotations.get(KEPT_LOG_FIRST_BYTE_ANNOTATION, "0"))


def _stream_log(
    cluster: Cluster, gang: GangId, rank: int, up_to: int | None
) -> Iterator[tuple[int, bytes]]:
    """(offset, chunk) pairs of a rank's log, up to byte ``up_to`` when given."""
    location = cluster.gang_location(gang)
    if location is None:
        return
    try:
        response = cluster.core.read_namespaced_pod_log(
            pod_name(gang, rank),
            location[0],
            container=CONTAINER_NAME,
            limit_bytes=up_to,
            _preload_content=False,
            # Uncompressed: a gzipped log of repeated bytes would inflate
            # far past one chunk on the first read.
            _headers={"Accept-Encoding": "identity"},
        )
    except ApiException as error:
        if error.status in (400, 404):
            return
        raise translate(error, f"read log of {pod_name(gang, rank)}") from error
    position = 0
    try:
        for chunk in response.stream(LOG_CHUNK_BYTES, decode_content=True):
            yield position, chunk
            position += len(chunk)
    finally:
        response.release_conn()
