"""The Kubernetes runtime: one bare Pod per rank, evicted as one gang.

Objects of one gang (job id, attempt), all in one namespace:

* a ConfigMap ``qm-<job>-<attempt>``: the gang's record and the owner of every
  other object, so deleting it garbage-collects the gang. Its annotations keep
  what must survive a restart of the worker: when the gang was launched and
  when it was signalled or killed;
* a Secret ``qm-<job>-<attempt>-events`` holding ``QM_EVENTS_TOKEN``;
* a ConfigMap ``qm-<job>-<attempt>-risk`` holding the cadence hint (the gang's
  mean time between preemptions, key ``mtbp``), mounted read-only in every rank at
  ``/var/run/quartermaster/risk``, where ``QM_PREEMPTION_MTBP_FILE`` points. The
  control plane patches it while the gang runs; kubelets refresh ConfigMap
  volumes within about a minute, soon enough for a cadence. A ConfigMap of its
  own rather than a key of the gang record: the record carries the placement
  and the control plane's annotations, none of which a rank needs to read;
* a NetworkPolicy ``qm-<job>-<attempt>`` letting the gang's ranks reach each
  other; the namespace's default-deny policy (``network_policy``) shuts out
  everything else but DNS and the portal's events URL;
* a headless Service ``qm-<job>-<attempt>`` (``publishNotReadyAddresses``), so
  rank 0 resolves as ``rank-0.qm-<job>-<attempt>.<namespace>.svc.<domain>``
  before it is ready: that is ``MASTER_ADDR``;
* a Pod per rank ``qm-<job>-<attempt>-r<rank>``: restartPolicy Never, the
  gang's PriorityClass, terminationGracePeriodSeconds from the class's grace,
  a required node affinity to the node the engine placed it on, and the
  finalizer ``quartermaster.dev/exit-code``. Pods meet the "restricted" Pod
  Security Standard (non-root, no privilege escalation, no capabilities,
  seccomp RuntimeDefault, no service-account token), request and limit CPU,
  memory and ``ephemeral-storage`` by flavor, and mount only their own job's
  folder of the checkpoint volume (see "Checkpoints" below). The finalizer keeps a deleted
  pod's object (with its final container status) until ``forget()``, so an
  exit code is never lost between the kubelet reporting it and a worker
  reading it, even across a worker restart. kube-scheduler stops counting a
  pod's GPUs once its phase is terminal, finalizer or not.

Signalling is the ``policy/v1`` Eviction API for every rank concurrently with
``deleteOptions.gracePeriodSeconds``, each pod first marked with the annotation
``quartermaster.dev/stop-requested`` (killing marks them too): an eviction of an
unmarked rank, of one rank or of all, is someone else's (``kubectl drain``, the
kubelet, kube-scheduler), a disruption, even to a worker restarted since; a 429 (a PodDisruptionBudget says no) is
retried with backoff, and a gang still blocked raises RuntimeTemporaryError
and shows in ``eviction_blocked()``; the reconciler retries each cycle and,
once the grace deadline has passed, kills the gang (the preemption is then
"forced past a disruption budget"). Killing deletes every pod with grace 0.

Checkpoints. One ReadWriteMany claim holds every job's checkpoints, so each
rank must reach its own job's folder and nothing else of it:

* every job runs as a uid and gid of its own, ``job_uid_base + job id``
  (``runAsUser``, ``runAsGroup`` and ``fsGroup``), as the local runtime's
  runner does, so the kernel (or the NFS server) keeps two jobs' files apart;
* the rank container mounts the claim with ``subPath`` set to its job's
  folder, the last part of ``QM_CHECKPOINT_DIR`` (``job-<id>-<random>``), at
  ``QM_CHECKPOINT_DIR`` itself: the volume's root and the other jobs' folders
  are not in its filesystem at all;
* the folder must exist with the job's owner before that mount: a kubelet
  creates a missing subPath folder as root (mode copied from the volume root),
  and applies ``fsGroup`` to a volume only where its driver manages ownership,
  and then to the whole shared volume, never to one folder. An init container
  ``checkpoint-folder`` therefore creates it, running as the job's own uid and
  with the claim's root mounted: ``mkdir -m 0700``, then it checks that the
  folder is a directory the job owns (a name someone else took first fails the
  pod rather than sharing a folder). No step needs root or a capability, so the
  pod stays within "restricted", and the control plane mounts no claim itself.
  The root must let any uid create entries without listing or removing
  anyone's: mode ``1733`` (``deploy/checkpoints.yaml`` says how);
* the driver of the claim must not apply ``fsGroup`` to it (``fsGroupPolicy``
  ``None``, or the default ``ReadWriteOnceWithFSType``, which leaves
  ReadWriteMany volumes alone): ``File`` would hand every folder on the volume
  to the group of the last job started.

A planted file in a folder could run code in the job that resumes from it;
gracetrap loads checkpoints without unpickling anything, and this layout keeps
anyone but the job from writing there in the first place.

GPUs come to a rank only through its ``nvidia.com/gpu`` limit: a gang whose env
names ``CUDA_*`` or ``NVIDIA_*`` is refused by ``launch()`` before anything is
created (the submission refuses them already), since NVIDIA's container runtime
reads ``NVIDIA_VISIBLE_DEVICES`` to choose the devices it exposes. The init container asks for no GPU and sets
``NVIDIA_VISIBLE_DEVICES=void``, so an image that says ``all`` gets none there.

This module imports nothing from Django: the portal hands it plain values.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import posixpath
import re
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import urllib3
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from preemption.job_rules import image_admitted
from preemption.runtimes.base import (
    MTBP_FILE_ENV,
    GangGuard,
    GangId,
    GangSpec,
    NodeInventory,
    RankObservation,
    RuntimePermanentError,
    RuntimeTemporaryError,
    mtbp_text,
    translate_errors,
)

# The trap's notice poll (gracetrap.protocol.NOTICE_POLL_ENV and NOTICE_POLL_SECONDS):
# pods cannot be signalled, so the trap asks the events URL for the notice this often.
NOTICE_POLL_ENV = "QM_NOTICE_POLL_SECONDS"
NOTICE_POLL_SECONDS = 0.5

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "quartermaster"
GANG_LABEL = "quartermaster.dev/gang"
JOB_LABEL = "quartermaster.dev/job"
ATTEMPT_LABEL = "quartermaster.dev/attempt"
RANK_LABEL = "quartermaster.dev/rank"
NODE_LABEL = "quartermaster.dev/node"
TEAM_LABEL = "quartermaster.dev/team"
RISK_OF_LABEL = "quartermaster.dev/risk-of"
EXIT_CODE_FINALIZER = "quartermaster.dev/exit-code"
LAUNCHED_ANNOTATION = "quartermaster.dev/launched-at"
SIGNALLED_ANNOTATION = "quartermaster.dev/signalled-at"
GRACE_ANNOTATION = "quartermaster.dev/grace-seconds"
KILLED_ANNOTATION = "quartermaster.dev/killed-at"
# Set on a rank pod before this runtime evicts or deletes it for its own stop:
# "<attempt>/<signal or kill>/<when>". An Eviction API call carries no mark of who
# made it, so this is how the runtime, and a restarted one, tells its own stop of a
# rank from a drain's, the kubelet's or kube-scheduler's (a disruption).
STOP_REQUESTED_ANNOTATION = "quartermaster.dev/stop-requested"
GPU_RESOURCE = "nvidia.com/gpu"
LOG_CHUNK_BYTES = 64 * 1024
EVENTS_TOKEN_KEY = "QM_EVENTS_TOKEN"
CONTAINER_NAME = "rank"
# The cadence hint's ConfigMap key and where its volume is mounted in every rank.
RISK_KEY = "mtbp"
RISK_VOLUME = "preemption-risk"
RISK_MOUNT_PATH = "/var/run/quartermaster/risk"
# The checkpoint volume: the rank container's mount is its job's folder only; the
# init container that makes that folder sees the claim's root here.
CHECKPOINT_VOLUME = "checkpoints"
CHECKPOINT_FOLDER_CONTAINER = "checkpoint-folder"
CHECKPOINT_VOLUME_ROOT = "/var/run/quartermaster/checkpoint-volume"
CHECKPOINT_VOLUME_ENV = "QM_CHECKPOINT_VOLUME"
_CHECKPOINT_FOLDER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# Job N runs as uid and gid job_uid_base + N. Kubernetes accepts ids up to 2**31 - 1;
# the default base leaves about a billion job ids below that, and sits far above the
# ids that distributions and directory services hand to people and services, so no
# job's files belong to a real user of a node or of the file server.
DEFAULT_JOB_UID_BASE = 2**30
MAX_POD_UID = 2**31 - 1
# What the GPU runtime itself reads (preemption.job_rules refuses them at submission):
# a job's NVIDIA_VISIBLE_DEVICES=all would expose every GPU of the node.
RESERVED_GPU_ENV_PREFIXES = ("CUDA_", "NVIDIA_")
# The init container only makes a folder: small requests, and a limit on everything.
CHECKPOINT_FOLDER_RESOURCES = {"cpu": "100m", "memory": "64Mi", "ephemeral-storage": "16Mi"}

# The container's main process. The kubelet signals only PID 1, and a shell as
# PID 1 neither passes SIGTERM on nor dies of it, so the workload would only
# meet SIGKILL at the deadline. This wrapper runs the command in a child shell,
# and on SIGTERM ignores further ones and sends SIGTERM to its whole process
# group: every process of the rank gets it at once. The child shell, like the
# local runtime's, waits for its foreground command on SIGTERM and exits with
# its status, so a workload that checkpoints and exits 0 records 0. `wait` is
# repeated while the child lives because a trapped signal interrupts it; and once
# more after: a wait the trap cut short may already have collected the child's exit
# (dash and busybox ash then answer 128+15 and keep the real status for one more
# wait; 127 means it was already waited for). bash can still lose it (its wait
# then answers -1), so on an image whose /bin/sh is bash a rank signalled just as it
# exits may read 255.
RANK_ENTRYPOINT = r"""trap 'trap "" TERM; kill -TERM 0' TERM
/bin/sh -c "trap 'exit \$?' TERM
$1" &
child=$!
while :; do
    wait "$child"
    status=$?
    kill -0 "$child" 2>/dev/null || break
