"""GPU confinement through the environment: a job may not set the variables the
GPU runtime reads (CUDA_*, NVIDIA_*), and a rank never inherits the control
plane's own, which would hand it every GPU of the machine. The second is proven
with real rank processes that print their environment.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import preemption.runtimes.local.launch_server as launch_servers
from preemption.runtimes import GangSpec, LocalRuntime, RankPlacement, parse_inventory
from preemption.runtimes.runner import RunnerAccount
from tests.conftest import database_state
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize(
    "name",
    ["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "cuda_home"],
)
def test_a_job_may_not_set_the_gpu_runtimes_variables(world: Any, name: str) -> None:
    before = database_state()
    response = world.client("researcher").post(
        "/api/v1/jobs/",
        {
            "team": "vision",
            "flavor": "h100-80gb",
            "ranks": 1,
            "gpus_per_rank": 1,
            "command": "true",
            "env": {name: "0,1,2,3,4,5,6,7", "BATCH": "64"},
        },
        format="json",
    )
    assert response.status_code == 400, response.content
    assert response.json() == {
        "env": [
            f"{name} is reserved: the runtime sets CUDA_* and NVIDIA_* to confine each "
            "rank to the GPUs it was given."
        ]
    }
    assert database_state() == before


@pytest.fixture
def fresh_launcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The control plane's environment as on a GPU host, and a launcher started
    with it (the one this process may have started already has another)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    monkeypatch.setenv("CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    servers: dict[Any, Any] = {}
    monkeypatch.setattr(launch_servers, "_LAUNCH_SERVERS", servers)
    yield
    for server in servers.values():
        server.stop()


def test_a_rank_sees_none_of_the_control_planes_gpu_variables(
    fresh_launcher: None, runner_tmp_path: Path, runner_account: RunnerAccount
) -> None:
    runtime = LocalRuntime(
        runner_tmp_path / "runs", parse_inventory("node-a:h100-80gb:8"), runner=runner_account
    )
    spec = GangSpec(
        job_id=1,
        attempt=1,
        # Each rank prints the names of its environment, one a line, and its GPUs.
        command=(
            "env | cut -d= -f1 | sort; "
            'echo "gpus=$CUDA_VISIBLE_DEVICES/$NVIDIA_VISIBLE_DEVICES"; echo done'
        ),
        ranks=(
            RankPlacement(rank=0, node="node-a", local_rank=0),
            RankPlacement(rank=1, node="node-a", local_rank=1),
        ),
        gpus_per_rank=1,
        grace_seconds=5.0,
        priority_class="ai-batch-preemptible",
        env={"QM_JOB_ID": "1", "QM_ATTEMPT": "1"},
        team="vision",
        flavor="h100-80gb",
    )
    runtime.launch(spec)
    wait_until(
        lambda: (
            all(o.phase == "exited" for o in runtime.observe(spec.gang))
            and len(runtime.observe(spec.gang)) == 2
        ),
        what="both ranks to exit",
    )
    for rank in (0, 1):
        log = runtime.read_log(spec.gang, rank).decode()
        assert "done" in log, log
        names = log.splitlines()
        # The launcher was started with them, and passes its other inherited names on.
        assert "NCCL_DEBUG" in names and "RANK" in names, names
        # Only the two the runtime sets itself, naming the rank's own GPU, not the
        # control plane's eight.
        gpu_names = [name for name in names if name.startswith(("CUDA_", "NVIDIA_"))]
        assert gpu_names == ["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"], names
        assert f"gpus={rank}/{rank}" in names, names
