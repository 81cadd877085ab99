"""The Kubernetes runtime's connection to one cluster, and what it keeps between calls.

``Cluster`` holds the API clients, the pool of threads that issue one call per rank,
and the caches every part of the runtime shares (each can be rebuilt from the
cluster). The functions below turn an answer of the Kubernetes client into the
protocol's two errors. It makes no decision about a gang and imports no other
module of the runtime but its names.
"""

from __future__ import annotations

import contextlib
import copy
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from preemption.runtimes.base import GangId, RuntimePermanentError, RuntimeTemporaryError
from preemption.runtimes.kubernetes.config import (
    GANG_LABEL,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    KubernetesRuntimeConfig,
    gang_name,
)


class Cluster:
    """The API clients, the thread pool and the caches of one KubernetesRuntime."""

    def __init__(self, api_client: client.ApiClient, settings: KubernetesRuntimeConfig) -> None:
        self.settings = settings
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.pool = ThreadPoolExecutor(
            max_workers=self.settings.api_workers, thread_name_prefix="qm-k8s"
        )
        self.lock = threading.Lock()
        # Caches only: everything here can be rebuilt from the cluster.
        self.world_sizes: dict[GangId, tuple[str, int]] = {}
        self.signalled: dict[GangId, float] = {}
        self.blocked: dict[GangId, dict[int, str]] = {}
        # The cadence hint last written to each gang's ConfigMap.
        self.published_risk: dict[GangId, str] = {}
        self.relists = 0
        # The pod watch (watch_pods): a cache of every gang pod, kept by one
        # thread, so a reconcile cycle lists gang records and nodes but no pods.
        self.pod_cache: dict[str, Any] = {}
        self.pod_cache_ready = threading.Event()
        self.pod_watch: threading.Thread | None = None
        self.closing = threading.Event()
        # (job, attempt, rank) of pods that something other than this runtime and
        # the rank itself ended or is ending at the latest observe() (an unmarked
        # pod with a DisruptionTarget condition or the kubelet's eviction), with why.
        self.disrupted: dict[tuple[int, int, int], str] = {}
        # time.monotonic() of the last Eviction answer of the latest signal():
        # the end of "decision to last eviction answered".
        self.last_eviction_answered_at = 0.0
        # Following stopped ranks' logs until their containers end (logs.keep_logs):
        # threads and connections of their own, as each follow lasts as long as the
        # rank's grace, and what was kept of each (its end, and where that starts).
        self.log_followers = ThreadPoolExecutor(
            max_workers=max(1, self.settings.log_followers), thread_name_prefix="qm-k8s-log"
        )
        followers_config = copy.copy(api_client.configuration)
        followers_config.connection_pool_maxsize = max(1, self.settings.log_followers)
        self.log_client = client.ApiClient(followers_config)
        self.followed: set[tuple[GangId, int]] = set()
        self.kept_logs: dict[tuple[GangId, int], tuple[bytes, int]] = {}

    def close(self) -> None:
        """Release the worker threads and connections."""
        self.closing.set()
        self.pool.shutdown(wait=True)
        # A follow ends with its rank's container; one still open is not waited for.
        self.log_followers.shutdown(wait=False, cancel_futures=True)
        self.log_client.close()
        self.api_client.close()

    def create_ignoring_conflict(
        self, create: Callable[..., Any], namespace: str, body: dict[str, Any]
    ) -> None:
        """Create an object unless one of its name exists already (409)."""
        try:
            create(namespace, body)
        except ApiException as error:
            if error.status != 409:
                what = f"create {body['kind']} {body['metadata']['name']}"
                raise translate(error, what) from error

    # -- gang record -------------------------------------------------------------
    def gang_location(self, gang: GangId) -> tuple[str, int] | None:
        """(namespace, world size) of a gang, from the cache or the cluster."""
        with self.lock:
            known = self.world_sizes.get(gang)
        if known is not None:
            return known
        selector = f"{MANAGED_BY_LABEL}={MANAGED_BY},{GANG_LABEL}={gang_name(gang)}"
        try:
            if self.settings.namespace_per_team:
                records = self.core.list_config_map_for_all_namespaces(label_selector=selector)
            else:
                records = self.core.list_namespaced_config_map(
                    self.settings.namespace, label_selector=selector
                )
        except ApiException as error:
            raise translate(error, f"find gang {gang_name(gang)}") from error
        if not records.items:
            return None
        record = records.items[0]
        location = (record.metadata.namespace, int((record.data or {}).get("world_size", "0")))
        with self.lock:
            self.world_sizes[gang] = location
        return location

    def annotate(self, gang: GangId, namespace: str, annotations: dict[str, str]) -> None:
        """Add annotations to the gang record, ignoring a failure (they are hints)."""
        with contextlib.suppress(ApiException):
            self.core.patch_namespaced_config_map(
                gang_name(gang), namespace, {"metadata": {"annotations": annotations}}
            )


# -- errors ------------------------------------------------------------------------


def is_gone(error: ApiException) -> bool:
    """Whether the API server answered that the object does not exist."""
    return error.status == 404


def is_temporary(error: ApiException) -> bool:
    """Whether an API answer may pass by itself: a conflict, a throttle, no answer, a 5xx."""
    return error.status in (409, 429) or error.status is None or error.status >= 500


def classify(
    error: Exception,
) -> type[RuntimeTemporaryError] | type[RuntimePermanentError] | None:
    """The protocol's error for an exception of the Kubernetes client: an API answer
    by its status, a failed connection or a timeout (urllib3, the socket) as temporary."""
    if isinstance(error, ApiException):
        return RuntimeTemporaryError if is_temporary(error) else RuntimePermanentError
    if isinstance(error, (urllib3.exceptions.HTTPError, OSError)):
        return RuntimeTemporaryError
    return None


def translate(error: ApiException, what: str) -> Exception:
    """The protocol's error for an API answer to ``what``, with the server's words."""
    message = f"{what}: {error.status} {error.reason}: {status_message(error)}"
    body = str(error.body)
    if is_temporary(error) or (
        error.status == 403 and ("serviceaccount" in body or "PriorityClass" in body)
    ):
        # Refusals that pass by themselves: a namespace just created has
        # no default service account for a moment, and a PriorityClass
        # missing now is created by the next PriorityClass reconcile.
        return RuntimeTemporaryError(message)
    return RuntimePermanentError(message)


def error_text(error: ApiException) -> str:
    """The start of an API answer's body."""
    return str(error.body or "")[:300]


def status_message(error: ApiException) -> str:
    """The API server's own explanation from a Status body, else the raw body."""
    try:
        return str(json.loads(error.body or "")["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return error_text(error)
