"""Reading a rank's container log through the API server: a slice, or its tail.

It only reads pod logs; it never changes a pod and never reads the models.
"""

from __future__ import annotations

from collections.abc import Iterator

from kubernetes.client.exceptions import ApiException

from preemption.runtimes.base import GangId, RuntimePermanentError
from preemption.runtimes.kubernetes.cluster import Cluster, translate
from preemption.runtimes.kubernetes.config import CONTAINER_NAME, pod_name

LOG_CHUNK_BYTES = 64 * 1024


def read_log(
    cluster: Cluster, gang: GangId, rank: int, offset: int = 0, limit: int = 1 << 20
) -> bytes:
    """A slice of one rank's container log, through the API server.

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
    for position, chunk in _stream_log(cluster, gang, rank, offset + limit):
        start = max(0, offset - position)
        if start < len(chunk):
            kept += chunk[start : start + limit - len(kept)]
    return bytes(kept)


def read_log_tail(cluster: Cluster, gang: GangId, rank: int, max_bytes: int) -> tuple[bytes, int]:
    """The last ``max_bytes`` of a rank's log and the offset they start at.

    Streams the whole log once, keeping at most about twice ``max_bytes``.
    """
    tail = bytearray()
    total = 0
    for _, chunk in _stream_log(cluster, gang, rank, None):
        total += len(chunk)
        tail += chunk
        if len(tail) > 2 * max_bytes:
            del tail[: len(tail) - max_bytes]
    kept = bytes(tail[-max_bytes:]) if max_bytes else b""
    return kept, total - len(kept)


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
