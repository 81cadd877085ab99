"""The trap in one process: checkpoint folder rules, fallbacks, signals, settings, events."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import time
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
    events = _events(stream)
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
    events = _events(stream)
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
        assert trap.events.posts_failed == 4 and trap.events.posts_sent == 0
        assert len(_events(stream)) == 4
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
