"""`manage.py drill --runtime kubernetes` on two real nodes: the mission's drill with
the kubelet delivering every signal.

The borrower's 8 ranks span ``drill-node-0`` and ``drill-node-1`` (4 GPUs each) as
real containers that run the host's Python, torch and gracetrap (the nodes' host
mounts, as in test_real_python_ranks), rendezvous through ``MASTER_ADDR`` by the
cluster DNS, and checkpoint on a claim both nodes mount (a hostPath volume bound
with its claim's uid). The critical job preempts them through evictions; each rank's
kubelet sends its SIGTERM, the gang agrees on a step, saves it and exits 0, and the
borrower resumes, bit-exact, once the critical job is done. The drill's web server
listens on the host's address on the pods' bridge, where the trap's POSTs come from.

It takes several minutes and more than the real-node tier's budget, so ``make test``
leaves it out (marker ``real_drill``); ``make drill-real`` runs it. docs/real-nodes.md
records its figures.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from tests.drills.command import assert_shrunk_and_grown_back, run_drill_command
from tests.k8s.realnodes.conftest import DRILL_GPUS_PER_NODE, DRILL_NODE_NAMES
from tools.k8s.realnodes import RealNodes
from tools.k8s.volumes import bound_claim, delete_claim

RANKS = len(DRILL_NODE_NAMES) * DRILL_GPUS_PER_NODE
CLAIM = "qm-checkpoints"

pytestmark = [pytest.mark.k8s, pytest.mark.real_drill, pytest.mark.timeout(1500)]


@pytest.fixture
def drill_claim(
    k8s_api: client.ApiClient, drill_namespace: str, drill_folder: Path
) -> Iterator[str]:
    """The checkpoint claim, on a folder of the host that both nodes mount."""
    folder = drill_folder / "checkpoint-volume"
    folder.mkdir()
    # The root of a shared checkpoint volume, as production's would be: anyone may
    # make a folder in it, nobody may list or touch another's (the runtime's init
    # container makes each job's own).
    folder.chmod(0o1733)
    volume = bound_claim(k8s_api, drill_namespace, CLAIM, host_path=folder)
    yield CLAIM
    delete_claim(k8s_api, drill_namespace, CLAIM, volume)


def _drill_env(
    nodes: RealNodes, kubeconfig: str, namespace: str, claim: str, folder: Path
) -> dict[str, str]:
    """The drill's environment on the real nodes: their cluster, the claim, the pods'
    resources, nodes of 4 GPUs and the web server on the pods' bridge."""
    env = {
        **os.environ,
        "QM_RUNTIME": "kubernetes",
        "QM_K8S_KUBECONFIG": kubeconfig,
        "QM_K8S_NAMESPACE": namespace,
        "QM_K8S_CHECKPOINT_CLAIM": claim,
        # Each node's 2 CPUs split over its 4 GPUs, as an operator gives a rank the
        # CPUs of its share of the node: a rank held to a tenth of a CPU spends most of
        # each 100 ms period throttled, and its signal waits on that (docs/real-nodes.md).
        "QM_K8S_DEFAULT_CPU_PER_GPU": "500m",
        "QM_K8S_DEFAULT_MEMORY_PER_GPU": "1Gi",
        "QM_K8S_DEFAULT_EPHEMERAL_STORAGE_PER_GPU": "256Mi",
        "QM_DRILL_GPUS_PER_NODE": str(DRILL_GPUS_PER_NODE),
        "QM_DRILL_BIND_ADDRESS": nodes.dns_address,
        "DATABASE_URL": f"sqlite:///{folder / 'drill.sqlite3'}",
        "QM_VAR_DIR": str(folder),
        "CELERY_BROKER_URL": "redis://127.0.0.1:6379/8",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("QM_LOCAL_NODES", None)
    return env


# Each its own drill: with the notice the ranks save while they train, and the
# eviction's save has only the steps since; without it, the signals alone stop them
# (their propagation is the kubelets' and the relay's).
@pytest.mark.parametrize("notice", ["off", "on"])
def test_the_drill_passes_on_real_pods(
    notice: str,
    drill_nodes: RealNodes,
    kubeconfig: str,
    drill_namespace: str,
    drill_claim: str,
    drill_folder: Path,
) -> None:
    result, drill, elapsed = run_drill_command(
        _drill_env(drill_nodes, kubeconfig, drill_namespace, drill_claim, drill_folder),
        [
            "--runtime",
            "kubernetes",
            "--ranks",
            str(RANKS),
            "--steps",
            # Real pods train slower than the node agent's processes (about 0.4 s a
            # step here): at 80 steps the borrower finished before the eviction came.
            "300",
            "--critical-seconds",
            "5",
            "--notice",
            notice,
        ],
        drill_folder / "drill.json",
        timeout=1380,
    )
    print(
        f"drill on real pods, notice {notice}, took {elapsed:.1f} s:\n"
        f"{json.dumps(result, indent=2)}"
    )

    assert result["runtime"] == "kubernetes"
    assert result["ranks"] == RANKS
    # Every rank stopped with its gang at the agreed step, its own SIGTERM or not.
    assert result["ranks_told"] == RANKS
    assert result["checkpoint_committed"]
    assert result["exit_codes"] == [0] * RANKS
    assert result["orphaned_ports"] == 0
    assert result["restart_integrity"] is True
    assert result["restart_max_abs_diff"] == 0.0
    assert result["recovery_seconds"] is not None
    assert drill.returncode == 0, drill.stderr[-4000:]
    assert result["passed"] is True


def test_the_elastic_drill_passes_on_real_pods(
    drill_nodes: RealNodes,
    kubeconfig: str,
    drill_namespace: str,
    drill_claim: str,
    drill_folder: Path,
) -> None:
    """`manage.py drill --elastic` on the two real nodes: the borrower's 8 ranks (4 a
    node) are shrunk to 4 by the owner's job of one node's GPUs, and grown back to 8
    when it ends, each resize an eviction of every pod, an agreed step and a relaunch of
    new pods at the new size that resume from the claim; every sample once per epoch."""
    result, drill, elapsed = run_drill_command(
        _drill_env(drill_nodes, kubeconfig, drill_namespace, drill_claim, drill_folder),
        ["--elastic", "--runtime", "kubernetes", "--ranks", str(RANKS)],
        drill_folder / "elastic.json",
        timeout=1380,
    )
    print(f"the elastic drill on real pods took {elapsed:.1f} s:\n{json.dumps(result, indent=2)}")

    assert result["runtime"] == "kubernetes"
    # Every exit code as the kubelets report it.
    assert_shrunk_and_grown_back(result, RANKS)
    assert drill.returncode == 0, result["missed"]
    assert result["passed"] is True
