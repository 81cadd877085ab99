"""Kubernetes checkpoints belong to one job: its own folder, uid and disk; no GPU env.

Every rank used to mount the one checkpoint claim at its root as the same uid,
so a rank could list every team's checkpoints, read their weights and plant a
file that would run in their pods on resume. Here the pod specs are built by the
runtime and created on the real API server of tests/k8s, in a namespace that
enforces the "restricted" Pod Security Standard; the node agent runs the ranks
as host processes as the pods' own users (``run_as_pod_users``), so the kernel
judges what a rank of one job may do to another job's folder. The same attacks
run in real containers on real kubelets in
tests/k8s/realnodes/test_real_containment.py.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from preemption.runtimes.base import GangSpec, RuntimePermanentError
from preemption.runtimes.kubernetes import KubernetesRuntime
from preemption.runtimes.kubernetes.config import DEFAULT_JOB_UID_BASE, GPU_RESOURCE, pod_name
from preemption.runtimes.kubernetes.policies import namespace_labels
from preemption.runtimes.kubernetes.spec import (
    CHECKPOINT_FOLDER_CONTAINER,
    CHECKPOINT_VOLUME_ROOT,
    checkpoint_folder,
    job_uid,
)
from tests.k8s.conftest import (  # noqa: F401  (fixtures used by name)
    control_plane,
    k8s_api,
    kubeconfig,
    make_runtime,
    namespace,
    node_agent,
    running_agent,
    test_priority_classes,
)
from tools.k8s.agent_state import ANNOTATION_RUN, NodeSpec
from tools.k8s.controlplane import ControlPlane
from tools.k8s.gangs import all_in, gang_spec
from tools.k8s.node_agent import NodeAgent
from tools.k8s.volumes import bound_claim, delete_claim
from tools.k8s.wait import wait_for

MakeRuntime = Callable[..., KubernetesRuntime]
CLAIM = "qm-checkpoints"
MOUNT = "/checkpoints"
SECURE_NODES = (NodeSpec(name="secure-node-0", gpus=8), NodeSpec(name="secure-node-1", gpus=8))


@pytest.fixture
def restricted(k8s_api: client.ApiClient, namespace: str) -> str:  # noqa: F811
    client.CoreV1Api(k8s_api).patch_namespace(
        namespace, {"metadata": {"labels": namespace_labels()}}
    )
    return namespace


@pytest.fixture
def claim(k8s_api: client.ApiClient, restricted: str) -> Iterator[str]:  # noqa: F811
    volume = bound_claim(k8s_api, restricted, CLAIM)
    yield CLAIM
    delete_claim(k8s_api, restricted, CLAIM, volume)


@pytest.fixture
def secure_agent(
    control_plane: ControlPlane,  # noqa: F811
    kubeconfig: str,  # noqa: F811
    runner_tmp_path: Path,
) -> Iterator[NodeAgent]:
    """A node agent that runs every pod as a host process as the pod's own user; its
    folders lie under one the ranks' users may pass through."""
    with running_agent(
        control_plane,
        kubeconfig,
        SECURE_NODES,
        runner_tmp_path / "agent",
        pool_size=8,
        run_processes=True,
        run_as_pod_users=True,
    ) as agent:
        yield agent


def _agent_logs(agent: NodeAgent, in_namespace: str) -> str:
    """Every container log the agent kept in ``in_namespace``, init containers' included."""
    folder = agent.work_dir / "logs" / in_namespace
    return "\n".join(f"{p.name}: {p.read_text()}" for p in sorted(folder.glob("*.log")))


def _job(
    job_id: int,
    node: str,
    *,
    team: str,
    flavor: str = "h100",
    gpus_per_rank: int = 1,
    command: str = "sleep infinity",
    env: dict[str, str] | None = None,
) -> tuple[GangSpec, str]:
    """A one-rank gang of ``team`` whose checkpoint folder is named as the control plane
    names them; returns the spec and the folder's name."""
    base = gang_spec(job_id, {node: 1}, gpus_per_rank=gpus_per_rank, command=command)
    folder = f"job-{job_id}-{secrets.token_hex(6)}"
    fields: dict[str, Any] = {name: getattr(base, name) for name in base.__slots__}
    fields |= {
        "team": team,
        "flavor": flavor,
        "env": {**base.env, "QM_CHECKPOINT_DIR": f"{MOUNT}/{folder}", **(env or {})},
    }
    return GangSpec(**fields), folder


