"""The trap in one process: checkpoint folder rules, fallbacks, signals, settings, events."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from gracetrap.checkpoints import prune, write_pointer

from gracetrap import Trap, complete_checkpoints, list_checkpoints, parse_event_line, read_pointer


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _events(stream: io.StringIO) -> list[dict[str, object]]:
    parsed = [parse_event_line(line) for line in stream.getvalue().splitlines()]
    return [event for event in parsed if event is not None]


def _trap(directory: Path, **kwargs: Any) -> tuple[Trap, io.StringIO, torch.nn.Module]:
    model, optimizer = _model_and_optimizer()
    stream = io.StringIO()
    trap = Trap(directory, {"model": model, "optimizer": optimizer}, stream=stream, **kwargs)
    return trap, stream, model


def test_keeps_the_last_k_checkpoints_and_points_latest_at_the_newest(tmp_path: Path) -> None:
    trap, stream, _ = _trap(tmp_path, keep=2)
    with trap:
        for step in range(5):
            trap.save(step)
    assert [info.step for info in list_checkpoints(tmp_path)] == [4, 3]
    pointer = read_pointer(tmp_path)
    assert pointer is not None and pointer["step"] == 4 and pointer["path"] == "step_4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_3", "step_4"]
    committed = [e for e in _events(stream) if e["event"] == "checkpoint_committed"]
    assert [e["step"] for e in committed] == [0, 1, 2, 3, 4]
    assert all(isinstance(e["bytes"], int) and e["bytes"] > 0 for e in committed)


def test_prune_drops_stale_remnants_but_not_a_newer_save_in_progress(tmp_path: Path) -> None:
    for step, complete in [(1, True), (2, False), (3, True), (5, False)]:
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "__0_0.distcp").write_bytes(b"x")
        if complete:
            (tmp_path / f"step_{step}" / ".metadata").write_bytes(b"m")
    (tmp_path / ".discard-step_0-1-2").mkdir()
    (tmp_path / ".latest.tmp-999999").write_text("{}")
    write_pointer(tmp_path, step=3, seconds=0.5, nbytes=2, world_size=1)
    assert prune(tmp_path, keep=1) == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_3", "step_5"]


def test_resume_skips_incomplete_and_unloadable_checkpoints(tmp_path: Path) -> None:
    trap, _, model = _trap(tmp_path)
    with trap:
        trap.save(10)
        saved = [p.detach().clone() for p in model.parameters()]
        trap.save(20)
        trap.save(30)
    # step_30 loses its data (metadata still there), step_40 never got its metadata.
    for data in (tmp_path / "step_30").glob("*.distcp"):
        data.write_bytes(b"")
    (tmp_path / "step_40").mkdir()
    (tmp_path / "step_40" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / "step_20" / ".metadata").unlink()

    fresh, stream, fresh_model = _trap(tmp_path)
    with fresh:
        assert fresh.resume() == 11
    assert [e["step"] for e in _events(stream) if e["event"] == "resumed"] == [11]
    for restored, expected in zip(fresh_model.parameters(), saved, strict=True):
        assert torch.equal(restored, expected)
    assert [info.step for info in complete_checkpoints(tmp_path)] == [30, 10]


def test_save_replaces_a_remnant_and_never_rewrites_a_complete_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "step_7").mkdir()
    (tmp_path / "step_7" / "__0_0.distcp").write_bytes(b"remnant of a killed save")
    trap, stream, _ = _trap(tmp_path)
    with trap:
        assert trap.save(7) is not None
        first = (tmp_path / "step_7" / ".metadata").stat().st_mtime_ns
        assert trap.save(7) is None
    assert (tmp_path / "step_7" / ".metadata").stat().st_mtime_ns == first
    skipped = [e for e in _events(stream) if e["event"] == "checkpoint_skipped"]
    assert [e["reason"] for e in skipped] == ["step 7 is already checkpointed"]


def test_signal_sets_a_flag_and_the_event_carries_the_handler_time(tmp_path: Path) -> None:
    trap, stream, _ = _trap(tmp_path, signals=(signal.SIGUSR1,))
    with trap:
        assert not trap.should_stop(0)
        before = time.time()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        after = time.time()
        assert trap.should_stop(1)
        assert trap.should_stop(2)
    ready, *events = _events(stream)
    assert ready["event"] == "trap_ready" and ready["notice_signal"] == "SIGUSR2"
    assert [e["event"] for e in events] == ["signal_received"]
    assert isinstance(events[0]["at"], float) and before <= events[0]["at"] <= after - 0.04
    # Closing the trap puts the previous handler back.
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_save_and_exit_skips_when_the_grace_left_is_shorter_than_a_save(tmp_path: Path) -> None:
    trap, stream, _ = _trap(
        tmp_path,
        grace_seconds=1.0,
        exit_code=7,
        expected_save_seconds=5.0,
        signals=(signal.SIGUSR1,),
    )
    with trap:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert trap.should_stop(3)
        with pytest.raises(SystemExit) as exited:
            trap.save_and_exit(3)
    assert exited.value.code == 7
    assert list_checkpoints(tmp_path) == []
    events = _events(stream)[1:]
    assert [e["event"] for e in events] == ["signal_received", "checkpoint_skipped", "exiting"]
    assert "a save takes about 5.000 s" in str(events[1]["reason"])
    assert events[2]["code"] == 7


def test_the_environment_supplies_defaults_and_arguments_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QM_CHECKPOINT_DIR", str(tmp_path / "from-env"))
    monkeypatch.setenv("QM_GRACE_SECONDS", "45")
    monkeypatch.setenv("QM_JOB_ID", "17")
    monkeypatch.setenv("QM_ATTEMPT", "3")
    monkeypatch.setenv("QM_EVENTS_URL", "http://127.0.0.1:9/api/v1/jobs/17/events/")
    monkeypatch.setenv("QM_EVENTS_TOKEN", "token-from-env")
    with Trap(signals=()) as from_env:
        assert from_env.checkpoint_dir == tmp_path / "from-env"
        assert from_env.grace_seconds == 45.0
        assert (from_env.events.job_id, from_env.events.attempt) == (17, 3)
        assert from_env.events.events_token == "token-from-env"
    with Trap(tmp_path / "mine", grace_seconds=5, events_url="", signals=()) as explicit:
        assert explicit.checkpoint_dir == tmp_path / "mine"
        assert explicit.grace_seconds == 5
        assert explicit.events.events_url is None
    monkeypatch.setenv("QM_GRACE_SECONDS", "soon")
    with pytest.raises(ValueError, match="QM_GRACE_SECONDS"):
        Trap(signals=())


def test_an_unreachable_portal_never_slows_or_breaks_training(tmp_path: Path) -> None:
    # A port that accepts connections but never answers: the worst case for a POST.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    url = f"http://127.0.0.1:{silent.getsockname()[1]}/api/v1/jobs/1/events/"
    try:
        trap, stream, _ = _trap(tmp_path, events_url=url, events_token="t")
        with trap:
            started = time.monotonic()
            trap.save(0)
            trap.save(1)
            assert time.monotonic() - started < 1.5
            trap.events.flush(timeout=3.0)
        # trap_ready, then started and committed for each save.
        assert trap.events.posts_failed == 5 and trap.events.posts_sent == 0
        assert len(_events(stream)) == 5
    finally:
        silent.close()


def test_registering_an_object_without_state_dict_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="state_dict"):
        Trap(tmp_path, {"epoch": 3}, signals=())
    model, _ = _model_and_optimizer()
    other, optimizer = _model_and_optimizer()
    with pytest.raises(ValueError, match="model that owns"):
        Trap(tmp_path, {"model": model, "optimizer": optimizer}, signals=())
    del other


def test_events_are_json_lines_with_the_protocol_fields() -> None:
    stream = io.StringIO()
    trap = Trap(None, stream=stream, job_id=5, attempt=2, signals=())
    ready = json.loads(stream.getvalue().split(" ", 1)[1])
    assert ready == {
        "event": "trap_ready",
        "job_id": 5,
        "attempt": 2,
        "rank": 0,
        "at": ready["at"],
        "protocol": 1,
        "notice_signal": "SIGUSR2",
        "notice_poll": False,
        "async_saves": False,
        "mtbp_seconds": None,
    }
    stream.seek(0)
    stream.truncate()
    trap.events.emit("exiting", code=0)
    line = stream.getvalue()
    assert line.startswith("QM_EVENT {") and line.endswith("}\n")
    assert json.loads(line.split(" ", 1)[1]).keys() == {
        "event",
        "job_id",
        "attempt",
        "rank",
        "at",
        "code",
    }
    assert trap.resume() == 0


class _SignalsWhileSaved:
    """A registered object that delivers a real SIGUSR1 while the trap is saving it."""

    def __init__(self) -> None:
        self.saves = 0

    def state_dict(self) -> dict[str, Any]:
        self.saves += 1
        if self.saves == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        return {"saves": torch.tensor(self.saves)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.saves = int(state_dict["saves"])


def test_a_signal_during_a_save_is_remembered(tmp_path: Path) -> None:
    sender = _SignalsWhileSaved()
    stream = io.StringIO()
    with Trap(tmp_path, {"sender": sender}, signals=(signal.SIGUSR1,), stream=stream) as trap:
        trap.save(0)
        assert not trap.should_stop(1)
        trap.save(1)
        assert sender.saves == 2
        assert trap.should_stop(2)
    names = [e["event"] for e in _events(stream)]
    assert names.count("checkpoint_committed") == 2 and "signal_received" in names
    assert [info.step for info in complete_checkpoints(tmp_path)] == [1, 0]


class _SlowToWrite:
    """A state entry whose serialisation takes ``seconds``: a write that is still running.

    It is written as the plain mapping {"written": 7}, which the trap's weights-only
    loader accepts (a pickled call of ``int`` would be refused); staging keeps the
    object itself, so only the background write pays the delay.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __deepcopy__(self, memo: dict[int, Any]) -> _SlowToWrite:
        return self

    def __reduce__(self) -> tuple[type[OrderedDict[str, int]], tuple[list[tuple[str, int]]]]:
        time.sleep(self.seconds)
        return (OrderedDict, ([("written", 7)],))


