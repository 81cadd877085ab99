"""The mimic runtime: gangs that hold their GPUs for the seconds of `sleep SECONDS`,
stop at once when signalled (or after the save their job asks for), resume from what
their previous attempt kept, and are refused in production."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

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
    mimic,
)
from preemption.runtimes.mimic import (
    KILLED_EXIT_CODE,
    GangProgress,
    MimicRuntime,
    gang_progress,
    mimic_seconds,
)
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[3]
NODES = [
    NodeInventory(name="n1", flavor="h100", gpus=8),
    NodeInventory(name="n2", flavor="h100", gpus=8),
]


def spec(
    job: int,
    command: str = "sleep 0.3",
    attempt: int = 1,
    ranks: int = 2,
    env: dict[str, str] | None = None,
) -> GangSpec:
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
        env=env or {},
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


def test_observing_every_gang_reads_again_only_the_records_another_process_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = MimicRuntime(tmp_path, NODES)
    for job in (11, 12, 13):
        runtime.launch(spec(job, "sleep 60"))
    read: list[str] = []
    reading = mimic.read_record

    def counted(path: Path) -> dict[str, Any] | None:
        read.append(path.name)
        return reading(path)

    monkeypatch.setattr(mimic, "read_record", counted)
    assert {(o.job_id, o.phase) for o in runtime.observe()} == {
        (11, "running"),
        (12, "running"),
        (13, "running"),
    }
    assert sorted(read) == ["11-1.json", "12-1.json", "13-1.json"]
    read.clear()
    assert len(runtime.observe()) == 6
    assert read == [], "nothing changed: nothing is read again"

    # Another worker stops one gang (a rewrite of its record) and one ends and is forgotten.
    stopped = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; "
            "from preemption.runtimes import GangId; "
            "from preemption.runtimes.mimic import MimicRuntime; "
            "MimicRuntime(Path(sys.argv[1]), []).signal(GangId(12, 1), 5)",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stopped.returncode == 0, stopped.stderr
    runtime.kill(GangId(13, 1))
    runtime.forget(GangId(13, 1))
    read.clear()
    seen = {(o.job_id, o.phase, o.exit_code) for o in runtime.observe()}
    assert seen == {(11, "running", None), (12, "exited", 0)}
    assert read == ["12-1.json"], "only the rewritten record is read again"


def test_the_exit_watcher_announces_each_gang_once_at_its_end(tmp_path: Path) -> None:
    """Gangs launched before and while it watches, and one whose end a stop brought
    forward, are each announced once, by job, when the reconciler would find them
    exited; a forgotten gang and the passing of time announce nothing more."""
    runtime = MimicRuntime(tmp_path, NODES)
    stop = threading.Event()
    heard: list[dict[int, list[tuple[str, int | None]]]] = []

    def on_exit(job_ids: list[int]) -> None:
        heard.append({job: phases(runtime, GangId(job, 1)) for job in job_ids})

    def announced() -> list[int]:
        return [job for seen in heard for job in seen]

    runtime.launch(spec(1, "sleep 0.2"))
    watcher = threading.Thread(target=runtime.watch_exits, args=(stop, on_exit))
    watcher.start()
    try:
        runtime.launch(spec(2, "sleep 0.4"))
        runtime.launch(spec(3, "sleep 60"))
        wait_until(lambda: sorted(announced()) == [1, 2], "both short gangs announced")
        # A stop ends the long gang now, not in a minute.
        runtime.signal(GangId(3, 1), grace_seconds=30)
        wait_until(lambda: 3 in announced(), "the stopped gang announced")
        runtime.forget(GangId(1, 1))
        runtime.kill(GangId(2, 1))  # after its end: changes nothing
        time.sleep(0.5)  # ten times the watcher's poll
    finally:
        stop.set()
        watcher.join(timeout=10)
    assert not watcher.is_alive()
    assert sorted(announced()) == [1, 2, 3]
    assert all(seen == [("exited", 0)] * 2 for batch in heard for seen in batch.values())


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


def record(**fields: float) -> dict[str, object]:
    """A launched gang's record: 100 s of work, resumed from 20, launched at time 1,000."""
    return {
        "launched_at": 1_000.0,
        "seconds": 80.0,
        "total": 100.0,
        "resumed_from": 20.0,
        "checkpoint_every": None,
        "save_on_stop": None,
        "ranks": [{"rank": 0, "node": "n1"}],
        **fields,
    }


@pytest.mark.parametrize(
    ("fields", "now", "progress"),
    [
        # Still running: 30 s into the attempt; nothing saved since the resume.
        ({}, 1_030.0, GangProgress(20.0, 50.0, 20.0)),
        # Ran its seconds: everything kept, however late it is looked at.
        ({"checkpoint_every": 15.0}, 5_000.0, GangProgress(20.0, 100.0, 100.0)),
        # Asked to stop at 1,030 with a 2-s save: kept at 1,032, and no kill came.
        ({"signal_sent_at": 1_030.0, "save_on_stop": 2.0}, 1_040.0, GangProgress(20, 50, 50)),
        # ... but while the save is being written, only the regular checkpoint counts.
        (
            {"signal_sent_at": 1_030.0, "save_on_stop": 2.0, "checkpoint_every": 15.0},
            1_031.0,
            GangProgress(20.0, 50.0, 45.0),
        ),
        # Killed during the save: back to the last regular checkpoint (at 45 s of work).
        (
            {
                "signal_sent_at": 1_030.0,
                "killed_at": 1_031.0,
                "save_on_stop": 2.0,
                "checkpoint_every": 15.0,
            },
            1_040.0,
            GangProgress(20.0, 50.0, 45.0),
        ),
        # Stopped by a workload that saves nothing on a stop: keeps only what it resumed from
        # when its regular checkpoints are further apart than its progress since.
        (
            {"signal_sent_at": 1_010.0, "checkpoint_every": 40.0},
            1_040.0,
            GangProgress(20.0, 30.0, 20.0),
        ),
        # Killed outright with no checkpoints: everything since the resume is lost.
        ({"killed_at": 1_025.0}, 1_040.0, GangProgress(20.0, 45.0, 20.0)),
    ],
)
def test_progress_kept_follows_the_checkpoints_the_workload_made(
    fields: dict[str, float], now: float, progress: GangProgress
) -> None:
    assert gang_progress(record(**fields), now) == progress


