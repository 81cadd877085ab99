"""The checkpoint notice, background saves and the cadence hint with real gloo ranks."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from gracetrap_gang import Gang, Rank, launch, step_dirs

STEPS = 40
WORLD_SIZE = 2
MODEL = ["--steps", str(STEPS), "--hidden", "512", "--layers", "3"]


def _finish(gang: Gang, timeout: float = 180) -> list[int | None]:
    try:
        return gang.wait(timeout=timeout)
    finally:
        gang.kill()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted run: the losses of every step and the final state of every rank."""
    folder = tmp_path_factory.mktemp("reference")
    gang = launch(
        WORLD_SIZE,
        folder / "checkpoints",
        folder / "logs",
        [*MODEL, "--dump", str(folder / "final-{rank}.pt")],
    )
    assert _finish(gang) == [0] * WORLD_SIZE, gang.tail()
    return {
        "steps": [rank.steps() for rank in gang.ranks],
        "final": [torch.load(folder / f"final-{rank}.pt", weights_only=False) for rank in range(2)],
    }


def _resume_and_compare(
    tmp_path: Path, checkpoint_dir: Path, first: Gang, reference: dict[str, Any]
) -> None:
    """A second attempt resumes from ``latest`` and ends bit-identical to the reference."""
    latest = json.loads((checkpoint_dir / "latest").read_text())
    second = launch(
        WORLD_SIZE,
        checkpoint_dir,
        tmp_path / "logs",
        [*MODEL, "--dump", str(tmp_path / "resumed-{rank}.pt")],
        attempt=2,
    )
    assert _finish(second) == [0] * WORLD_SIZE, second.tail()
    for rank in range(WORLD_SIZE):
        resumed = [e["step"] for e in second.ranks[rank].events() if e["event"] == "resumed"]
        assert resumed == [latest["step"] + 1]
        done_first = [s for s in first.ranks[rank].steps() if s[0] <= latest["step"]]
        assert done_first + second.ranks[rank].steps() == reference["steps"][rank]
        mine = torch.load(tmp_path / f"resumed-{rank}.pt", weights_only=False)
        theirs = reference["final"][rank]
        assert mine["loss_hex"] == theirs["loss_hex"]
        for name, tensor in theirs["model"].items():
            assert torch.equal(tensor, mine["model"][name]), name
        for index, moments in theirs["optimizer"]["state"].items():
            for key, value in moments.items():
                assert torch.equal(value, mine["optimizer"]["state"][index][key]), (index, key)
        assert mine["rng"]["python"] == theirs["rng"]["python"]
        assert torch.equal(mine["rng"]["torch"], theirs["rng"]["torch"])


def _names(events: list[dict[str, Any]]) -> list[str]:
    return [event["event"] for event in events]


