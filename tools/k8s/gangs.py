"""Small builders for gangs used by the Kubernetes tests and the benchmark."""

from __future__ import annotations

import base64

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from preemption.runtimes.base import GangId, GangSpec, RankPlacement
from preemption.runtimes.kubernetes import KubernetesRuntime
from preemption.runtimes.kubernetes.config import kept_log_name


def gang_spec(
    job_id: int,
    nodes: dict[str, int],
    *,
    command: str = "sleep infinity",
    grace_seconds: float = 5.0,
    priority_class: str = "qm-test-low",
    gpus_per_rank: int = 1,
    attempt: int = 1,
) -> GangSpec:
    """A gang with ``nodes[name]`` ranks placed on each named node, in order."""
    ranks = []
    for node, count in nodes.items():
        for local_rank in range(count):
            ranks.append(RankPlacement(rank=len(ranks), node=node, local_rank=local_rank))
    return GangSpec(
        job_id=job_id,
        attempt=attempt,
        command=command,
        ranks=tuple(ranks),
        gpus_per_rank=gpus_per_rank,
        grace_seconds=grace_seconds,
        priority_class=priority_class,
        env={
            "QM_JOB_ID": str(job_id),
            "QM_ATTEMPT": str(attempt),
            "QM_GRACE_SECONDS": str(grace_seconds),
            "QM_EVENTS_TOKEN": f"secret-token-{job_id}",
        },
        team="vision",
        flavor="h100",
    )


def phases(runtime: KubernetesRuntime, gang: GangId) -> dict[str, int]:
    """How many ranks of the gang are in each phase right now."""
    counts: dict[str, int] = {}
    for observation in runtime.observe(gang):
        counts[observation.phase] = counts.get(observation.phase, 0) + 1
    return counts


def all_in(runtime: KubernetesRuntime, gang: GangId, phase: str, world_size: int) -> bool:
    """Whether every one of the gang's ``world_size`` ranks is in ``phase``."""
    return phases(runtime, gang) == {phase: world_size}


def kept_log(core: client.CoreV1Api, namespace: str, gang: GangId, rank: int) -> bytes | None:
    """The end of a stopped rank's log that the runtime kept in the cluster, or None
    while there is none (preemption.runtimes.kubernetes.logs.keep_logs)."""
    try:
        record = core.read_namespaced_config_map(kept_log_name(gang, rank), namespace)
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    return base64.b64decode(record.binary_data["log"])
