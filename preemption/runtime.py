"""Which runtime this installation drives, built from settings."""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

from celery import current_app
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from preemption.runtimes import parse_inventory
from preemption.runtimes.base import NodeInventory, Runtime
from preemption.runtimes.capped_log import LogCap
from preemption.runtimes.kubernetes import (
    NO_CHECKPOINT_VOLUME,
    KubernetesRuntime,
    KubernetesRuntimeConfig,
    on_checkpoint_volume,
)
from preemption.runtimes.local import LocalRuntime
from preemption.runtimes.mimic import MimicRuntime
from preemption.runtimes.runner import RunnerAccount, RunnerLookup, find_runner
from preemption.runtimes.sandbox import FlavorLimits, SandboxConfig, SandboxLimits, support
from quotas.models import Node, ResourceFlavor
from quotas.services import node_topology_sync

SYNC_PRIORITY_CLASSES_TASK = "preemption.tasks.sync_priority_classes"
MIMIC_RUNS_NOTHING = (
    "QM_RUNTIME=mimic runs no job: each one only holds its GPUs for the seconds of its "
    "'sleep SECONDS' command and then succeeds (for benchmarks of the control plane)"
)

logger = logging.getLogger(__name__)


def inventory() -> list[NodeInventory]:
    """The nodes the runtime offers: QM_LOCAL_NODES when set, else the database's."""
    if settings.QM_LOCAL_NODES:
        return list(parse_inventory(settings.QM_LOCAL_NODES))
    return [
        NodeInventory(name=name, flavor=flavor, gpus=gpus)
        for name, flavor, gpus in Node.objects.values_list("name", "flavor__name", "gpus")
    ]


def sync_node_topology() -> list[str]:
    """Bring the nodes' topology in the database in line with what the runtime reports
    (on Kubernetes the nodes' labels at QM_TOPOLOGY_LABELS' keys, on the local runtime
    the QM_LOCAL_NODES inventory), so that the engine reads it; returns the nodes that
    changed. Without an inventory of its own the local runtime's nodes are the
    database's, and nothing changes."""
    if settings.QM_RUNTIME == "local" and not settings.QM_LOCAL_NODES:
        return []
    reported = {node.name: dict(node.topology) for node in get_runtime().nodes()}
    return node_topology_sync(topology_by_node=reported)


_override: Runtime | None = None
_kubernetes: Runtime | None = None
_warned_without_runner = False


def runner_lookup() -> RunnerLookup:
    """The account the local runtime runs ranks as, or why there is none."""
    return find_runner(settings.QM_RUNNER_USER, gid_base=settings.QM_RUNNER_GID_BASE)


def local_runner() -> RunnerAccount | None:
    """The runner account for the local runtime.

    Without one, production refuses to run researchers' commands at all; elsewhere they
    run as the control plane's own user, after a warning (once per process) that says why.
    """
    global _warned_without_runner
    lookup = runner_lookup()
    if lookup.account is not None:
        return lookup.account
    if settings.PRODUCTION:
        raise ImproperlyConfigured(
            f"the local runtime will not run ranks as the control plane's user in "
            f"production: {lookup.reason}"
        )
    if not _warned_without_runner:
        _warned_without_runner = True
        logger.warning(
            "ranks of the local runtime run as the control plane's own user and can read "
            "its secret key and database: %s",
            lookup.reason,
        )
    return None


def local_sandbox() -> SandboxConfig:
    """The local runtime's sandbox settings (QM_LOCAL_SANDBOX and the site's rank
    limits), with each flavor's own limits looked up as its gangs launch."""
    return SandboxConfig(
        mode=settings.QM_LOCAL_SANDBOX,
        limits=SandboxLimits(
            pids_max=settings.QM_RANK_PIDS_MAX,
            memory_max=settings.QM_RANK_MEMORY_MAX,
            file_size_max=settings.QM_RANK_FILE_SIZE_MAX,
        ),
        flavor_limits=flavor_sandbox_limits,
    )


def flavor_sandbox_limits(flavor: str) -> FlavorLimits | None:
    """The limits a flavor sets for its ranks (ResourceFlavor's `rank_*` fields); None
    where it sets none, or no flavor has that name."""
    row = (
        ResourceFlavor.objects.filter(name=flavor)
        .values_list("rank_pids_max", "rank_memory_per_gpu", "rank_file_size_max")
        .first()
    )
    if row is None or row == (None, None, None):
        return None
    pids_max, memory_per_gpu, file_size_max = row
    return FlavorLimits(
        pids_max=pids_max, memory_per_gpu=memory_per_gpu, file_size_max=file_size_max
    )


def use_runtime(runtime: Runtime | None) -> None:
    """Point this process at a specific runtime (the drill and tests do)."""
    global _override
    _override = runtime


