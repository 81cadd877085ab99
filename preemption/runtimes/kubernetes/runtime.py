"""KubernetesRuntime: the protocol's calls, each handed to the module that does it.

The class holds the settings and the Cluster (clients, thread pool, caches) and
delegates: launch.py creates and removes a gang's objects, evict.py stops its
pods, observe.py reads them back, logs.py reads their logs. Its methods stay
on the class itself because ``translate_errors`` wraps the protocol's calls
defined there. It imports no Django.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

from kubernetes import client, config

from preemption.runtimes.base import (
    GangGuard,
    GangId,
    GangSpec,
    NodeInventory,
    RankObservation,
    RuntimePermanentError,
    translate_errors,
)
from preemption.runtimes.kubernetes import evict, launch, logs, observe, policies
from preemption.runtimes.kubernetes.cluster import Cluster, classify
from preemption.runtimes.kubernetes.config import (
    IMAGE_PULL_POLICIES,
    NO_CHECKPOINT_VOLUME,
    KubernetesRuntimeConfig,
    namespace_for,
)
from preemption.runtimes.kubernetes.spec import on_checkpoint_volume, rank_resources

# How long a follow of a gang that someone else stops waits for a line: its grace is
# not known here.
OTHERS_GRACE_SECONDS = 300.0


@translate_errors(classify)
class KubernetesRuntime:
    """Runs gangs as pods on a Kubernetes cluster through the API server."""

    name = "kubernetes"
    # Pods cannot be signalled but by their eviction, so the checkpoint notice is
    # an answer on the trap's events channel, which the ranks poll (see
    # preemption.notice); launch() tells them to.
    notice_delivery = "poll"

    def __init__(
        self, api_client: client.ApiClient, settings: KubernetesRuntimeConfig | None = None
    ) -> None:
        self.settings = settings or KubernetesRuntimeConfig()
        if self.settings.require_checkpoint_claim and not self.settings.checkpoint_claim:
            raise RuntimePermanentError(NO_CHECKPOINT_VOLUME)
        if self.settings.image_pull_policy not in IMAGE_PULL_POLICIES:
            raise RuntimePermanentError(
                f"image pull policy {self.settings.image_pull_policy!r} is not one of "
                f"{', '.join(IMAGE_PULL_POLICIES)}"
            )
        self.api_client = api_client
        self.cluster = Cluster(api_client, self.settings)
        self.core = self.cluster.core

    @classmethod
    def from_kubeconfig(
        cls, kubeconfig: str | None = None, settings: KubernetesRuntimeConfig | None = None
    ) -> KubernetesRuntime:
        """Build a runtime from a kubeconfig file, or from the in-cluster service account."""
        configuration = client.Configuration()
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        else:
            config.load_incluster_config(client_configuration=configuration)
        workers = (settings or KubernetesRuntimeConfig()).api_workers
        # Every rank's Eviction goes out at once: give each its own connection.
        configuration.connection_pool_maxsize = workers
        return cls(client.ApiClient(configuration), settings)

    def close(self) -> None:
        """Release the worker threads and connections."""
        self.cluster.close()

    @property
    def relists(self) -> int:
        """Pod listings of the latest watch_ranks(), or of the pod watch."""
        return self.cluster.relists

    @property
    def last_eviction_answered_at(self) -> float:
        """time.monotonic() of the last Eviction answer of the latest signal():
        the end of "decision to last eviction answered"."""
        return self.cluster.last_eviction_answered_at

    # -- naming ----------------------------------------------------------------
    def namespace_for(self, team: str) -> str:
        """The namespace a team's gangs run in."""
        return namespace_for(self.settings, team)

    def checkpoint_is_durable(self, path: str) -> bool:
        """Whether a checkpoint at ``path`` (as a rank sees it) is on the shared volume."""
        return on_checkpoint_volume(
            path, self.settings.checkpoint_claim, self.settings.checkpoint_mount_path
        )

    # -- launch ----------------------------------------------------------------
    def launch(self, spec: GangSpec) -> None:
        """Create the gang's ConfigMap, Secret, Service and one pod per rank.

        Idempotent: objects that already exist are left alone, and a launch cut
        short half-way is completed by the next call.
        """
        launch.launch(self.cluster, spec)

    def ensure_network_policy(self, namespace: str) -> None:
        """Create the jobs namespace's default-deny NetworkPolicy if it is missing."""
        policies.ensure_network_policy(self.cluster, namespace)

    def rank_resources(self, spec: GangSpec) -> dict[str, str]:
        """One rank's requests and limits: its GPUs and the flavor's CPU, memory and
        ephemeral storage per GPU."""
        return rank_resources(self.settings, spec)

    # -- notice, signal and kill ----------------------------------------------
    def notice(self, gang: GangId, signal_name: str) -> None:
        """Nothing to send: the ranks learn of the notice when they next poll the
        events endpoint, which answers from the notice the reconciler recorded."""
        del gang, signal_name

    def signal(self, gang: GangId, grace_seconds: float) -> None:
        """Evict every rank at once with ``gracePeriodSeconds``; retry 429 with backoff.

        Idempotent: ranks already gone count as done, and a second call only
        re-issues evictions (the API server never lengthens a grace period).
        Raises RuntimeTemporaryError naming the ranks a PodDisruptionBudget
        still protects after ``eviction_retry_seconds``.

        The ranks' logs are followed from then until their containers end, so their
        ends outlive the containers the kubelets remove (logs.keep_logs).
        """
        try:
            evict.signal(self.cluster, gang, grace_seconds)
        finally:
            self._keep_logs(gang, grace_seconds)

    def eviction_blocked(self, gang: GangId) -> dict[int, str]:
        """Ranks whose last eviction a PodDisruptionBudget refused, with the reason."""
        return evict.eviction_blocked(self.cluster, gang)

    def kill(self, gang: GangId) -> None:
        """Delete every rank's pod with grace 0. Idempotent."""
        self._keep_logs(gang, 0)
        evict.kill(self.cluster, gang)

    def _keep_logs(self, gang: GangId, grace_seconds: float) -> None:
        location = self.cluster.gang_location(gang)
        if location is not None:
            logs.keep_logs(self.cluster, gang, *location, grace_seconds)

    # -- observe ---------------------------------------------------------------
    def observe(self, gang: GangId | None = None) -> list[RankObservation]:
        """Every rank's state from a fresh listing of pods, gang records and nodes.

        A gang seen ending by someone else's doing (a drain, kube-scheduler, a node's
        eviction) has its ranks' logs followed from then on, as one this runtime stops.
        """
        observations = observe.observe(self.cluster, gang)
        ending = {GangId(o.job_id, o.attempt) for o in observations if o.phase == "terminating"}
        for ended in sorted(ending, key=lambda g: (g.job_id, g.attempt)):
            self._keep_logs(ended, OTHERS_GRACE_SECONDS)
        return observations

    def pod_watch_in_sync(self) -> bool:
        """Whether observe() reads pods from the watch cache right now."""
        return observe.pod_watch_in_sync(self.cluster)

    def disruptions(self, gang: GangId) -> dict[int, str]:
        """Ranks carrying a DisruptionTarget condition, with its reason (observe.disruptions)."""
        return observe.disruptions(self.cluster, gang)

    def watch_ranks(
        self,
        gang: GangId | None = None,
        *,
        stop: threading.Event,
        resource_version: str | None = None,
        timeout_seconds: int = 30,
    ) -> Iterator[RankObservation]:
        """Yield rank observations as pods change, until ``stop`` is set (observe.watch_ranks)."""
        return observe.watch_ranks(
            self.cluster,
            gang,
            stop=stop,
            resource_version=resource_version,
            timeout_seconds=timeout_seconds,
        )

    # -- nodes, logs, ports, forget -----------------------------------------------
    def nodes(self) -> list[NodeInventory]:
        """Nodes with allocatable GPUs, their flavor from the flavor label and their
        topology from the configured topology labels."""
        return observe.nodes(self.cluster)

    def read_log(self, gang: GangId, rank: int, offset: int = 0, limit: int = 1 << 20) -> bytes:
        """A slice of one rank's container log, through the API server (logs.read_log)."""
        return logs.read_log(self.cluster, gang, rank, offset, limit)

    def read_log_tail(self, gang: GangId, rank: int, max_bytes: int) -> tuple[bytes, int]:
        """The last ``max_bytes`` of a rank's log and the offset they start at."""
        return logs.read_log_tail(self.cluster, gang, rank, max_bytes)

    def released_ports(self, gangs: Sequence[GangId]) -> dict[GangId, list[int]]:
        """For each gang, the rendezvous port while any of its rank pods still runs;
        empty once all have ended.

        Each pod has its own network namespace, so a port cannot outlive the
        pod that bound it.
        """
        live = ("starting", "running", "terminating")
        return {
            gang: [self.settings.master_port]
            if any(o.phase in live for o in self.observe(gang))
            else []
            for gang in gangs
        }

    def publish_preemption_risk(self, gang: GangId, mtbp_seconds: float, *, team: str) -> None:
        """Write the gang's cadence hint into its ConfigMap, unless this runtime already
        wrote the same one (after a restart it writes each once more)."""
        launch.publish_preemption_risk(self.cluster, gang, mtbp_seconds, team=team)

    def forget(self, gang: GangId) -> None:
        """Release the pods' exit-code finalizers and delete the gang record.

        Deleting the ConfigMap garbage-collects the Service, the Secret and the
        pods through their owner references.
        """
        launch.forget(self.cluster, gang)

    # -- gang guard --------------------------------------------------------------
    @property
    def gang_guard(self) -> GangGuard:
        """Pods can be taken away by the cluster itself, so this runtime guards gangs."""
        return self

    def guard_victims(self, observations: Iterable[RankObservation] | None = None) -> list[GangId]:
        """``gang_guard_victims`` over ``observations`` that the caller has just made
        with observe(), else over a fresh observation of every gang, with their
        disruption conditions.

        A rank that kube-scheduler preempted may already have exited 0 (its
        trap checkpointed in time); its DisruptionTarget condition still says
        it was taken away rather than finished.
        """
        if observations is None:
            observations = self.observe()
        with self.cluster.lock:
            disrupted = set(self.cluster.disrupted)
        return observe.gang_guard_victims(observations, disrupted=disrupted)

    def taken_ranks(self, gang: GangId) -> dict[int, str]:
        """The gang's ranks that something other than this runtime and the rank itself
        ended or is ending, as the latest observe() saw them (observe.taken_ranks)."""
        return observe.taken_ranks(self.cluster, gang)

    def enforce_gang_guard(self, grace_seconds: Callable[[GangId], float]) -> list[GangId]:
        """Evict the rest of every gang that lost a rank to someone else.

        Returns the gangs it signalled. Level-triggered: a gang already
        signalled is not picked again.
        """
        victims = self.guard_victims()
        for gang in victims:
            self.signal(gang, grace_seconds(gang))
        return victims