class _SlowState:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.loaded: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {"slow": _SlowToWrite(self.seconds)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict["slow"]


def test_a_background_save_returns_at_once_and_commits_the_state_of_its_step(
    tmp_path: Path,
) -> None:
    model, optimizer = _model_and_optimizer()
    slow = _SlowState(3.0)
    stream = io.StringIO()
    state = {"model": model, "optimizer": optimizer, "slow": slow}
    with Trap(tmp_path, state, stream=stream, async_saves=True, signals=()) as trap:
        _train(model, optimizer)
        trap.save(0, background=False)
        _train(model, optimizer)
        snapshot = {name: value.clone() for name, value in model.state_dict().items()}
        started = time.monotonic()
        info = trap.save(1)
        stall = time.monotonic() - started
        assert info is not None and not info.complete
        # The write takes 3 s; the save returned long before (with room for a busy CPU).
        assert stall < 2.0, f"the save stalled training for {stall:.3f} s"
        # Training changes the parameters while the write runs; the checkpoint must not.
        _train(model, optimizer)
        assert trap.save_in_flight
        assert read_pointer(tmp_path)["step"] == 0  # type: ignore[index]
        assert not trap.should_stop(2)
        assert trap.wait_for_save(timeout=30)
        assert read_pointer(tmp_path)["step"] == 1  # type: ignore[index]
    committed = [e for e in _events(stream) if e["event"] == "checkpoint_committed"]
    assert [(e["step"], e["background"]) for e in committed] == [(0, False), (1, True)]
    assert committed[1]["seconds"] >= 3.0 > 2.0 > committed[1]["stall"]