def test_notice_commits_while_training_goes_on_and_the_eviction_saves_only_the_rest(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    checkpoint_dir = tmp_path / "checkpoints"
    first = launch(
        WORLD_SIZE,
        checkpoint_dir,
        tmp_path / "logs",
        [*MODEL, "--step-sleep", "0.05"],
        env={"QM_ASYNC_SAVES": "1", "QM_GRACE_SECONDS": "60"},
    )
    try:
        ready = first.wait_for_event("trap_ready", timeout=120)
        assert {(e["notice_signal"], e["async_saves"], e["protocol"]) for e in ready} == {
            ("SIGUSR2", True, 1)
        }
        first.wait_for_step(3, timeout=120)
        # The scheduler's notice: one signal to every rank.
        for rank in first.ranks:
            rank.signal(signal.SIGUSR2)
        committed = first.wait_for_event("checkpoint_committed", timeout=120, notice=True)
        notice_step = committed[0]["step"]
        assert {e["step"] for e in committed} == {notice_step}
        assert all(e["background"] for e in committed)
        # Training went on: nobody stopped, and steps past the notice's step follow.
        first.wait_for_step(notice_step + 3, timeout=120)
        assert all(rank.process.poll() is None for rank in first.ranks)
        assert step_dirs(checkpoint_dir) == {notice_step: True}
        first.ranks[1].signal(signal.SIGTERM)
    finally:
        codes = _finish(first)
    assert codes == [0] * WORLD_SIZE, first.tail()

    stop_step = first.ranks[0].steps()[-1][0]
    assert stop_step >= notice_step + 3
    noticed = 0
    for rank in first.ranks:
        events = rank.events()
        names = _names(events)
        # A rank whose own copy of the notice came after the gang had answered it (a
        # loaded machine) saved with the others and drops that copy unreported.
        own_notice = "notice_received" in names
        noticed += own_notice
        expected = ["trap_ready", *(["notice_received"] if own_notice else [])]
        expected += ["checkpoint_started", "checkpoint_committed"]
        # Rank 1's SIGTERM reaches the others through the gang's relay.
        expected.append("signal_received" if rank.rank == 1 else "stop_heard")
        expected += ["checkpoint_started", "checkpoint_committed", "exiting"]
        assert names == expected, (rank.rank, names)
        if rank.rank != 1:
            heard = events[names.index("stop_heard")]
            assert heard["from_rank"] == 1, heard
            assert heard["at"] >= heard["signalled_at"], heard
        final = events[-2]
        assert (final["step"], final["notice"], final["background"]) == (stop_step, False, False)
    # The notice the gang answered was some rank's own.
    assert noticed >= 1
    assert json.loads((checkpoint_dir / "latest").read_text())["step"] == stop_step
    _resume_and_compare(tmp_path, checkpoint_dir, first, reference)


def _wait_for_a_write_in_flight(rank: Rank, timeout: float = 60) -> None:
    """Return once ``rank``'s log shows a background write started and not committed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        saves = [e for e in rank.events() if e["event"].startswith("checkpoint_")]
        if saves and saves[-1]["event"] == "checkpoint_started":
            return
        time.sleep(0.002)
    raise AssertionError(f"no background write in flight within {timeout} s")


def test_a_sigterm_during_background_writes_finishes_the_write_then_saves(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    # The handler runs only when the main thread is back in Python, which may be after
    # the write it waited for committed: whether the signal came during a write is
    # judged by when the test sent it. A send can still fall into the short gap between
    # two writes, which is why a gang is started again, up to three times.
    for trial in range(3):
        checkpoint_dir = tmp_path / f"trial-{trial}" / "checkpoints"
        # A background save after every step: each waits for the previous one, so a
        # write is in flight almost all the time.
        first = launch(
            WORLD_SIZE,
            checkpoint_dir,
            tmp_path / f"trial-{trial}" / "logs",
            [*MODEL, "--save-every", "1", "--keep", "2"],
            env={"QM_ASYNC_SAVES": "1", "QM_GRACE_SECONDS": "60"},
        )
        try:
            first.wait_for_step(5, timeout=120)
            _wait_for_a_write_in_flight(first.ranks[0])
            sent_at = time.time()
            first.ranks[0].signal(signal.SIGTERM)
        finally:
            codes = _finish(first)
        assert codes == [0] * WORLD_SIZE, first.tail()

        events = first.ranks[0].events()
        committed = {e["step"]: e for e in events if e["event"] == "checkpoint_committed"}
        started = [
            e["step"] for e in events if e["event"] == "checkpoint_started" and e["at"] < sent_at
        ]
        # No write the signal found was dropped: each one committed, in the background.
        assert all(step in committed and committed[step]["background"] for step in started)
        stop_step = first.ranks[0].steps()[-1][0]
        assert _names(events)[-3:] == ["checkpoint_started", "checkpoint_committed", "exiting"]
        assert events[-2]["step"] == stop_step and not events[-2]["background"]
        assert all(step_dirs(checkpoint_dir).values())
        if committed[started[-1]]["at"] > sent_at:
            # The signal came while the write of started[-1] ran; that write committed
            # and the final save followed it.
            _resume_and_compare(tmp_path / f"trial-{trial}", checkpoint_dir, first, reference)
            return
    pytest.fail("three SIGTERMs in a row fell between two background writes")


@pytest.mark.parametrize("notice", ["off", "ignored"])
def test_without_an_answered_notice_the_eviction_is_as_before(tmp_path: Path, notice: str) -> None:
    checkpoint_dir = tmp_path / "checkpoints"
    env = {"QM_GRACE_SECONDS": "60"}
    if notice == "off":
        env["QM_NOTICE_SIGNAL"] = "off"
    gang = launch(
        WORLD_SIZE, checkpoint_dir, tmp_path / "logs", [*MODEL, "--step-sleep", "0.05"], env=env
    )
    try:
        gang.wait_for_step(3, timeout=120)
        for rank in gang.ranks:
            if notice == "ignored":
                # The eviction follows the notice before any step ends: the ranks
                # agree to stop, which wins over the notice.
                rank.signal(signal.SIGUSR2)
            rank.signal(signal.SIGTERM)
    finally:
        codes = _finish(gang)
    assert codes == [0] * WORLD_SIZE, gang.tail()
    stop_step = gang.ranks[0].steps()[-1][0]
    assert step_dirs(checkpoint_dir) == {stop_step: True}
    for rank in gang.ranks:
        events = rank.events()
        expected = ["trap_ready", "signal_received", "checkpoint_started"]
        expected += ["checkpoint_committed", "exiting"]
        if notice == "ignored":
            expected.insert(1, "notice_received")
        # Each rank is signalled, but another rank's signal may reach it first through
        # the gang's relay.
        names = [name for name in _names(events) if name != "stop_heard"]
        assert sorted(names) == sorted(expected), _names(events)
        assert all(e["from_rank"] != rank.rank for e in events if e["event"] == "stop_heard")
        assert events[0]["notice_signal"] == (None if notice == "off" else "SIGUSR2")
        committed = next(e for e in events if e["event"] == "checkpoint_committed")
        assert committed["step"] == stop_step and committed["notice"] is False


def test_a_higher_risk_hint_checkpoints_more_often(tmp_path: Path) -> None:
    hint = tmp_path / "mtbp"
    hint.write_text("1000000")  # a job well inside its guarantee
    checkpoint_dir = tmp_path / "checkpoints"
    gang = launch(
        WORLD_SIZE,
        checkpoint_dir,
        tmp_path / "logs",
        ["--steps", "100000", "--step-sleep", "0.05", "--cadence", "--keep", "100"],
        env={"QM_PREEMPTION_MTBP_FILE": str(hint)},
    )
    try:
        gang.wait_for_step(20, timeout=120)
        calm_until = max(step for step, _ in gang.ranks[0].steps())
        # The scheduler now expects a preemption every second (it is borrowing).
        replacement = tmp_path / "mtbp.new"
        replacement.write_text("1")
        os.replace(replacement, hint)
        gang.wait_for_step(calm_until + 40, timeout=180)
        for rank in gang.ranks:
            rank.signal(signal.SIGTERM)
    finally:
        codes = _finish(gang)
    assert codes == [0] * WORLD_SIZE, gang.tail()
    saved = sorted(
        {e["step"] for e in gang.ranks[0].events() if e["event"] == "checkpoint_committed"}
    )
    # The step printed last before the rewrite may already have read the new hint.
    calm = [step for step in saved if step < calm_until]
    risky = [step for step in saved if step > calm_until]
    # Calm: only the first checkpoint, which measures the cost (sqrt(2 * cost * 1e6) is
    # minutes). Risky: sqrt(2 * cost * 1) is well under a second, i.e. a few steps.
    assert calm == [0], saved
    assert len(risky) >= 3, saved
    # Both ranks checkpointed the same steps.
    assert saved == sorted(
        {e["step"] for e in gang.ranks[1].events() if e["event"] == "checkpoint_committed"}
    )