done
wait "$child" 2>/dev/null
again=$?
[ "$again" -eq 127 ] || status=$again
exit "$status"
"""

# The init container's script: make the job's folder on the claim's root (mode 1733:
# anyone may create, no one may list or remove another's) and refuse a folder that
# is not the job's own directory, a symlink or a name someone else took first. It
# runs in the job's image, which needs /bin/sh for the rank anyway and mkdir for
# this (a real kubelet showed it: an image of a shell alone failed here, saying so).
CHECKPOINT_FOLDER_SCRIPT = r"""folder="$QM_CHECKPOINT_VOLUME/$1"
if ! command -v mkdir >/dev/null; then
    echo "quartermaster: the job's image has no mkdir, which makes its checkpoint" \
         "folder $1 before the rank starts" >&2
    exit 1
fi
mkdir -m 0700 "$folder" 2>/dev/null || true
if [ -d "$folder" ] && [ ! -L "$folder" ] && [ -O "$folder" ]; then
    exit 0
fi
echo "quartermaster: cannot make the checkpoint folder $1 as uid $(id -u): it exists" \
     "and is not this job's directory, or the volume's root does not let uid $(id -u)" \
     "create it (it must be mode 1733)" >&2
exit 1
"""


@dataclass(frozen=True, slots=True)
class KubernetesRuntimeConfig:
    """How the runtime lays gangs out in the cluster.

    ``namespace`` holds every gang unless ``namespace_per_team`` is set, in which
    case team ``t`` runs in ``<team_namespace_prefix><t>`` (created on demand).
    ``pod_annotations`` are copied onto every rank pod. ``checkpoint_claim``
    mounts that PersistentVolumeClaim (ReadWriteMany, one of that name in each
    namespace gangs run in) at ``checkpoint_mount_path`` in every rank; with
    ``require_checkpoint_claim`` (production) the runtime refuses to start
    without one, since checkpoints in a container's own filesystem vanish
    with its pod. Ranks run as ``run_as_user`` under the "restricted" Pod
    Security Standard, with ``cpu_per_gpu``/``memory_per_gpu`` (by flavor,
    else the defaults) times the rank's GPUs as requests and limits.
    Job N's ranks run as uid and gid ``job_uid_base + N`` (see the module
    docstring), and ``ephemeral_storage_per_gpu`` (by flavor, else the default)
    times the rank's GPUs is its ``ephemeral-storage`` request and limit: a rank
    that fills the node's disk is evicted alone instead of putting the node under
    DiskPressure, which evicts other teams' pods.
    ``image_allowlist`` maps a team to the image prefixes it may run; a team
    not named may run any image. ``events_cidrs``/``events_port`` are where
    the portal's events URL is reached: the only egress the jobs namespace's
    NetworkPolicy allows besides the gang itself and DNS.
    With ``watch_pods`` observe() reads gang pods from a cache a watch keeps
    (one listing, then changes, listed again on 410 Gone) instead of listing
    them on every call.
    A 429 from the Eviction API is retried for ``eviction_retry_seconds`` before
    the call gives up with RuntimeTemporaryError.
    ``image_pull_policy`` is every container's ``imagePullPolicy``, set
    explicitly so a node never decides by the tag (``:latest`` means Always):
    ``IfNotPresent`` by default, ``Never`` where nodes have their images
    preloaded and no registry is reachable, ``Always`` where tags move.
    """

    namespace: str = "quartermaster"
    namespace_per_team: bool = False
    team_namespace_prefix: str = "qm-team-"
    default_image: str = "python:3.11-slim"
    cluster_domain: str = "cluster.local"
    master_port: int = 29500
    flavor_label: str = "quartermaster.dev/flavor"
    # Topology level -> the node label its domain is read from, outermost level first.
    topology_labels: Mapping[str, str] = field(default_factory=dict)
    service_account: str | None = None
    pod_annotations: Mapping[str, str] = field(default_factory=dict)
    checkpoint_claim: str | None = None
    checkpoint_mount_path: str = "/checkpoints"
    require_checkpoint_claim: bool = False
    job_uid_base: int = DEFAULT_JOB_UID_BASE
    cpu_per_gpu: Mapping[str, str] = field(default_factory=dict)
    memory_per_gpu: Mapping[str, str] = field(default_factory=dict)
    ephemeral_storage_per_gpu: Mapping[str, str] = field(default_factory=dict)
    default_cpu_per_gpu: str = "4"
    default_memory_per_gpu: str = "16Gi"
    default_ephemeral_storage_per_gpu: str = "20Gi"
    image_allowlist: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    events_cidrs: tuple[str, ...] = ()
    events_port: int = 443
    eviction_retry_seconds: float = 2.0
    api_workers: int = 32
    log_scan_bytes: int = 64 << 20
    watch_pods: bool = False
    image_pull_policy: str = "IfNotPresent"


IMAGE_PULL_POLICIES = ("Always", "IfNotPresent", "Never")


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


def gang_name(gang: GangId) -> str:
    """The name of a gang's ConfigMap, Secret prefix and Service."""
    return f"qm-{gang.job_id}-{gang.attempt}"


