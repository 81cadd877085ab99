"""The names of a gang's objects in the cluster, and the runtime's settings.

It owns the labels, annotations and names that every other module of the
Kubernetes runtime reads or writes, and ``KubernetesRuntimeConfig``. It makes no
API call and imports no other module of the runtime.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from preemption.runtimes.base import GangId

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "quartermaster"
GANG_LABEL = "quartermaster.dev/gang"
JOB_LABEL = "quartermaster.dev/job"
ATTEMPT_LABEL = "quartermaster.dev/attempt"
RANK_LABEL = "quartermaster.dev/rank"
NODE_LABEL = "quartermaster.dev/node"
TEAM_LABEL = "quartermaster.dev/team"
RISK_OF_LABEL = "quartermaster.dev/risk-of"
KEPT_LOG_OF_LABEL = "quartermaster.dev/log-of"
KEPT_LOG_FIRST_BYTE_ANNOTATION = "quartermaster.dev/first-byte"
EXIT_CODE_FINALIZER = "quartermaster.dev/exit-code"
LAUNCHED_ANNOTATION = "quartermaster.dev/launched-at"
SIGNALLED_ANNOTATION = "quartermaster.dev/signalled-at"
GRACE_ANNOTATION = "quartermaster.dev/grace-seconds"
KILLED_ANNOTATION = "quartermaster.dev/killed-at"
GPU_RESOURCE = "nvidia.com/gpu"
EVENTS_TOKEN_KEY = "QM_EVENTS_TOKEN"
CONTAINER_NAME = "rank"
# The cadence hint's ConfigMap key and where its volume is mounted in every rank.
RISK_KEY = "mtbp"
RISK_VOLUME = "preemption-risk"
RISK_MOUNT_PATH = "/var/run/quartermaster/risk"
# Job N runs as uid and gid job_uid_base + N. Kubernetes accepts ids up to 2**31 - 1;
# the default base leaves about a billion job ids below that, and sits far above the
# ids that distributions and directory services hand to people and services, so no
# job's files belong to a real user of a node or of the file server.
DEFAULT_JOB_UID_BASE = 2**30
MAX_POD_UID = 2**31 - 1


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
    ``log_followers`` is how many stopped ranks' logs are followed at once until
    their containers end, to keep their ends (logs.keep_logs).
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
    log_followers: int = 64
    watch_pods: bool = False
    image_pull_policy: str = "IfNotPresent"


IMAGE_PULL_POLICIES = ("Always", "IfNotPresent", "Never")


def gang_name(gang: GangId) -> str:
    """The name of a gang's ConfigMap, Secret prefix and Service."""
    return f"qm-{gang.job_id}-{gang.attempt}"


def risk_config_map_name(gang: GangId) -> str:
    """The name of the ConfigMap that holds a gang's cadence hint."""
    return f"{gang_name(gang)}-risk"


def pod_name(gang: GangId, rank: int) -> str:
    """The name of one rank's pod."""
    return f"{gang_name(gang)}-r{rank}"


def kept_log_name(gang: GangId, rank: int) -> str:
    """The name of the ConfigMap that keeps the end of a stopped rank's log."""
    return f"{pod_name(gang, rank)}-log"


NO_CHECKPOINT_VOLUME = (
    "no checkpoint volume is configured (QM_K8S_CHECKPOINT_CLAIM): ranks would write "
    "checkpoints into their pods' own filesystems, which vanish with the pods, so no "
    "preempted job could resume; create a ReadWriteMany PersistentVolumeClaim "
    "(deploy/checkpoints.yaml) and name it in QM_K8S_CHECKPOINT_CLAIM"
)
DNS_LABEL_MAX = 63
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


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


def namespace_for(settings: KubernetesRuntimeConfig, team: str) -> str:
    """The namespace a team's gangs run in."""
    if settings.namespace_per_team and team:
        return team_namespace(settings.team_namespace_prefix, team)
    return settings.namespace


def gang_labels(gang: GangId) -> dict[str, str]:
    """The labels every object of a gang carries."""
    return {
        MANAGED_BY_LABEL: MANAGED_BY,
        GANG_LABEL: gang_name(gang),
        JOB_LABEL: str(gang.job_id),
        ATTEMPT_LABEL: str(gang.attempt),
    }


def gang_selector(gang: GangId | None) -> str:
    """The label selector of one gang's objects, or of every gang's when ``gang`` is None."""
    if gang is None:
        return f"{MANAGED_BY_LABEL}={MANAGED_BY},{GANG_LABEL}"
    return f"{MANAGED_BY_LABEL}={MANAGED_BY},{GANG_LABEL}={gang_name(gang)}"
