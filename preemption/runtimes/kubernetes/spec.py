"""What a rank's pod is: its container, env, resources, volumes and security context.

It owns the pod body that launch() creates for each rank, the wrapper that runs as
the container's PID 1 (RANK_ENTRYPOINT), the init container that makes the job's
checkpoint folder, and the checks that refuse a gang before anything is created.
Pure: it builds dictionaries and makes no API call.
"""

from __future__ import annotations

import math
import posixpath
import re
from typing import Any

from preemption.job_rules import image_admitted
from preemption.runtimes.base import MTBP_FILE_ENV, GangSpec, RuntimePermanentError
from preemption.runtimes.kubernetes.config import (
    CONTAINER_NAME,
    EVENTS_TOKEN_KEY,
    EXIT_CODE_FINALIZER,
    GPU_RESOURCE,
    MAX_POD_UID,
    NODE_LABEL,
    RANK_LABEL,
    RISK_KEY,
    RISK_MOUNT_PATH,
    RISK_VOLUME,
    TEAM_LABEL,
    KubernetesRuntimeConfig,
    gang_labels,
    gang_name,
    pod_name,
    risk_config_map_name,
)

# The trap's notice poll (gracetrap.protocol.NOTICE_POLL_ENV and NOTICE_POLL_SECONDS):
# pods cannot be signalled, so the trap asks the events URL for the notice this often.
NOTICE_POLL_ENV = "QM_NOTICE_POLL_SECONDS"
NOTICE_POLL_SECONDS = 0.5
# The checkpoint volume: the rank container's mount is its job's folder only; the
# init container that makes that folder sees the claim's root here.
CHECKPOINT_VOLUME = "checkpoints"
CHECKPOINT_FOLDER_CONTAINER = "checkpoint-folder"
CHECKPOINT_VOLUME_ROOT = "/var/run/quartermaster/checkpoint-volume"
CHECKPOINT_VOLUME_ENV = "QM_CHECKPOINT_VOLUME"
_CHECKPOINT_FOLDER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
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
# local runtime's, waits for its foreground command on SIGTERM, then for its
# background ones (the container ends with PID 1, killing what is left), and exits
# with the foreground command's status, so a workload that checkpoints and exits 0
# records 0. `wait` is
# repeated while the child lives because a trapped signal interrupts it; and once
# more after: a wait the trap cut short may already have collected the child's exit
# (dash and busybox ash then answer 128+15 and keep the real status for one more
# wait; 127 means it was already waited for). bash can still lose it (its wait
# then answers -1), so on an image whose /bin/sh is bash a rank signalled just as it
# exits may read 255.
RANK_ENTRYPOINT = r"""trap 'trap "" TERM; kill -TERM 0' TERM
/bin/sh -c "trap 'qm_status=\$?; wait; exit \$qm_status' TERM
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


def on_checkpoint_volume(path: str, claim: str | None, mount_path: str) -> bool:
    """Whether ``path`` lies on the checkpoint volume ``claim`` mounted at ``mount_path``.

    Only such a path survives the pod and is visible from the node the next
    attempt lands on. ``..`` is resolved first, so it cannot climb out.
    """
    if not claim or not posixpath.isabs(path):
        return False
    mount = posixpath.normpath(mount_path).rstrip("/")
    return posixpath.normpath(path).startswith(mount + "/")


def check_image(settings: KubernetesRuntimeConfig, spec: GangSpec) -> None:
    """Refuse an image the team's allowlist does not admit."""
    allowed = settings.image_allowlist.get(spec.team)
    image = spec.image or settings.default_image
    # Matched by path segment, as at submission (where the lists of the teams
    # above are checked too): a raw prefix would admit a look-alike repository.
    if allowed is not None and not any(image_admitted(image, prefix) for prefix in allowed):
        raise RuntimePermanentError(
            f"image {image} is not allowed for team {spec.team}: "
            f"allowed are {', '.join(allowed) or 'none'}"
        )