def risk_config_map_name(gang: GangId) -> str:
    """The name of the ConfigMap that holds a gang's cadence hint."""
    return f"{gang_name(gang)}-risk"


def pod_name(gang: GangId, rank: int) -> str:
    """The name of one rank's pod."""
    return f"{gang_name(gang)}-r{rank}"


NO_CHECKPOINT_VOLUME = (
    "no checkpoint volume is configured (QM_K8S_CHECKPOINT_CLAIM): ranks would write "
    "checkpoints into their pods' own filesystems, which vanish with the pods, so no "
    "preempted job could resume; create a ReadWriteMany PersistentVolumeClaim "
    "(deploy/checkpoints.yaml) and name it in QM_K8S_CHECKPOINT_CLAIM"
)
DNS_LABEL_MAX = 63
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def job_uid(base: int, job_id: int) -> int:
    """The uid and gid every rank of job ``job_id`` runs as, and its checkpoint folder's owner."""
    uid = base + job_id
    if base < 1 or job_id < 0 or uid > MAX_POD_UID:
        raise RuntimePermanentError(
            f"job {job_id} has no user id: {base} + {job_id} is outside 1..{MAX_POD_UID}, "
            "the ids Kubernetes accepts (lower QM_K8S_JOB_UID_BASE)"
        )
    return uid


def checkpoint_folder(path: str, claim: str | None, mount_path: str) -> str | None:
    """The job's folder on the checkpoint volume (the ``subPath``), or None when
    ``path`` is not on it.

    Only a folder directly under the mount path, with a plain name, is a job's:
    that is how the control plane names them (``job-<id>-<random>``).
    """
    if not on_checkpoint_volume(path, claim, mount_path):
        return None
    relative = posixpath.relpath(posixpath.normpath(path), posixpath.normpath(mount_path))
    if not _CHECKPOINT_FOLDER_NAME.match(relative) or relative in (".", ".."):
        return None
    return relative


def team_namespace(prefix: str, team: str) -> str:
    """The namespace of a team's gangs: a valid DNS-1123 label, distinct per slug.

    A slug that already makes a valid label with the prefix is used as it is.
    Any other (upper case, ``_``, too long) is lowered, its other characters
    become ``-``, and a hash of the exact slug is appended, so ``Team_A`` and
    ``team_a`` land in different namespaces and neither takes ``team-a``'s.
    """
    plain = f"{prefix}{team}"
    if team and len(plain) <= DNS_LABEL_MAX and _DNS_LABEL.match(plain):
        return plain
    digest = hashlib.sha256(team.encode()).hexdigest()[:8]
    cleaned = re.sub(r"[^a-z0-9]+", "-", f"{prefix}{team}".lower()).strip("-")
    room = DNS_LABEL_MAX - len(digest) - 1
    cleaned = cleaned[:room].rstrip("-") or "qm"
    return f"{cleaned}-{digest}"


def on_checkpoint_volume(path: str, claim: str | None, mount_path: str) -> bool:
    """Whether ``path`` lies on the checkpoint volume ``claim`` mounted at ``mount_path``.

    Only such a path survives the pod and is visible from the node the next
    attempt lands on. ``..`` is resolved first, so it cannot climb out.
    """
    if not claim or not posixpath.isabs(path):
        return False
    mount = posixpath.normpath(mount_path).rstrip("/")
    return posixpath.normpath(path).startswith(mount + "/")


def _parse_time(value: Any) -> float | None:
    if value is None:
        return None
    return float(value.timestamp())


def _is_gone(error: ApiException) -> bool:
    return error.status == 404


def _temporary(error: ApiException) -> bool:
    return error.status in (409, 429) or error.status is None or error.status >= 500


def _classify(
    error: Exception,
) -> type[RuntimeTemporaryError] | type[RuntimePermanentError] | None:
    """The protocol's error for an exception of the Kubernetes client: an API answer
    by its status, a failed connection or a timeout (urllib3, the socket) as temporary."""
    if isinstance(error, ApiException):
        return RuntimeTemporaryError if _temporary(error) else RuntimePermanentError
    if isinstance(error, (urllib3.exceptions.HTTPError, OSError)):
        return RuntimeTemporaryError
    return None