def kubernetes_config() -> KubernetesRuntimeConfig:
    """The Kubernetes runtime's settings; in production a checkpoint volume is required."""
    return KubernetesRuntimeConfig(
        namespace=settings.QM_K8S_NAMESPACE,
        namespace_per_team=settings.QM_K8S_NAMESPACE_PER_TEAM,
        checkpoint_claim=settings.QM_K8S_CHECKPOINT_CLAIM or None,
        checkpoint_mount_path=settings.QM_K8S_CHECKPOINT_MOUNT_PATH,
        require_checkpoint_claim=settings.PRODUCTION,
        job_uid_base=settings.QM_K8S_JOB_UID_BASE,
        cpu_per_gpu=settings.QM_K8S_CPU_PER_GPU,
        memory_per_gpu=settings.QM_K8S_MEMORY_PER_GPU,
        ephemeral_storage_per_gpu=settings.QM_K8S_EPHEMERAL_STORAGE_PER_GPU,
        default_cpu_per_gpu=settings.QM_K8S_DEFAULT_CPU_PER_GPU,
        default_memory_per_gpu=settings.QM_K8S_DEFAULT_MEMORY_PER_GPU,
        default_ephemeral_storage_per_gpu=settings.QM_K8S_DEFAULT_EPHEMERAL_STORAGE_PER_GPU,
        image_allowlist=settings.QM_K8S_IMAGE_ALLOWLIST,
        events_cidrs=tuple(settings.QM_K8S_EVENTS_CIDRS),
        events_port=settings.QM_K8S_EVENTS_PORT,
        log_scan_bytes=settings.QM_K8S_LOG_SCAN_BYTES,
        watch_pods=settings.QM_K8S_WATCH_PODS,
        image_pull_policy=settings.QM_K8S_IMAGE_PULL_POLICY,
        topology_labels=dict(settings.QM_TOPOLOGY_LABELS),
    )


def runtime_problems() -> list[str]:
    """Why the configured runtime cannot run jobs safely; empty when it can.

    Shown on the health check and by ``manage.py check``, so a deployment
    that would lose every checkpoint says so before the first job.
    """
    if settings.QM_RUNTIME == "kubernetes" and not settings.QM_K8S_CHECKPOINT_CLAIM:
        severity = "refusing to start" if settings.PRODUCTION else "development only"
        return [f"Kubernetes runtime {severity}: {NO_CHECKPOINT_VOLUME}"]
    if settings.QM_RUNTIME == "mimic":
        return [MIMIC_RUNS_NOTHING]
    if settings.QM_RUNTIME == "local" and settings.QM_LOCAL_SANDBOX != "off":
        found = support()
        if not found.available:
            what = "refusing to launch" if settings.QM_LOCAL_SANDBOX == "on" else "unsandboxed"
            return [f"Local runtime {what}: ranks cannot be sandboxed here: {found.reason}"]
    return []


def checkpoint_dir_for(job_id: int) -> str:
    """A new folder for a job's checkpoints, as the job's ranks see it: on
    Kubernetes under the checkpoint volume's mount path; locally, in the shared
    checkpoints folder.

    The name carries a random part besides the job's id. The checkpoint store
    outlives the database that numbers jobs (a restored backup, a reinstall that
    keeps the volume), and a job must never resume from a `latest` that an
    earlier job with the same number wrote, someone else's weights included.
    """
    name = f"job-{job_id}-{secrets.token_hex(6)}"
    if settings.QM_RUNTIME == "kubernetes":
        return f"{settings.QM_K8S_CHECKPOINT_MOUNT_PATH.rstrip('/')}/{name}"
    return str(Path(settings.QM_CHECKPOINTS_DIR) / name)


def checkpoint_is_durable(path: str) -> bool:
    """Whether a committed checkpoint at ``path`` can be offered for resume.

    A runtime that can tell (Kubernetes: the path lies on the checkpoint
    volume) decides; a runtime whose ranks share the host's disk always can.
    Decided from settings, without building a runtime, since the web process
    ingests events.
    """
    if _override is not None:
        check = getattr(_override, "checkpoint_is_durable", None)
        return True if check is None else bool(check(path))
    if settings.QM_RUNTIME == "kubernetes":
        return on_checkpoint_volume(
            path, settings.QM_K8S_CHECKPOINT_CLAIM, settings.QM_K8S_CHECKPOINT_MOUNT_PATH
        )
    return True


def get_runtime() -> Runtime:
    if _override is not None:
        return _override
    if settings.QM_RUNTIME == "kubernetes":
        return _kubernetes_runtime()
    if settings.QM_RUNTIME == "mimic":
        return MimicRuntime(root=Path(settings.QM_RUNS_DIR) / "mimic", inventory=inventory())
    return LocalRuntime(
        root=settings.QM_RUNS_DIR,
        inventory=inventory(),
        runner=local_runner(),
        sandbox=local_sandbox(),
        log_cap=LogCap(
            head_bytes=settings.QM_RANK_LOG_HEAD_BYTES, tail_bytes=settings.QM_RANK_LOG_TAIL_BYTES
        ),
    )


def _kubernetes_runtime() -> Runtime:
    """One Kubernetes runtime per process: it holds a connection pool and the
    threads that send a gang's evictions at once."""
    global _kubernetes
    if _kubernetes is None:
        _kubernetes = KubernetesRuntime.from_kubeconfig(
            settings.QM_K8S_KUBECONFIG or None, kubernetes_config()
        )
        # Pods name their priority class: make sure the classes exist before
        # the first launch rather than waiting for the periodic sync. Queued,
        # not called: only the worker may write PriorityClasses (deploy/rbac.yaml),
        # and the web process builds a runtime too, to read logs. The task is an
        # interface module (portal.tasks) above this domain, so it is sent by name.
        try:
            current_app.send_task(SYNC_PRIORITY_CLASSES_TASK, retry=False, expires=60)
        except Exception:
            logger.warning("could not queue the first PriorityClass sync", exc_info=True)
    return _kubernetes