@pytest.mark.k8s
def test_two_teams_jobs_get_their_own_folder_uid_and_disk_and_no_gpu_env(
    make_runtime: MakeRuntime,  # noqa: F811
    k8s_api: client.ApiClient,  # noqa: F811
    restricted: str,
    claim: str,
) -> None:
    core = client.CoreV1Api(k8s_api)
    runtime = make_runtime(
        checkpoint_claim=claim,
        checkpoint_mount_path=MOUNT,
        ephemeral_storage_per_gpu={"h100": "50Gi"},
    )
    own_env = {"LEARNING_RATE": "0.1"}
    vision, vision_folder = _job(611, "gpu-node-0", team="vision", gpus_per_rank=2, env=own_env)
    nlp, nlp_folder = _job(612, "gpu-node-1", team="nlp", flavor="a100", env=own_env)
    for spec in (vision, nlp):
        runtime.launch(spec)  # the restricted namespace's admission would refuse here
    wait_for(lambda: all_in(runtime, vision.gang, "running", 1), timeout=60, what="vision runs")
    wait_for(lambda: all_in(runtime, nlp.gang, "running", 1), timeout=60, what="nlp runs")

    seen: dict[int, dict[str, Any]] = {}
    for spec, folder, disk, gpus in (
        (vision, vision_folder, "100Gi", "2"),
        (nlp, nlp_folder, "20Gi", "1"),
    ):
        pod = core.read_namespaced_pod(pod_name(spec.gang, 0), restricted)
        context = pod.spec.security_context
        uid = DEFAULT_JOB_UID_BASE + spec.job_id
        assert (context.run_as_user, context.run_as_group, context.fs_group) == (uid, uid, uid)
        assert context.run_as_non_root is True

        [rank] = pod.spec.containers
        [mount] = [m for m in rank.volume_mounts if m.name == "checkpoints"]
        # Only the job's own folder, at the path its trap writes to; never the root.
        assert (mount.sub_path, mount.mount_path) == (folder, f"{MOUNT}/{folder}")
        assert rank.resources.limits == rank.resources.requests
        assert rank.resources.limits == {
            GPU_RESOURCE: gpus,
            "cpu": str(4 * int(gpus)),
            "memory": f"{16 * int(gpus)}Gi",
            "ephemeral-storage": disk,
        }
        names = {variable.name for variable in rank.env}
        assert "LEARNING_RATE" in names
        assert not {n for n in names if n.startswith(("NVIDIA_", "CUDA_"))}

        [init] = pod.spec.init_containers
        assert init.name == CHECKPOINT_FOLDER_CONTAINER
        assert init.args is None and init.command[-1] == folder
        assert [(m.mount_path, m.sub_path) for m in init.volume_mounts] == [
            (CHECKPOINT_VOLUME_ROOT, None)
        ]
        assert GPU_RESOURCE not in (init.resources.limits or {})
        assert {v.name: v.value for v in init.env}["NVIDIA_VISIBLE_DEVICES"] == "void"
        assert init.security_context.allow_privilege_escalation is False
        assert init.security_context.capabilities.drop == ["ALL"]
        seen[spec.job_id] = {"sub_path": mount.sub_path, "uid": uid, "fs_group": context.fs_group}
    assert seen[611]["sub_path"] != seen[612]["sub_path"]
    assert seen[611]["uid"] != seen[612]["uid"]
    assert seen[611]["fs_group"] != seen[612]["fs_group"]