    fresh, fresh_optimizer = _model_and_optimizer()
    restored = _SlowState(0.0)
    with Trap(
        tmp_path, {"model": fresh, "optimizer": fresh_optimizer, "slow": restored}, signals=()
    ) as resumed:
        assert resumed.resume() == 2
    assert restored.loaded == {"written": 7}
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, snapshot[name]), name


def test_a_new_save_waits_for_the_previous_background_save(tmp_path: Path) -> None:
    stream = io.StringIO()
    with Trap(tmp_path, {"slow": _SlowState(0.5)}, stream=stream, async_saves=True) as trap:
        trap.save(0)
        started = time.monotonic()
        trap.save(1)
        waited = time.monotonic() - started
        assert trap.wait_for_save()
    assert waited >= 0.3
    names = [e["event"] for e in _events(stream)][1:]
    assert names == [
        "checkpoint_started",
        "checkpoint_committed",
        "checkpoint_started",
        "checkpoint_committed",
    ]
    assert [info.step for info in complete_checkpoints(tmp_path)] == [1, 0]


def test_a_stop_during_a_background_write_finishes_it_then_saves_the_last_steps(
    tmp_path: Path,
) -> None:
    stream = io.StringIO()
    with Trap(
        tmp_path,
        {"slow": _SlowState(1.0)},
        stream=stream,
        async_saves=True,
        grace_seconds=60,
        signals=(signal.SIGUSR1,),
    ) as trap:
        trap.save(4)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert trap.should_stop(5)
        with pytest.raises(SystemExit) as exited:
            trap.save_and_exit(5)
    assert exited.value.code == 0
    events = [(e["event"], e.get("step"), e.get("background")) for e in _events(stream)]
    assert events[1:] == [
        ("checkpoint_started", 4, None),
        ("signal_received", None, None),
        ("checkpoint_committed", 4, True),
        ("checkpoint_started", 5, None),
        ("checkpoint_committed", 5, False),
        ("exiting", None, None),
    ]
    assert read_pointer(tmp_path)["step"] == 5  # type: ignore[index]