def test_a_workload_that_saves_on_a_stop_exits_zero_after_its_save_and_resumes_there(
    tmp_path: Path,
) -> None:
    runtime = MimicRuntime(tmp_path, NODES)
    saves = {"MIMIC_SAVE_ON_STOP": "0.3", "MIMIC_CHECKPOINT_EVERY": "100"}
    runtime.launch(spec(11, "sleep 60", env=saves))
    time.sleep(0.2)
    runtime.signal(GangId(11, 1), grace_seconds=5)
    # Saving: the ranks are still there, and a kill now would lose the save.
    assert phases(runtime, GangId(11, 1)) == [("running", None)] * 2
    time.sleep(0.4)
    assert phases(runtime, GangId(11, 1)) == [("exited", 0)] * 2
    runtime.kill(GangId(11, 1))
    assert phases(runtime, GangId(11, 1)) == [("exited", 0)] * 2
    runtime.forget(GangId(11, 1))

    first = read_live_or_forgotten(tmp_path, 11, 1)
    kept = gang_progress(first, time.time())
    assert kept.lost == 0 and kept.kept == pytest.approx(0.2, abs=0.1)
    runtime.launch(spec(11, "sleep 60", attempt=2, env=saves))
    second = read_live_or_forgotten(tmp_path, 11, 2)
    assert second["resumed_from"] == kept.kept
    assert second["seconds"] == 60 - kept.kept


def test_a_kill_during_the_save_keeps_the_last_regular_checkpoint(tmp_path: Path) -> None:
    runtime = MimicRuntime(tmp_path, NODES)
    env = {"MIMIC_SAVE_ON_STOP": "30", "MIMIC_CHECKPOINT_EVERY": "0.2"}
    runtime.launch(spec(12, "sleep 60", env=env))
    time.sleep(0.5)
    runtime.signal(GangId(12, 1), grace_seconds=5)
    runtime.kill(GangId(12, 1))
    assert phases(runtime, GangId(12, 1)) == [("exited", KILLED_EXIT_CODE)] * 2
    progress = gang_progress(read_live_or_forgotten(tmp_path, 12, 1), time.time())
    assert progress.reached == pytest.approx(0.5, abs=0.1)
    assert progress.kept == pytest.approx(0.2 * (progress.reached // 0.2))
    # Attempt 2 never launched (it failed before); attempt 3 resumes from attempt 1.
    runtime.launch(spec(12, "sleep 60", attempt=3, env=env))
    assert read_live_or_forgotten(tmp_path, 12, 3)["resumed_from"] == progress.kept


def test_a_workload_without_checkpoints_starts_over(tmp_path: Path) -> None:
    runtime = MimicRuntime(tmp_path, NODES)
    runtime.launch(spec(13, "sleep 60"))
    time.sleep(0.1)
    runtime.signal(GangId(13, 1), grace_seconds=5)
    assert phases(runtime, GangId(13, 1)) == [("exited", 0)] * 2
    progress = gang_progress(read_live_or_forgotten(tmp_path, 13, 1), time.time())
    assert progress.kept == 0 and progress.lost == pytest.approx(0.1, abs=0.1)
    runtime.launch(spec(13, "sleep 60", attempt=2))
    assert read_live_or_forgotten(tmp_path, 13, 2)["seconds"] == 60


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"MIMIC_CHECKPOINT_EVERY": "often"}, "MIMIC_CHECKPOINT_EVERY needs a number of seconds"),
        ({"MIMIC_CHECKPOINT_EVERY": "0"}, "more than 0 seconds"),
        ({"MIMIC_CHECKPOINT_EVERY": "inf"}, "between 0 and"),
        ({"MIMIC_SAVE_ON_STOP": "-1"}, "between 0 and"),
        ({"MIMIC_SAVE_ON_STOP": "nan"}, "between 0 and"),
    ],
)
def test_bad_checkpoint_settings_are_refused(
    tmp_path: Path, env: dict[str, str], reason: str
) -> None:
    runtime = MimicRuntime(tmp_path, NODES)
    with pytest.raises(RuntimePermanentError, match=reason):
        runtime.launch(spec(14, "sleep 1", env=env))
    assert runtime.observe() == []


def read_live_or_forgotten(root: Path, job: int, attempt: int) -> dict[str, object]:
    for folder in ("live", "forgotten"):
        path = root / folder / f"{job}-{attempt}.json"
        if path.exists():
            return json.loads(path.read_text())
    raise AssertionError(f"no record of gang {job}-{attempt}")


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