@translate_errors(_classify)
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
        self.core = client.CoreV1Api(api_client)
        self._pool = ThreadPoolExecutor(
            max_workers=self.settings.api_workers, thread_name_prefix="qm-k8s"
        )
        self._lock = threading.Lock()
        # Caches only: everything here can be rebuilt from the cluster.
        self._world_sizes: dict[GangId, tuple[str, int]] = {}
        self._signalled: dict[GangId, float] = {}
        self._blocked: dict[GangId, dict[int, str]] = {}
        # The cadence hint last written to each gang's ConfigMap.
        self._published_risk: dict[GangId, str] = {}
        self.relists = 0
        # The pod watch (watch_pods): a cache of every gang pod, kept by one
        # thread, so a reconcile cycle lists gang records and nodes but no pods.
        self._pod_cache: dict[str, Any] = {}
        self._pod_cache_ready = threading.Event()
        self._pod_watch: threading.Thread | None = None
        self._closing = threading.Event()
        # (job, attempt, rank) of pods that something other than this runtime and
        # the rank itself ended or is ending at the latest observe() (an unmarked
        # pod with a DisruptionTarget condition or the kubelet's eviction), with why.
        self._disrupted: dict[tuple[int, int, int], str] = {}
        # time.monotonic() of the last Eviction answer of the latest signal():
        # the end of "decision to last eviction answered".
        self.last_eviction_answered_at = 0.0

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
        self._closing.set()
        self._pool.shutdown(wait=True)
        self.api_client.close()

    # -- naming ----------------------------------------------------------------
    def namespace_for(self, team: str) -> str:
        """The namespace a team's gangs run in."""
        if self.settings.namespace_per_team and team:
            return team_namespace(self.settings.team_namespace_prefix, team)
        return self.settings.namespace

    def checkpoint_is_durable(self, path: str) -> bool:
        """Whether a checkpoint at ``path`` (as a rank sees it) is on the shared volume."""
        return on_checkpoint_volume(
            path, self.settings.checkpoint_claim, self.settings.checkpoint_mount_path
        )

    def _labels(self, gang: GangId) -> dict[str, str]:
        return {
            MANAGED_BY_LABEL: MANAGED_BY,
            GANG_LABEL: gang_name(gang),
            JOB_LABEL: str(gang.job_id),
            ATTEMPT_LABEL: str(gang.attempt),
        }

    def _selector(self, gang: GangId | None) -> str:
        if gang is None:
            return f"{MANAGED_BY_LABEL}={MANAGED_BY},{GANG_LABEL}"
        return f"{MANAGED_BY_LABEL}={MANAGED_BY},{GANG_LABEL}={gang_name(gang)}"

    # -- launch ----------------------------------------------------------------
    def launch(self, spec: GangSpec) -> None:
        """Create the gang's ConfigMap, Secret, Service and one pod per rank.

        Idempotent: objects that already exist are left alone, and a launch cut
        short half-way is completed by the next call.
        """
        gang = spec.gang
        self._check_image(spec)
        self._check_env(spec)
        namespace = self.namespace_for(spec.team)
        if self.settings.namespace_per_team and spec.team:
            self._ensure_namespace(namespace)
            self.ensure_network_policy(namespace)
        name = gang_name(gang)
        owner = self._ensure_gang_record(spec, namespace)
        with self._lock:
            self._world_sizes[gang] = (namespace, spec.world_size)
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
        self._create_ignoring_conflict(
            self.core.create_namespaced_secret,
            namespace,
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {
                    "name": f"{name}-events",
                    "labels": self._labels(gang),
                    "ownerReferences": owner_references,
                },
                "type": "Opaque",
                "stringData": {EVENTS_TOKEN_KEY: token},
            },
        )
        risk = mtbp_text(spec.mtbp_seconds) if spec.mtbp_seconds is not None else ""
        self._create_ignoring_conflict(
            self.core.create_namespaced_config_map,
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
        with self._lock:
            self._published_risk[gang] = risk
        self._create_ignoring_conflict(
            self.core.create_namespaced_service,
            namespace,
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {
                    "name": name,
                    "labels": self._labels(gang),
                    "ownerReferences": owner_references,
                },
                "spec": {
                    "clusterIP": "None",
                    "selector": {GANG_LABEL: name},
                    # Rank 0 must resolve before it is ready: the others wait on it.
                    "publishNotReadyAddresses": True,
                    "ports": [{"name": "rendezvous", "port": self.settings.master_port}],
                },
            },
        )
        self._create_ignoring_conflict(
            client.NetworkingV1Api(self.api_client).create_namespaced_network_policy,
            namespace,
            gang_network_policy(gang, owner_references),
        )
        existing = {
            pod.metadata.name
            for pod in self.core.list_namespaced_pod(
                namespace, label_selector=self._selector(gang)
            ).items
        }
        bodies = [
            self._pod_body(spec, namespace, placement.rank, owner_references)
            for placement in spec.ranks
            if pod_name(gang, placement.rank) not in existing
        ]
        results = list(
            self._pool.map(
                lambda body: self._try(
                    lambda: self._create_ignoring_conflict(
                        self.core.create_namespaced_pod, namespace, body
                    )
                ),
                bodies,
            )
        )
        errors = [error for error in results if error is not None]
        if errors:
            raise errors[0]
        self.core.patch_namespaced_config_map(
            name,
            namespace,
            {"metadata": {"annotations": {LAUNCHED_ANNOTATION: f"{time.time():.6f}"}}},
        )

    def _check_image(self, spec: GangSpec) -> None:
        allowed = self.settings.image_allowlist.get(spec.team)
        image = spec.image or self.settings.default_image
        # Matched by path segment, as at submission (where the lists of the teams
        # above are checked too): a raw prefix would admit a look-alike repository.
        if allowed is not None and not any(image_admitted(image, prefix) for prefix in allowed):
            raise RuntimePermanentError(
                f"image {image} is not allowed for team {spec.team}: "
                f"allowed are {', '.join(allowed) or 'none'}"
            )

    @staticmethod
    def _check_env(spec: GangSpec) -> None:
        """Refuse, before anything is created, a gang whose env names the GPU runtime's
        variables: NVIDIA_VISIBLE_DEVICES=all would expose every GPU of the node."""
        reserved = sorted(key for key in spec.env if key.startswith(RESERVED_GPU_ENV_PREFIXES))
        if reserved:
            raise RuntimePermanentError(
                f"{gang_name(spec.gang)} sets {', '.join(reserved)}: CUDA_* and NVIDIA_* are "
                f"reserved, a rank gets its GPUs through its {GPU_RESOURCE} limit only"
            )

    def _ensure_namespace(self, namespace: str) -> None:
        try:
            self.core.create_namespace(
                {"metadata": {"name": namespace, "labels": namespace_labels()}}
            )
        except ApiException as error:
            if error.status != 409:
                raise self._translate(error, f"create namespace {namespace}") from error

    def ensure_network_policy(self, namespace: str) -> None:
        """Create the jobs namespace's default-deny NetworkPolicy if it is missing."""
        networking = client.NetworkingV1Api(self.api_client)
        body = network_policy(self.settings)
        try:
            networking.create_namespaced_network_policy(namespace, body)
        except ApiException as error:
            if error.status != 409:
                raise self._translate(error, f"create network policy in {namespace}") from error

    def _ensure_gang_record(self, spec: GangSpec, namespace: str) -> Any:
        gang = spec.gang
        labels = self._labels(gang)
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
            return self.core.create_namespaced_config_map(namespace, body)
        except ApiException as error:
            if error.status != 409:
                raise self._translate(error, f"create gang record {gang_name(gang)}") from error
        try:
            return self.core.read_namespaced_config_map(gang_name(gang), namespace)
        except ApiException as error:
            raise self._translate(error, f"read gang record {gang_name(gang)}") from error

    def _pod_body(
        self,
        spec: GangSpec,
        namespace: str,
        rank: int,
        owner_references: list[dict[str, Any]],
    ) -> dict[str, Any]:
        gang = spec.gang
        placement = next(p for p in spec.ranks if p.rank == rank)
        name = gang_name(gang)
        master_addr = f"rank-0.{name}.{namespace}.svc.{self.settings.cluster_domain}"
        env: list[dict[str, Any]] = [
            {"name": key, "value": value}
            for key, value in sorted(spec.env.items())
            if key != EVENTS_TOKEN_KEY and not key.startswith(RESERVED_GPU_ENV_PREFIXES)
        ]
        env += [
            {"name": "RANK", "value": str(rank)},
            {"name": "WORLD_SIZE", "value": str(spec.world_size)},
            {"name": "LOCAL_RANK", "value": str(placement.local_rank)},
            {"name": "MASTER_ADDR", "value": master_addr},
            {"name": "MASTER_PORT", "value": str(self.settings.master_port)},
            {"name": "OMP_NUM_THREADS", "value": "1"},
            {"name": NOTICE_POLL_ENV, "value": f"{NOTICE_POLL_SECONDS:g}"},
            {
                "name": EVENTS_TOKEN_KEY,
                "valueFrom": {"secretKeyRef": {"name": f"{name}-events", "key": EVENTS_TOKEN_KEY}},
            },
            {"name": MTBP_FILE_ENV, "value": posixpath.join(RISK_MOUNT_PATH, RISK_KEY)},
        ]
        labels = self._labels(gang) | {RANK_LABEL: str(rank), NODE_LABEL: placement.node}
        if spec.team:
            labels[TEAM_LABEL] = spec.team
        resources = self.rank_resources(spec)
        container_security: dict[str, Any] = {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        image = spec.image or self.settings.default_image
        container: dict[str, Any] = {
            "name": CONTAINER_NAME,
            "image": image,
            "imagePullPolicy": self.settings.image_pull_policy,
            "command": ["/bin/sh", "-c", RANK_ENTRYPOINT, "qm-rank", spec.command],
            "env": env,
            "resources": {"limits": resources, "requests": resources},
            "securityContext": container_security,
        }
        uid = job_uid(self.settings.job_uid_base, spec.job_id)
        pod_spec: dict[str, Any] = {
            "restartPolicy": "Never",
            # The Pod Security Standard "restricted": no root, no escalation, no
            # capabilities, the runtime's seccomp profile; and no API token, since
            # a rank has no business with the API server.
            "automountServiceAccountToken": False,
            "securityContext": {
                "runAsNonRoot": True,
                # The job's own ids (module docstring: "Checkpoints").
                "runAsUser": uid,
                "runAsGroup": uid,
                "fsGroup": uid,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "priorityClassName": spec.priority_class,
            "terminationGracePeriodSeconds": max(0, math.ceil(spec.grace_seconds)),
            "hostname": f"rank-{rank}",
            "subdomain": name,
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchFields": [
                                    {
                                        "key": "metadata.name",
                                        "operator": "In",
                                        "values": [placement.node],
                                    }
                                ]
                            }
                        ]
                    }
                }
            },
            "containers": [container],
        }
        if self.settings.service_account:
            pod_spec["serviceAccountName"] = self.settings.service_account
        pod_spec["volumes"] = [
            {
                "name": RISK_VOLUME,
                "configMap": {
                    "name": risk_config_map_name(gang),
                    "items": [{"key": RISK_KEY, "path": RISK_KEY}],
                },
            }
        ]
        container["volumeMounts"] = [
            {"name": RISK_VOLUME, "mountPath": RISK_MOUNT_PATH, "readOnly": True}
        ]
        checkpoint_dir = spec.env.get("QM_CHECKPOINT_DIR", "")
        folder = checkpoint_folder(
            checkpoint_dir, self.settings.checkpoint_claim, self.settings.checkpoint_mount_path
        )
        if folder is not None:
            # Only the job's own folder, where its ranks expect it; never the claim's root.
            pod_spec["volumes"].append(
                {
                    "name": CHECKPOINT_VOLUME,
                    "persistentVolumeClaim": {"claimName": self.settings.checkpoint_claim},
                }
            )
            container["volumeMounts"].append(
                {
                    "name": CHECKPOINT_VOLUME,
                    "mountPath": posixpath.normpath(checkpoint_dir),
                    "subPath": folder,
                }
            )
            pod_spec["initContainers"] = [
                {
                    "name": CHECKPOINT_FOLDER_CONTAINER,
                    # The job's image: it already has the /bin/sh the rank needs, and
                    # it runs as the job's uid, with no more reach than the rank has.
                    "image": image,
                    "imagePullPolicy": self.settings.image_pull_policy,
                    "command": [
                        "/bin/sh",
                        "-c",
                        CHECKPOINT_FOLDER_SCRIPT,
                        CHECKPOINT_FOLDER_CONTAINER,
                        folder,
                    ],
                    "env": [
                        {"name": CHECKPOINT_VOLUME_ENV, "value": CHECKPOINT_VOLUME_ROOT},
                        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
                    ],
                    "resources": {
                        "limits": dict(CHECKPOINT_FOLDER_RESOURCES),
                        "requests": dict(CHECKPOINT_FOLDER_RESOURCES),
                    },
                    "securityContext": dict(container_security),
                    "volumeMounts": [
                        {"name": CHECKPOINT_VOLUME, "mountPath": CHECKPOINT_VOLUME_ROOT}
                    ],
                }
            ]
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name(gang, rank),
                "labels": labels,
                "annotations": dict(self.settings.pod_annotations),
                "ownerReferences": owner_references,
                "finalizers": [EXIT_CODE_FINALIZER],
            },
            "spec": pod_spec,
        }

    def rank_resources(self, spec: GangSpec) -> dict[str, str]:
        """One rank's requests and limits: its GPUs and the flavor's CPU, memory and
        ephemeral storage per GPU."""
        gpus = spec.gpus_per_rank
        settings = self.settings
        cpu = settings.cpu_per_gpu.get(spec.flavor, settings.default_cpu_per_gpu)
        memory = settings.memory_per_gpu.get(spec.flavor, settings.default_memory_per_gpu)
        disk = settings.ephemeral_storage_per_gpu.get(
            spec.flavor, settings.default_ephemeral_storage_per_gpu
        )
        return {
            GPU_RESOURCE: str(gpus),
            "cpu": _scaled(cpu, gpus),
            "memory": _scaled(memory, gpus),
            "ephemeral-storage": _scaled(disk, gpus),
        }

    def _create_ignoring_conflict(
        self, create: Callable[..., Any], namespace: str, body: dict[str, Any]
    ) -> None:
        try:
            create(namespace, body)
        except ApiException as error:
            if error.status != 409:
                what = f"create {body['kind']} {body['metadata']['name']}"
                raise self._translate(error, what) from error

    @staticmethod
    def _try(call: Callable[[], None]) -> Exception | None:
        try:
            call()
        except Exception as error:
            return error
        return None

    @staticmethod
    def _translate(error: ApiException, what: str) -> Exception:
        message = f"{what}: {error.status} {error.reason}: {_status_message(error)}"
        body = str(error.body)
        if _temporary(error) or (
            error.status == 403 and ("serviceaccount" in body or "PriorityClass" in body)
        ):
            # Refusals that pass by themselves: a namespace just created has
            # no default service account for a moment, and a PriorityClass
            # missing now is created by the next PriorityClass reconcile.
            return RuntimeTemporaryError(message)
        return RuntimePermanentError(message)

    # -- gang record -------------------------------------------------------------
    def _gang_location(self, gang: GangId) -> tuple[str, int] | None:
        """(namespace, world size) of a gang, from the cache or the cluster."""
        with self._lock:
            known = self._world_sizes.get(gang)
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
            raise self._translate(error, f"find gang {gang_name(gang)}") from error
        if not records.items:
            return None
        record = records.items[0]
        location = (record.metadata.namespace, int((record.data or {}).get("world_size", "0")))
        with self._lock:
            self._world_sizes[gang] = location
        return location

    def _annotate(self, gang: GangId, namespace: str, annotations: dict[str, str]) -> None:
        with contextlib.suppress(ApiException):
            self.core.patch_namespaced_config_map(
                gang_name(gang), namespace, {"metadata": {"annotations": annotations}}
            )

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
        """
        location = self._gang_location(gang)
        if location is None:
            return
        namespace, world_size = location
        grace = max(0, math.ceil(grace_seconds))
        now = time.time()
        with self._lock:
            first_signal = gang not in self._signalled
            signalled_at = self._signalled.setdefault(gang, now)
        mark = stop_mark(gang.attempt, "signal", signalled_at)
        deadline = time.monotonic() + self.settings.eviction_retry_seconds
        outcomes = list(
            self._pool.map(
                lambda rank: (
                    rank,
                    *self._evict(namespace, pod_name(gang, rank), grace, deadline, mark),
                ),
                range(world_size),
            )
        )
        with self._lock:
            self.last_eviction_answered_at = max(answered for _, _, answered in outcomes)
        if first_signal:
            # Recorded in the cluster so a restarted worker still knows when the
            # gang was told to stop. It follows the evictions rather than
            # delaying them: until it lands, the pods' DisruptionTarget
            # conditions already say they are being evicted.
            self._annotate_signal_once(gang, namespace, now, grace_seconds)
        blocked = {rank: message for rank, message, _ in outcomes if message is not None}
        with self._lock:
            if blocked:
                self._blocked[gang] = blocked
            else:
                self._blocked.pop(gang, None)
        if blocked:
            ranks = ", ".join(str(rank) for rank in sorted(blocked))
            reason = next(iter(blocked.values()))
            raise RuntimeTemporaryError(
                f"eviction of {gang_name(gang)} ranks {ranks} blocked: {reason}"
            )

    def _annotate_signal_once(
        self, gang: GangId, namespace: str, at: float, grace_seconds: float
    ) -> None:
        try:
            record = self.core.read_namespaced_config_map(gang_name(gang), namespace)
        except ApiException:
            return
        annotations = record.metadata.annotations or {}
        if SIGNALLED_ANNOTATION in annotations:
            with self._lock:
                self._signalled[gang] = float(annotations[SIGNALLED_ANNOTATION])
            return
        self._annotate(
            gang,
            namespace,
            {SIGNALLED_ANNOTATION: f"{at:.6f}", GRACE_ANNOTATION: f"{grace_seconds:g}"},
        )

    def _evict(
        self, namespace: str, name: str, grace: int, deadline: float, mark: str
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
                    self._mark_stop(namespace, name, mark)
                    marked = True
                # The answer's body is not needed: skip deserializing it.
                self.core.create_namespaced_pod_eviction(
                    name, namespace, body, _preload_content=False
                )
                return None, time.monotonic()
            except ApiException as error:
                if _is_gone(error):
                    return None, time.monotonic()
                blocked = f"{error.status} {error.reason}: {_message(error)}"
                if not _temporary(error) or time.monotonic() + pause > deadline:
                    return blocked, time.monotonic()
            except (urllib3.exceptions.HTTPError, OSError) as error:
                if time.monotonic() + pause > deadline:
                    return f"API server unreachable: {error}", time.monotonic()
            time.sleep(pause)
            pause = min(pause * 2, 0.5)

    def _mark_stop(self, namespace: str, name: str, mark: str) -> None:
        """Annotate a rank pod with this runtime's stop (see STOP_REQUESTED_ANNOTATION)."""
        self.core.patch_namespaced_pod(
            name,
            namespace,
            {"metadata": {"annotations": {STOP_REQUESTED_ANNOTATION: mark}}},
            _preload_content=False,
        )

    def eviction_blocked(self, gang: GangId) -> dict[int, str]:
        """Ranks whose last eviction a PodDisruptionBudget refused, with the reason."""
        with self._lock:
            return dict(self._blocked.get(gang, {}))

    def kill(self, gang: GangId) -> None:
        """Delete every rank's pod with grace 0. Idempotent."""
        location = self._gang_location(gang)
        if location is None:
            return
        namespace, world_size = location
        killed_at = time.time()
        self._annotate(gang, namespace, {KILLED_ANNOTATION: f"{killed_at:.6f}"})
        body = client.V1DeleteOptions(grace_period_seconds=0)
        with self._lock:
            signalled_at = self._signalled.get(gang)
        # A pod this runtime signalled keeps its signal's mark; one it kills unsignalled
        # (a gang stuck at its start) is marked as killed, so neither reads as a disruption.
        mark = (
            stop_mark(gang.attempt, "signal", signalled_at)
            if signalled_at is not None
            else stop_mark(gang.attempt, "kill", killed_at)
        )

        def delete(rank: int) -> Exception | None:
            try:
                self._mark_stop(namespace, pod_name(gang, rank), mark)
                self.core.delete_namespaced_pod(pod_name(gang, rank), namespace, body=body)
            except ApiException as error:
                if not _is_gone(error):
                    return self._translate(error, f"delete {pod_name(gang, rank)}")
            return None

        errors = [e for e in self._pool.map(delete, range(world_size)) if e is not None]
        if errors:
            raise errors[0]

    # -- observe ---------------------------------------------------------------
    def observe(self, gang: GangId | None = None) -> list[RankObservation]:
        """Every rank's state from a fresh listing of pods, gang records and nodes."""
        selector = self._selector(gang)
        # Gang records first, pods second: launch() marks a record launched only
        # after every pod exists, so a launched record is never paired with a
        # pod listing taken before its pods were created (which would read as
        # every rank lost).
        try:
            if self.settings.namespace_per_team:
                records = self.core.list_config_map_for_all_namespaces(
                    label_selector=selector
                ).items
            else:
                records = self.core.list_namespaced_config_map(
                    self.settings.namespace, label_selector=selector
                ).items
            pods = self._pods_for(records, gang)
            ready_nodes = self._ready_nodes()
        except ApiException as error:
            raise self._translate(error, "observe") from error
        pods_by_gang: dict[GangId, dict[int, Any]] = {}
        for pod in pods:
            labels = pod.metadata.labels or {}
            key = GangId(int(labels[JOB_LABEL]), int(labels[ATTEMPT_LABEL]))
            pods_by_gang.setdefault(key, {})[int(labels[RANK_LABEL])] = pod
        observations: list[RankObservation] = []
        disrupted = {
            (int(labels[JOB_LABEL]), int(labels[ATTEMPT_LABEL]), int(labels[RANK_LABEL])): reason
            for pod in pods
            if stop_marked_at(pod) is None
            for reason in [_taken_by(pod)]
            if reason is not None
            for labels in [pod.metadata.labels or {}]
        }
        with self._lock:
            if gang is None:
                self._disrupted = disrupted
            else:
                self._disrupted = {
                    key: reason
                    for key, reason in self._disrupted.items()
                    if key[:2] != (gang.job_id, gang.attempt)
                } | disrupted
        for record in records:
            labels = record.metadata.labels or {}
            key = GangId(int(labels[JOB_LABEL]), int(labels[ATTEMPT_LABEL]))
            annotations = record.metadata.annotations or {}
            signalled = annotations.get(SIGNALLED_ANNOTATION)
            signalled_at = float(signalled) if signalled else self._signalled.get(key)
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

    def _list_pods(self, selector: str) -> list[Any]:
        if self.settings.namespace_per_team:
            return list(self.core.list_pod_for_all_namespaces(label_selector=selector).items)
        return list(
            self.core.list_namespaced_pod(self.settings.namespace, label_selector=selector).items
        )

    def _pods_for(self, records: list[Any], gang: GangId | None) -> list[Any]:
        """The gangs' pods: from the watch cache when it is in sync, else a listing.

        The cache may lag the records just listed: a launched gang whose pods
        are not all in it yet is listed afresh, so a lag never reads as lost
        ranks.
        """
        if not self.settings.watch_pods:
            return self._list_pods(self._selector(gang))
        self._start_pod_watch()
        if not self._pod_cache_ready.is_set():
            return self._list_pods(self._selector(gang))
        with self._lock:
            cached = [
                pod
                for pod in self._pod_cache.values()
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
                fresh = self._list_pods(f"{MANAGED_BY_LABEL}={MANAGED_BY},{GANG_LABEL}={name}")
                pods = [p for p in pods if p.metadata.labels.get(GANG_LABEL) != name] + fresh
        return pods

    def pod_watch_in_sync(self) -> bool:
        """Whether observe() reads pods from the watch cache right now."""
        return self._pod_cache_ready.is_set()

    def _start_pod_watch(self) -> None:
        with self._lock:
            if self._pod_watch is not None:
                return
            self._pod_watch = threading.Thread(
                target=self._pod_watch_loop, name="qm-k8s-pod-watch", daemon=True
            )
        self._pod_watch.start()

    def _pod_watch_loop(self) -> None:
        """Keep ``_pod_cache`` in line with the cluster: list, then watch from
        the listing's version; list again on 410 Gone or any error."""
        selector = f"{MANAGED_BY_LABEL}={MANAGED_BY},{GANG_LABEL}"
        namespace = None if self.settings.namespace_per_team else self.settings.namespace
        method: Callable[..., Any]
        kwargs: dict[str, Any] = {"label_selector": selector}
        if namespace is None:
            method = self.core.list_pod_for_all_namespaces
        else:
            method = self.core.list_namespaced_pod
            kwargs["namespace"] = namespace
        version: str | None = None
        while not self._closing.is_set():
            try:
                if version is None:
                    self._pod_cache_ready.clear()
                    listing = method(**kwargs)
                    with self._lock:
                        self.relists += 1
                        self._pod_cache = {_pod_key(p): p for p in listing.items}
                    version = listing.metadata.resource_version
                    self._pod_cache_ready.set()
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
                    with self._lock:
                        if event["type"] == "DELETED":
                            self._pod_cache.pop(_pod_key(obj), None)
                        else:
                            self._pod_cache[_pod_key(obj)] = obj
                    if self._closing.is_set():
                        return
            except Exception:
                # 410 Gone or a broken connection: start over from a listing,
                # and meanwhile let observe() list for itself.
                version = None
                self._pod_cache_ready.clear()
                self._closing.wait(0.5)

    def _ready_nodes(self) -> set[str]:
        ready = set()
        for node in self.core.list_node().items:
            for condition in node.status.conditions or []:
                if condition.type == "Ready" and condition.status == "True":
                    ready.add(node.metadata.name)
        return ready

    def disruptions(self, gang: GangId) -> dict[int, str]:
        """Ranks carrying a DisruptionTarget condition, with its reason.

        ``PreemptionByScheduler`` means kube-scheduler took the rank's node for
        a higher-priority pod; ``EvictionByEvictionAPI`` is an eviction (ours
        or a drain); ``DeletionByTaintManager`` follows a lost node. A pod the
        kubelet's eviction manager evicted for passing its ephemeral-storage limit
        carries no such condition (seen on a real kubelet v1.34), only the pod's
        reason ``Evicted`` and the kubelet's message: ``Evicted: <message>``.
        """
        location = self._gang_location(gang)
        if location is None:
            return {}
        pods = self.core.list_namespaced_pod(location[0], label_selector=self._selector(gang)).items
        found = {}
        for pod in pods:
            reason = _taken_by(pod)
            if reason is not None:
                found[int(pod.metadata.labels[RANK_LABEL])] = reason
        return found

    def watch_ranks(
        self,
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
        selector = self._selector(gang)
        namespace = None if self.settings.namespace_per_team else self.settings.namespace
        self.relists = 0
        ready_nodes: set[str] = set()

        def listing() -> tuple[list[Any], str]:
            self.relists += 1
            if namespace is None:
                result = self.core.list_pod_for_all_namespaces(label_selector=selector)
            else:
                result = self.core.list_namespaced_pod(namespace, label_selector=selector)
            return result.items, result.metadata.resource_version

        version = resource_version
        while not stop.is_set():
            if version is None:
                ready_nodes = self._ready_nodes()
                pods, version = listing()
                for pod in pods:
                    yield rank_observation(pod, self._signal_time(pod), ready_nodes)
                continue
            if not ready_nodes:
                ready_nodes = self._ready_nodes()
            kwargs: dict[str, Any] = {
                "label_selector": selector,
                "resource_version": version,
                "timeout_seconds": timeout_seconds,
                "allow_watch_bookmarks": True,
            }
            method: Callable[..., Any]
            if namespace is None:
                method = self.core.list_pod_for_all_namespaces
            else:
                method = self.core.list_namespaced_pod
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
                    yield rank_observation(obj, self._signal_time(obj), ready_nodes)
                    if stop.is_set():
                        return
            except ApiException as error:
                if error.status == 410:
                    version = None
                    continue
                raise self._translate(error, "watch pods") from error

    def _signal_time(self, pod: Any) -> float | None:
        labels = pod.metadata.labels or {}
        key = GangId(int(labels[JOB_LABEL]), int(labels[ATTEMPT_LABEL]))
        with self._lock:
            return self._signalled.get(key)

    # -- nodes, logs, ports, forget -----------------------------------------------
    def nodes(self) -> list[NodeInventory]:
        """Nodes with allocatable GPUs, their flavor from the flavor label and their
        topology from the configured topology labels."""
        try:
            items = self.core.list_node().items
        except ApiException as error:
            raise self._translate(error, "list nodes") from error
        inventory = []
        for node in items:
            gpus = int((node.status.allocatable or {}).get(GPU_RESOURCE, "0"))
            if gpus <= 0:
                continue
            labels = node.metadata.labels or {}
            flavor = labels.get(self.settings.flavor_label, "")
            topology = tuple(
                (level, labels[key])
                for level, key in self.settings.topology_labels.items()
                if labels.get(key)
            )
            inventory.append(
                NodeInventory(name=node.metadata.name, flavor=flavor, gpus=gpus, topology=topology)
            )
        return sorted(inventory, key=lambda n: n.name)

    def read_log(self, gang: GangId, rank: int, offset: int = 0, limit: int = 1 << 20) -> bytes:
        """A slice of one rank's container log, through the API server.

        The pod log API has no offset, so the log is streamed and the bytes
        before ``offset`` are dropped as they arrive: memory holds one chunk
        and the slice, never the log. An offset past ``log_scan_bytes`` is
        refused, so no request makes a process stream a huge log.
        """
        if offset < 0 or limit < 0:
            raise RuntimePermanentError(f"bad log range: offset {offset}, limit {limit}")
        if offset + limit > self.settings.log_scan_bytes:
            raise RuntimePermanentError(
                f"a live log is read up to byte {self.settings.log_scan_bytes} only; "
                "the end of every rank's log is kept when its attempt ends"
            )
        kept = bytearray()
        for position, chunk in self._stream_log(gang, rank, offset + limit):
            start = max(0, offset - position)
            if start < len(chunk):
                kept += chunk[start : start + limit - len(kept)]
        return bytes(kept)

    def read_log_tail(self, gang: GangId, rank: int, max_bytes: int) -> tuple[bytes, int]:
        """The last ``max_bytes`` of a rank's log and the offset they start at.

        Streams the whole log once, keeping at most about twice ``max_bytes``.
        """
        tail = bytearray()
        total = 0
        for _, chunk in self._stream_log(gang, rank, None):
            total += len(chunk)
            tail += chunk
            if len(tail) > 2 * max_bytes:
                del tail[: len(tail) - max_bytes]
        kept = bytes(tail[-max_bytes:]) if max_bytes else b""
        return kept, total - len(kept)

    def _stream_log(
        self, gang: GangId, rank: int, up_to: int | None
    ) -> Iterator[tuple[int, bytes]]:
        """(offset, chunk) pairs of a rank's log, up to byte ``up_to`` when given."""
        location = self._gang_location(gang)
        if location is None:
            return
        try:
            response = self.core.read_namespaced_pod_log(
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
            raise self._translate(error, f"read log of {pod_name(gang, rank)}") from error
        position = 0
        try:
            for chunk in response.stream(LOG_CHUNK_BYTES, decode_content=True):
                yield position, chunk
                position += len(chunk)
        finally:
            response.release_conn()

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
        del team  # the gang record says where the gang runs
        text = mtbp_text(mtbp_seconds)
        with self._lock:
            if self._published_risk.get(gang) == text:
                return
        location = self._gang_location(gang)
        if location is None:
            return
        try:
            self.core.patch_namespaced_config_map(
                risk_config_map_name(gang), location[0], {"data": {RISK_KEY: text}}
            )
        except ApiException as error:
            if _is_gone(error):
                # A gang launched before the hint existed, or one being forgotten.
                return
            raise self._translate(error, f"write the cadence hint of {gang_name(gang)}") from error
        with self._lock:
            self._published_risk[gang] = text

    def forget(self, gang: GangId) -> None:
        """Release the pods' exit-code finalizers and delete the gang record.

        Deleting the ConfigMap garbage-collects the Service, the Secret and the
        pods through their owner references.
        """
        location = self._gang_location(gang)
        if location is None:
            return
        namespace = location[0]
        pods = self.core.list_namespaced_pod(namespace, label_selector=self._selector(gang)).items

        def release(pod: Any) -> None:
            if EXIT_CODE_FINALIZER not in (pod.metadata.finalizers or []):
                return
            remaining = [f for f in pod.metadata.finalizers if f != EXIT_CODE_FINALIZER]
            with contextlib.suppress(ApiException):
                self.core.patch_namespaced_pod(
                    pod.metadata.name,
                    namespace,
                    [
                        {"op": "test", "path": "/metadata/resourceVersion",
                         "value": pod.metadata.resource_version},
                        {"op": "replace", "path": "/metadata/finalizers", "value": remaining},
                    ],
                )  # fmt: skip

        list(self._pool.map(release, pods))
        # The garbage collector would remove it with the gang record; deleting it here
        # does not leave that to a collector that may be slow or, in tests, absent.
        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_config_map(risk_config_map_name(gang), namespace)
        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_config_map(
                gang_name(gang),
                namespace,
                body=client.V1DeleteOptions(propagation_policy="Background"),
            )
        with self._lock:
            self._world_sizes.pop(gang, None)
            self._signalled.pop(gang, None)
            self._blocked.pop(gang, None)
            self._published_risk.pop(gang, None)

    # -- gang guard --------------------------------------------------------------
    @property
    def gang_guard(self) -> GangGuard:
        """Pods can be taken away by the cluster itself, so this runtime guards gangs."""
        return self

    def guard_victims(self) -> list[GangId]:
        """``gang_guard_victims`` over a fresh observation, with disruption conditions.

        A rank that kube-scheduler preempted may already have exited 0 (its
        trap checkpointed in time); its DisruptionTarget condition still says
        it was taken away rather than finished.
        """
        observations = self.observe()
        with self._lock:
            disrupted = set(self._disrupted)
        return gang_guard_victims(observations, disrupted=disrupted)

    def taken_ranks(self, gang: GangId) -> dict[int, str]:
        """The gang's ranks that something other than this runtime and the rank itself
        ended or is ending, as the latest observe() saw them, with the reason (a
        DisruptionTarget condition's, such as ``EvictionByEvictionAPI`` for a drain, or
        ``Evicted: <the kubelet's message>``). No API call: it reads what observe() kept."""
        with self._lock:
            return {
                rank: reason
                for (job_id, attempt, rank), reason in self._disrupted.items()
                if (job_id, attempt) == (gang.job_id, gang.attempt)
            }

    def enforce_gang_guard(self, grace_seconds: Callable[[GangId], float]) -> list[GangId]:
        """Evict the rest of every gang that lost a rank to someone else.

        Returns the gangs it signalled. Level-triggered: a gang already
        signalled is not picked again.
        """
        victims = self.guard_victims()
        for gang in victims:
            self.signal(gang, grace_seconds(gang))
        return victims


def _scaled(quantity: str, times: int) -> str:
    """``quantity`` (a Kubernetes quantity such as ``4``, ``500m`` or ``16Gi``) times ``times``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", quantity.strip())
    if match is None:
        raise ValueError(f"not a Kubernetes quantity: {quantity!r}")
    number = float(match.group(1)) * times
    text = f"{number:.3f}".rstrip("0").rstrip(".")
    return f"{text}{match.group(2)}"


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


def _pod_key(pod: Any) -> str:
    return f"{pod.metadata.namespace}/{pod.metadata.name}"


def _message(error: ApiException) -> str:
    return str(error.body or "")[:300]


def _status_message(error: ApiException) -> str:
    """The API server's own explanation from a Status body, else the raw body."""
    try:
        return str(json.loads(error.body or "")["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return _message(error)


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


def rank_observation(
    pod: Any, signalled_at: float | None, ready_nodes: set[str] | None = None
) -> RankObservation:
    """Map one rank pod to a RankObservation.

    Terminal phases are ``exited`` with the container's exit code; a pod on a
    node that is not Ready is ``lost``; a pod being deleted or marked with a
    DisruptionTarget condition is ``terminating``.

    ``signalled_at`` is when this runtime signalled the gang, from its own record
    (in memory, then the gang record's annotation); without it, the pod's own mark
    (STOP_REQUESTED_ANNOTATION, set before its eviction or deletion) says so. An
    Eviction API call carries no mark of who made it, so an eviction of an unmarked
    pod is someone else's (``kubectl drain``, the kubelet, kube-scheduler), whether
    of one rank or of every rank: its signal is not recorded as sent, and the gang
    guard and the reconciler see a disruption.
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
    if signalled_at is None:
        signalled_at = stop_marked_at(pod)
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
