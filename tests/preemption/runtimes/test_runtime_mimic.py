"""The mimic runtime: gangs that hold their GPUs for the seconds of `sleep SECONDS`,
stop at once when signalled, and are refused in production."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.core.checks import Warning
from django.test import override_settings

from preemption.checks import runtime_check
from preemption.runtime import get_runtime, runtime_problems
from preemption.runtimes import (
    GangId,
    GangSpec,
    NodeInventory,
    RankPlacement,
    RuntimePermanentError,
)
from preemption.runtimes.mimic import KILLED_EXIT_CODE, MimicRuntime, mimic_seconds

ROOT = Path(__file__).resolve().parents[3]
NODES = [
    NodeInventory(name="n1", flavor="h100", gpus=8),
    NodeInventory(name="n2", flavor="h100", gpus=8),
]


def spec(job: int, command: str = "sleep 0.3", attempt: int = 1, ranks: int = 2) -> GangSpec:
    return GangSpec(
        job_id=job,
        attempt=attempt,
        command=command,
        ranks=tuple(
            RankPlacement(rank=r, node=f"n{1 + r % 2}", local_rank=r // 2) for r in range(ranks)
        ),
        gpus_per_rank=1,
        grace_seconds=5,
        priority_class="batch",
        env={},
    )


def phases(runtime: MimicRuntime, gang: GangId) -> list[tuple[str, int | None]]:
    return [(o.phase, o.exit_code) for o in runtime.observe(gang)]


def test_a_gang_runs_for_its_seconds_then_exits_zero(tmp_path: Path) -> None:
    runtime = MimicRuntime(tmp_path, NODES)
    before = time.time()
    runtime.launch(spec(7, "sleep 0.3"))
    running = runtime.observe(GangId(7, 1))
    assert [(o.rank, o.node, o.phase, o.exit_code) for o in running] == [
        (0, "n1", "running", None),
        (1, "n2", "running", None),
    ]
    assert all(o.started_at is not None and o.started_at >= before for o in running)
    time.sleep(0.4)
    ended = runtime.observe(GangId(7, 1))
    assert [(o.phase, o.exit_code, o.signal_sent_at) for o in ended] == [("exited", 0, None)] * 2
    assert ended[0].exited_at == pytest.approx(ended[0].started_at + 0.3)


def test_a_signalled_gang_stops_at_once_and_a_killed_one_with_137(tmp_path: Path) -> None:
    runtime = MimicRuntime(tmp_path, NODES)
    runtime.launch(spec(1, "sleep 60"))
    runtime.launch(spec(2, "sleep 60"))
    runtime.signal(GangId(1, 1), grace_seconds=30)
    runtime.kill(GangId(2, 1))
    signalled = runtime.observe(GangId(1, 1))
    assert [(o.phase, o.exit_code) for o in signalled] == [("exited", 0)] * 2
    assert signalled[0].signal_sent_at == pytest.approx(time.time(), abs=1)
    assert phases(runtime, GangId(2, 1)) == [("exited", KILLED_EXIT_CODE)] * 2
    # A second request changes nothing: the first one ended the gang.
    first = signalled[0].exited_at
    runtime.kill(GangId(1, 1))
    assert runtime.observe(GangId(1, 1))[0].exited_at == first
    assert phases(runtime, GangId(1, 1)) == [("exited", 0)] * 2


def test_a_stop_after_the_gang_ended_is_not_recorded(tmp_path: Path) -> None:
    runtime = MimicRuntime(tmp_path, NODES)
    runtime.launch(spec(3, "sleep 0"))
    runtime.signal(GangId(3, 1), grace_seconds=5)
    runtime.kill(GangId(3, 1))
    assert [(o.phase, o.exit_code, o.signal_sent_at) for o in runtime.observe(GangId(3, 1))] == [
        ("exited", 0, None)
    ] * 2


def test_launch_is_idempotent_and_refuses_a_different_gang_under_the_same_id(
    tmp_path: Path,
) -> None:
    runtime = MimicRuntime(tmp_path, NODES)
    runtime.launch(spec(4, "sleep 10"))
    started = runtime.observe(GangId(4, 1))[0].started_at
    time.sleep(0.05)
    runtime.launch(spec(4, "sleep 10"))
    assert runtime.observe(GangId(4, 1))[0].started_at == started
    with pytest.raises(RuntimePermanentError, match="another command or placement"):
        runtime.launch(spec(4, "sleep 11"))


def test_every_process_sees_the_same_gangs(tmp_path: Path) -> None:
    """State lives on disk: a second runtime object (another worker) observes and stops
    the gangs the first one launched."""
    MimicRuntime(tmp_path, NODES).launch(spec(5, "sleep 60"))
    other = MimicRuntime(tmp_path, NODES)
    assert [(o.job_id, o.rank, o.phase) for o in other.observe()] == [
        (5, 0, "running"),
        (5, 1, "running"),
    ]
    other.signal(GangId(5, 1), 5)
    assert phases(MimicRuntime(tmp_path, NODES), GangId(5, 1)) == [("exited", 0)] * 2


def test_forget_refuses_a_running_gang_and_a_forgotten_one_never_comes_back(
    tmp_path: Path,
) -> None:
    runtime = MimicRuntime(tmp_path, NODES)
    runtime.launch(spec(6, "sleep 60"))
    with pytest.raises(RuntimePermanentError, match="still has live ranks"):
        runtime.forget(GangId(6, 1))
    runtime.signal(GangId(6, 1), 5)
    runtime.forget(GangId(6, 1))
    runtime.forget(GangId(6, 1))
    assert runtime.observe() == [] and runtime.observe(GangId(6, 1)) == []
    runtime.launch(spec(6, "sleep 60"))
    assert runtime.observe() == []
    assert runtime.read_log(GangId(6, 1), 0) == b""
    assert runtime.released_ports([GangId(6, 1)])[GangId(6, 1)] == []


@pytest.mark.parametrize(
    ("command", "reason"),
    [
        ("python train.py", "runs only 'sleep SECONDS'"),
        ("sleep 1; rm -rf /", "runs only 'sleep SECONDS'"),
        ("sleep forever", "needs a number of seconds"),
        ("sleep 1 && true", "runs only 'sleep SECONDS'"),
        ("sleep -1", "between 0 and"),
        ("sleep nan", "between 0 and"),
        ("sleep 1e12", "between 0 and"),
        ("sleep 'unclosed", "cannot parse"),
        ("sleep", "runs only 'sleep SECONDS'"),
    ],
)
def test_only_sleep_with_a_sane_number_of_seconds_is_mimicked(
    tmp_path: Path, command: str, reason: str
) -> None:
    runtime = MimicRuntime(tmp_path, NODES)
    with pytest.raises(RuntimePermanentError, match=reason):
        runtime.launch(spec(8, command))
    assert runtime.observe() == [] and not (tmp_path / "live").exists()


def test_seconds_are_read_from_the_command() -> None:
    assert mimic_seconds("sleep 0.2") == 0.2
    assert mimic_seconds("  sleep   3 ") == 3.0


def test_unknown_nodes_logs_and_ranks_are_refused(tmp_path: Path) -> None:
    runtime = MimicRuntime(tmp_path, NODES[:1])
    with pytest.raises(RuntimePermanentError, match=r"unknown nodes \['n2'\]"):
        runtime.launch(spec(9))
    runtime.launch(spec(9, ranks=1))
    assert runtime.read_log(GangId(9, 1), 0) == b""
    with pytest.raises(RuntimePermanentError, match="has no rank 1"):
        runtime.read_log(GangId(9, 1), 1)
    with pytest.raises(RuntimePermanentError, match="has no rank 0"):
        runtime.read_log(GangId(10, 1), 0)
    with pytest.raises(RuntimePermanentError, match="bad log range"):
        runtime.read_log(GangId(9, 1), 0, offset=-1)


def test_settings_select_it_and_every_check_says_it_runs_nothing(tmp_path: Path) -> None:
    with override_settings(QM_RUNTIME="mimic", QM_RUNS_DIR=tmp_path, QM_LOCAL_NODES="n1:h100:8"):
        runtime = get_runtime()
        assert isinstance(runtime, MimicRuntime) and runtime.root == (tmp_path / "mimic").resolve()
        assert [n.name for n in runtime.nodes()] == ["n1"]
        assert any("runs no job" in problem for problem in runtime_problems())
        # A warning outside production, shown by every command that checks the project.
        (message,) = runtime_check()
        assert isinstance(message, Warning) and "runs no job" in message.msg


def test_production_refuses_the_mimic_runtime() -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("QM_")},
        "QM_PRODUCTION": "1",
        "QM_RUNTIME": "mimic",
        "SECRET_KEY": "k3J9-vQ_x2Lm8pR7tY1wZ4nB6cD0eF5gH3jK8lM2nP9qR4sT7uV1wX6yZ0aB5cD8eF",
        "ALLOWED_HOSTS": "qm.example.org",
        "CSRF_TRUSTED_ORIGINS": "https://qm.example.org",
    }
    started = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode != 0
    assert "ImproperlyConfigured" in started.stderr
    assert "QM_RUNTIME=mimic runs no job" in started.stderr
