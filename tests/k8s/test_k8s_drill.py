"""`manage.py drill --runtime kubernetes` against the test control plane.

The drill runs its own web server, Celery worker and beat on a database of its
own, drives the borrower's and the critical job as pods through the real
kube-apiserver and kube-scheduler, and a node agent runs those pods' commands
as local processes, so the borrower really trains, checkpoints on SIGTERM and
resumes. The test checks every figure the mission asks of the drill.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from tests.drills.command import run_drill_command
from tests.k8s.conftest import running_agent
from tools.k8s.agent_state import NodeSpec
from tools.k8s.controlplane import ControlPlane
from tools.k8s.node_agent import NodeAgent
from tools.k8s.volumes import bound_claim, delete_claim

# The drill places a borrower of up to 8 ranks on drill-node-0, flavor drill-gpu.
DRILL_NODES = (NodeSpec(name="drill-node-0", gpus=8, flavor="drill-gpu"),)
RANKS = 4

# The drill takes about four minutes on two shared cores; leave room for a
# control plane that this session still has to start.
pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture
def drill_agent(
    control_plane: ControlPlane, kubeconfig: str, tmp_path: Path
) -> Iterator[NodeAgent]:
    """A node agent for the drill's node that runs every pod as a local process."""
    with running_agent(
        control_plane,
        kubeconfig,
        DRILL_NODES,
        tmp_path / "node-agent",
        pool_size=16,
        run_processes=True,
    ) as agent:
        yield agent


@pytest.fixture
def checkpoint_claim(k8s_api: client.ApiClient, namespace: str) -> Iterator[str]:
    """The checkpoint volume the drill's ranks resume from."""
    volume = bound_claim(k8s_api, namespace, "qm-checkpoints")
    yield "qm-checkpoints"
    delete_claim(k8s_api, namespace, "qm-checkpoints", volume)


def test_drill_on_kubernetes(
    drill_agent: NodeAgent, kubeconfig: str, namespace: str, checkpoint_claim: str, tmp_path: Path
) -> None:
    var_dir = tmp_path / "var"
    var_dir.mkdir()
    env = {
        **os.environ,
        "QM_RUNTIME": "kubernetes",
        "QM_K8S_KUBECONFIG": kubeconfig,
        "QM_K8S_NAMESPACE": namespace,
        "QM_K8S_CHECKPOINT_CLAIM": checkpoint_claim,
        "DATABASE_URL": f"sqlite:///{tmp_path / 'drill.sqlite3'}",
        "QM_VAR_DIR": str(var_dir),
        "CELERY_BROKER_URL": "redis://127.0.0.1:6379/7",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("QM_LOCAL_NODES", None)
    result, drill, elapsed = run_drill_command(
        env,
        [
            "--runtime",
            "kubernetes",
            "--ranks",
            str(RANKS),
            "--steps",
            "150",
            # The critical job comes at step 40, leaving 110 steps of 0.2 s (22 s) for the
            # eviction (the notice's save, then the signal through the API server) to land
            # before the borrower's last step. At three quarters of 100 steps a loaded
            # machine's signal came 8.6 s after the decision, past the last step: ranks
            # that had left their trap died of it (143).
            "--critical-at-step",
            "40",
            "--critical-seconds",
            "5",
        ],
        tmp_path / "drill.json",
        timeout=720,
    )
    print(f"drill on Kubernetes took {elapsed:.1f} s:\n{json.dumps(result, indent=2)}")
    assert drill.returncode == 0, drill.stderr[-4000:]

    assert result["runtime"] == "kubernetes"
    assert result["ranks"] == RANKS
    # Every rank stopped with its gang at the agreed step. Each pod is evicted by its own
    # call, so a rank may have saved and left before its own SIGTERM came (gracetrap then
    # ignores it); the signal of at least one rank stopped the gang.
    assert result["ranks_told"] == RANKS
    assert result["signals_received"] >= 1
    assert result["signal_propagation_seconds"] < 1.2
    assert result["checkpoint_committed"]
    assert result["exit_codes"] == [0] * RANKS
    assert result["orphaned_ports"] == 0
    assert result["restart_integrity"] is True
    assert result["restart_max_abs_diff"] == 0.0
    assert result["recovery_seconds"] is not None
    assert result["passed"] is True