@pytest.mark.k8s
@pytest.mark.parametrize(
    "planted",
    [
        {"NVIDIA_VISIBLE_DEVICES": "all"},
        {"NVIDIA_DRIVER_CAPABILITIES": "all", "LEARNING_RATE": "0.1"},
        {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"},
    ],
)
def test_a_gang_naming_the_gpu_runtimes_variables_is_refused_before_anything_exists(
    make_runtime: MakeRuntime,  # noqa: F811
    k8s_api: client.ApiClient,  # noqa: F811
    restricted: str,
    planted: dict[str, str],
) -> None:
    core = client.CoreV1Api(k8s_api)
    runtime = make_runtime()
    spec, _ = _job(613, "gpu-node-0", team="vision", env=planted)
    with pytest.raises(RuntimePermanentError) as refused:
        runtime.launch(spec)
    reserved = sorted(name for name in planted if name != "LEARNING_RATE")
    assert f"qm-613-1 sets {', '.join(reserved)}: CUDA_* and NVIDIA_* are reserved" in str(
        refused.value
    )
    assert core.list_namespaced_pod(restricted).items == []
    assert (
        core.list_namespaced_config_map(restricted, label_selector="quartermaster.dev/gang").items
        == []
    )
    assert runtime.observe(spec.gang) == []


# Job A keeps a secret in its checkpoint folder; job B, told exactly where it lies on
# the host, tries to list the volume, read A's file and plant a file in A's folder,
# and writes its own checkpoint. Each line says what happened.
PROBE = f"""{sys.executable} -c '
import os, sys
own = os.environ["QM_CHECKPOINT_DIR"]
def attempt(what, action):
    try:
        action()
        print(what, "allowed", flush=True)
    except PermissionError:
        print(what, "refused", flush=True)
if sys.argv[1] == "keep":
    open(os.path.join(own, "step_1.pt"), "w").write("weights of A")
    print("kept", os.stat(own).st_uid, oct(os.stat(own).st_mode & 0o777), flush=True)
else:
    other, volume = sys.argv[2], sys.argv[3]
    attempt("list-volume", lambda: os.listdir(volume))
    attempt("list-other", lambda: os.listdir(other))
    attempt("read-other", lambda: open(os.path.join(other, "step_1.pt")).read())
    attempt("plant-other", lambda: open(os.path.join(other, "state.pkl"), "w").write("x"))
    attempt("write-own", lambda: open(os.path.join(own, "step_1.pt"), "w").write("B"))
' """


@pytest.mark.k8s
def test_a_rank_of_one_job_cannot_read_list_or_plant_in_another_jobs_folder(
    make_runtime: MakeRuntime,  # noqa: F811
    secure_agent: NodeAgent,
    restricted: str,
    claim: str,
) -> None:
    runtime = make_runtime(
        checkpoint_claim=claim,
        checkpoint_mount_path=MOUNT,
        pod_annotations={ANNOTATION_RUN: "process"},
    )
    volume = secure_agent.claim_folder(restricted, claim)
    keeper, keeper_folder = _job(621, "secure-node-0", team="vision", command=f"{PROBE} keep")
    runtime.launch(keeper)
    wait_for(lambda: all_in(runtime, keeper.gang, "exited", 1), timeout=60, what="A kept")
    [kept] = runtime.observe(keeper.gang)
    assert kept.exit_code == 0, _agent_logs(secure_agent, restricted)
    uid_a = job_uid(DEFAULT_JOB_UID_BASE, 621)
    assert runtime.read_log(keeper.gang, 0).decode().split() == ["kept", str(uid_a), "0o700"]
    assert (volume / keeper_folder).stat().st_uid == uid_a

    other = volume / keeper_folder
    prober, prober_folder = _job(
        622, "secure-node-1", team="nlp", command=f"{PROBE} probe {other} {volume}"
    )
    runtime.launch(prober)
    wait_for(lambda: all_in(runtime, prober.gang, "exited", 1), timeout=60, what="B probed")
    outcome = runtime.read_log(prober.gang, 0).decode().splitlines()
    assert outcome == [
        "list-volume refused",
        "list-other refused",
        "read-other refused",
        "plant-other refused",
        "write-own allowed",
    ]
    assert sorted(p.name for p in other.iterdir()) == ["step_1.pt"]
    assert (other / "step_1.pt").read_text() == "weights of A"
    assert (volume / prober_folder).stat().st_uid == job_uid(DEFAULT_JOB_UID_BASE, 622)
    assert (volume / prober_folder / "step_1.pt").read_text() == "B"


@pytest.mark.k8s
def test_a_folder_someone_else_made_first_fails_the_pod_instead_of_being_shared(
    make_runtime: MakeRuntime,  # noqa: F811
    secure_agent: NodeAgent,
    restricted: str,
    claim: str,
) -> None:
    runtime = make_runtime(
        checkpoint_claim=claim,
        checkpoint_mount_path=MOUNT,
        pod_annotations={ANNOTATION_RUN: "process"},
    )
    victim, folder = _job(631, "secure-node-0", team="vision", command="echo ran")
    # Another job's uid took the name first (planting a file to be loaded on resume).
    squatted = secure_agent.claim_folder(restricted, claim) / folder
    squatted.mkdir(parents=True)
    squatter = job_uid(DEFAULT_JOB_UID_BASE, 632)
    os.chown(squatted, squatter, squatter)
    runtime.launch(victim)
    wait_for(lambda: all_in(runtime, victim.gang, "exited", 1), timeout=60, what="refused")
    [observed] = runtime.observe(victim.gang)
    assert observed.exit_code == 1
    # The rank's own command never ran.
    assert b"ran" not in runtime.read_log(victim.gang, 0)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/checkpoints/job-7-0123456789ab", "job-7-0123456789ab"),
        ("/checkpoints/job-7-0123456789ab/", "job-7-0123456789ab"),
        ("/checkpoints", None),
        ("/checkpoints/../etc", None),
        ("/checkpoints/a/b", None),
        ("/elsewhere/job-7", None),
        ("relative/job-7", None),
    ],
)
def test_only_a_plain_folder_directly_on_the_volume_is_a_jobs_sub_path(
    path: str, expected: str | None
) -> None:
    assert checkpoint_folder(path, CLAIM, MOUNT) == expected
    assert checkpoint_folder(path, None, MOUNT) is None


def test_job_uids_stay_inside_what_kubernetes_accepts() -> None:
    assert job_uid(DEFAULT_JOB_UID_BASE, 5) == 2**30 + 5
    with pytest.raises(RuntimePermanentError, match=r"outside 1\.\.2147483647"):
        job_uid(DEFAULT_JOB_UID_BASE, 2**30)