def check_env(spec: GangSpec) -> None:
    """Refuse, before anything is created, a gang whose env names the GPU runtime's
    variables: NVIDIA_VISIBLE_DEVICES=all would expose every GPU of the node."""
    reserved = sorted(key for key in spec.env if key.startswith(RESERVED_GPU_ENV_PREFIXES))
    if reserved:
        raise RuntimePermanentError(
            f"{gang_name(spec.gang)} sets {', '.join(reserved)}: CUDA_* and NVIDIA_* are "
            f"reserved, a rank gets its GPUs through its {GPU_RESOURCE} limit only"
        )


def pod_body(
    settings: KubernetesRuntimeConfig,
    spec: GangSpec,
    namespace: str,
    rank: int,
    owner_references: list[dict[str, Any]],
) -> dict[str, Any]:
    """The Pod of one rank of a gang (module docstring of the package: what it must meet)."""
    gang = spec.gang
    placement = next(p for p in spec.ranks if p.rank == rank)
    name = gang_name(gang)
    master_addr = f"rank-0.{name}.{namespace}.svc.{settings.cluster_domain}"
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
        {"name": "MASTER_PORT", "value": str(settings.master_port)},
        {"name": "OMP_NUM_THREADS", "value": "1"},
        {"name": NOTICE_POLL_ENV, "value": f"{NOTICE_POLL_SECONDS:g}"},
        {
            "name": EVENTS_TOKEN_KEY,
            "valueFrom": {"secretKeyRef": {"name": f"{name}-events", "key": EVENTS_TOKEN_KEY}},
        },
        {"name": MTBP_FILE_ENV, "value": posixpath.join(RISK_MOUNT_PATH, RISK_KEY)},
    ]
    labels = gang_labels(gang) | {RANK_LABEL: str(rank), NODE_LABEL: placement.node}
    if spec.team:
        labels[TEAM_LABEL] = spec.team
    resources = rank_resources(settings, spec)
    container_security: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    image = spec.image or settings.default_image
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["/bin/sh", "-c", RANK_ENTRYPOINT, "qm-rank", spec.command],
        "env": env,
        "resources": {"limits": resources, "requests": resources},
        "securityContext": container_security,
    }
    uid = job_uid(settings.job_uid_base, spec.job_id)
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
    if settings.service_account:
        pod_spec["serviceAccountName"] = settings.service_account
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
        checkpoint_dir, settings.checkpoint_claim, settings.checkpoint_mount_path
    )
    if folder is not None:
        # Only the job's own folder, where its ranks expect it; never the claim's root.
        pod_spec["volumes"].append(
            {
                "name": CHECKPOINT_VOLUME,
                "persistentVolumeClaim": {"claimName": settings.checkpoint_claim},
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
                "imagePullPolicy": settings.image_pull_policy,
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
                "volumeMounts": [{"name": CHECKPOINT_VOLUME, "mountPath": CHECKPOINT_VOLUME_ROOT}],
            }
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(gang, rank),
            "labels": labels,
            "annotations": dict(settings.pod_annotations),
            "ownerReferences": owner_references,
            "finalizers": [EXIT_CODE_FINALIZER],
        },
        "spec": pod_spec,
    }


def rank_resources(settings: KubernetesRuntimeConfig, spec: GangSpec) -> dict[str, str]:
    """One rank's requests and limits: its GPUs and the flavor's CPU, memory and
    ephemeral storage per GPU."""
    gpus = spec.gpus_per_rank
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


def _scaled(quantity: str, times: int) -> str:
    """``quantity`` (a Kubernetes quantity such as ``4``, ``500m`` or ``16Gi``) times ``times``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", quantity.strip())
    if match is None:
        raise ValueError(f"not a Kubernetes quantity: {quantity!r}")
    number = float(match.group(1)) * times
    text = f"{number:.3f}".rstrip("0").rstrip(".")
    return f"{text}{match.group(2)}"