_OUTLASTS_THE_GRACE = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[2])
from test_gracetrap_single_process import _SlowState
from gracetrap import Trap
state = _SlowState(0.0)
trap = Trap(sys.argv[1], {"slow": state}, async_saves=True, grace_seconds=1.5, exit_code=3)
trap.save(0)
trap.wait_for_save()
state.seconds = 30.0
trap.save(1)
started = time.monotonic()
os.kill(os.getpid(), signal.SIGTERM)
assert trap.should_stop(2)
try:
    trap.save_and_exit(2)
finally:
    print("NOT REACHED", time.monotonic() - started, flush=True)
"""


def test_a_background_write_that_outlasts_the_grace_leaves_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", _OUTLASTS_THE_GRACE, str(tmp_path), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    took = time.monotonic() - started
    assert result.returncode == 3, result.stderr
    assert "NOT REACHED" not in result.stdout
    events = [parse_event_line(line) for line in result.stdout.splitlines()]
    names = [(e["event"], e.get("step")) for e in events if e is not None]
    assert names[-3:] == [("signal_received", None), ("checkpoint_skipped", 2), ("exiting", None)]
    skipped = next(e for e in events if e is not None and e["event"] == "checkpoint_skipped")
    assert "background save of step 1 did not finish within the grace window" in skipped["reason"]
    # It left within the window instead of waiting 30 s for the write.
    assert took < 25, took
    assert read_pointer(tmp_path)["step"] == 0  # type: ignore[index]
    assert [(i.step, i.complete) for i in list_checkpoints(tmp_path)] == [(1, False), (0, True)]
    with Trap(tmp_path, {"slow": _SlowState(0.0)}, signals=()) as trap:
        assert trap.resume() == 1


def test_a_notice_checkpoints_once_and_a_stop_with_no_step_since_saves_nothing(
    tmp_path: Path,
) -> None:
    before = signal.getsignal(signal.SIGUSR2)
    trap, stream, model = _trap(tmp_path, signals=(signal.SIGUSR1,), exit_code=4)
    with trap:
        assert signal.getsignal(signal.SIGUSR2) == trap._on_notice
        assert not trap.should_stop(2)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert not trap.should_stop(3)
        # The scheduler sends the notice to each rank; a copy within a second is the same one.
        os.kill(os.getpid(), signal.SIGUSR2)
        assert not trap.should_stop(4)
        assert [info.step for info in complete_checkpoints(tmp_path)] == [3]
        os.kill(os.getpid(), signal.SIGUSR1)
        assert trap.should_stop(3)
        with pytest.raises(SystemExit) as exited:
            trap.save_and_exit(3)
    assert exited.value.code == 4
    assert signal.getsignal(signal.SIGUSR2) is before
    events = _events(stream)
    names = [(e["event"], e.get("step")) for e in events]
    assert names == [
        ("trap_ready", None),
        ("notice_received", None),
        ("checkpoint_started", 3),
        ("checkpoint_committed", 3),
        ("signal_received", None),
        ("checkpoint_skipped", 3),
        ("exiting", None),
    ]
    assert events[3]["notice"] is True and events[3]["background"] is False
    assert "already checkpointed" in str(events[5]["reason"])
    assert [info.step for info in complete_checkpoints(tmp_path)] == [3]
    del model


def test_the_notice_can_be_moved_or_turned_off_and_never_doubles_as_a_stop_signal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QM_NOTICE_SIGNAL", "off")
    before = signal.getsignal(signal.SIGUSR2)
    stream = io.StringIO()
    with Trap(tmp_path, stream=stream, signals=()) as off:
        assert off.notice_signal is None
        assert signal.getsignal(signal.SIGUSR2) is before
    assert _events(stream)[0]["notice_signal"] is None
    monkeypatch.setenv("QM_NOTICE_SIGNAL", "SIGHUP")
    with Trap(tmp_path, signals=()) as moved:
        assert moved.notice_signal == signal.SIGHUP
    monkeypatch.setenv("QM_NOTICE_SIGNAL", "SIGTERM")
    with pytest.raises(ValueError, match="both the checkpoint notice and a stop signal"):
        Trap(tmp_path)
    monkeypatch.setenv("QM_NOTICE_SIGNAL", "SIGBOGUS")
    with pytest.raises(ValueError, match="QM_NOTICE_SIGNAL"):
        Trap(tmp_path, signals=())


def test_the_cadence_follows_the_hint_and_the_measured_cost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hint = tmp_path / "mtbp"
    monkeypatch.setenv("QM_PREEMPTION_MTBP_FILE", str(hint))
    trap, stream, _ = _trap(tmp_path / "checkpoints", signals=())
    with trap:
        # No hint: no regular checkpoints.
        assert trap.checkpoint_interval() is None and not trap.should_checkpoint(0)
        hint.write_text("3600")
        # Cost not measured yet: checkpoint now, which measures it.
        assert trap.should_checkpoint(1)
        trap.save(1)
        cost = trap.checkpoint_cost()
        assert cost > 0
        assert trap.checkpoint_interval() == pytest.approx((2 * cost * 3600) ** 0.5)
        assert not trap.should_checkpoint(2)
        replacement = tmp_path / "mtbp.new"
        replacement.write_text(f"{1e-4 / cost}")
        os.replace(replacement, hint)
        # sqrt(2 * cost * 1e-4 / cost) = 0.014 s: due again almost at once.
        time.sleep(0.05)
        assert trap.should_checkpoint(3)
    # The chosen interval is reported when the hint is first read, once the first save
    # measured the cost, and when the hint changes.
    cadence = [e for e in _events(stream) if e["event"] == "cadence"]
    assert [e["mtbp_seconds"] for e in cadence] == [3600.0, 3600.0, pytest.approx(1e-4 / cost)]
    assert cadence[0]["interval_seconds"] == 0.0
    assert cadence[1]["interval_seconds"] == pytest.approx((2 * cost * 3600) ** 0.5, rel=1e-4)
    assert cadence[1]["save_cost"] == pytest.approx(cost, rel=1e-4)
    assert cadence[2]["interval_seconds"] == pytest.approx(0.014142, rel=1e-3)


@pytest.mark.parametrize(("setting", "notice"), [("", "SIGUSR2"), ("SIGHUP", "SIGHUP")])
def test_dataloader_workers_ignore_the_stop_signals_and_the_notice(
    setting: str, notice: str
) -> None:
    code = (
        "import signal\n"
        "from gracetrap import worker_init_fn\n"
        "worker_init_fn(0)\n"
        f"names = ['SIGTERM', 'SIGINT', 'SIGUSR1', {notice!r}]\n"
        "print([signal.getsignal(getattr(signal, n)) is signal.SIG_IGN for n in names])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "QM_NOTICE_SIGNAL": setting},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[True, True, True, True]"
