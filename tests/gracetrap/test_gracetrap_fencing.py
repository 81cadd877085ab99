"""Fencing: a rank of an older attempt that outlives it can never spoil the job's checkpoints.

When a node loses only its kubelet (docs/real-nodes.md), the job is requeued and a new
attempt trains elsewhere while the old attempt's rank runs on, unseen, on the same
folder. Each attempt claims the folder (its epoch) before it loads anything; a rank of
an older attempt has its commits refused and stops; resume takes the newest commit by
(epoch, step). These tests run real processes: gangs of examples/train_ddp.py and, for
the race between a claim and a commit, tests/gracetrap/gracetrap_fence_worker.py.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from gracetrap.base import FENCED_EXIT_CODE
from gracetrap.checkpoints import (
    FencedError,
    claim_epoch,
    current_epoch,
    fenced_line,
    prune,
    step_dir,
)
from gracetrap_gang import launch

from gracetrap import Trap, complete_checkpoints, list_checkpoints

WORKER = Path(__file__).with_name("gracetrap_fence_worker.py")
STEPS = 80


def _complete(folder: Path, name: str) -> Path:
    (folder / name).mkdir(parents=True)
    (folder / name / "__0_0.distcp").write_bytes(b"x")
    (folder / name / ".metadata").write_bytes(b"m")
    return folder / name


# ------------------------------------------------------------ the folder's rules


def test_the_epoch_only_ever_grows_whatever_order_the_claims_come_in(tmp_path: Path) -> None:
    assert current_epoch(tmp_path / "absent") == 0
    assert claim_epoch(tmp_path, 2) == 2
    # A late rank of attempt 1 claims after attempt 2 did: it learns it is fenced,
    # and the folder stays attempt 2's.
    assert claim_epoch(tmp_path, 1) == 2
    assert claim_epoch(tmp_path, 2) == 2  # the other ranks of attempt 2
    assert current_epoch(tmp_path) == 2
    assert claim_epoch(tmp_path, 3) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-1", "epoch-2", "epoch-3"]
    with pytest.raises(ValueError, match="starts at 1"):
        claim_epoch(tmp_path, 0)


def test_a_newer_attempts_commit_wins_over_any_step_of_an_older_one(tmp_path: Path) -> None:
    _complete(tmp_path, "step_500")  # written before fencing existed: epoch 0
    _complete(tmp_path, "step_300.attempt_1")
    _complete(tmp_path, "step_20.attempt_2")
    (tmp_path / "step_25.attempt_2").mkdir()  # a save of attempt 2 in progress
    (tmp_path / "step_400.attempt_1").mkdir()  # a save of attempt 1 cut off
    assert [(i.epoch, i.step) for i in complete_checkpoints(tmp_path)] == [
        (2, 20),
        (1, 300),
        (0, 500),
    ]
    assert step_dir(tmp_path, 20, 2) == tmp_path / "step_20.attempt_2"
    assert step_dir(tmp_path, 500) == tmp_path / "step_500"
    # Pruning follows the same order: it keeps the newest by (epoch, step), drops the
    # older attempt's leftovers and leaves the newer attempt's save in progress alone.
    prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_20.attempt_2",
        "step_25.attempt_2",
        "step_300.attempt_1",
    ]


def test_the_fenced_line_names_both_attempts_and_survives_a_pickle() -> None:
    error = pickle.loads(pickle.dumps(FencedError(3, 2)))
    assert (error.owner, error.mine) == (3, 2)
    assert str(error) == fenced_line(3, 2)
    assert str(error) == "fenced: attempt 3 of this job owns the checkpoints now; attempt 2 stops"


def test_training_run_by_hand_claims_nothing_and_goes_on_from_the_newest_lineage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("QM_ATTEMPT", raising=False)
    model = torch.nn.Linear(2, 2)
    # A folder never touched by an attempt: the names and the behaviour of before.
    with Trap(tmp_path / "plain", {"model": model}) as trap:
        assert trap.resume() == 0
        trap.save(4)
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["latest", "step_4"]
    # A job's folder copied to run by hand: it continues attempt 2's lineage, and its
    # next run resumes from its own progress, not from the attempt's older commit.
    claim_epoch(tmp_path / "job", 2)
    with Trap(tmp_path / "job", {"model": model}) as trap:
        trap.save(7)
    with Trap(tmp_path / "job", {"model": model}) as trap:
        assert trap.resume() == 8
        trap.save(9)
    assert current_epoch(tmp_path / "job") == 2
    assert [(i.epoch, i.step) for i in list_checkpoints(tmp_path / "job")] == [(2, 9), (2, 7)]


# ------------------------------------------------- real processes: a stale gang


def _load(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(path, weights_only=False)
    return loaded


def _assert_same_state(reference: dict[str, Any], resumed: dict[str, Any]) -> None:
    assert reference["loss_hex"] == resumed["loss_hex"]
    for name, tensor in reference["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name
    for index, moments in reference["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(value, resumed["optimizer"]["state"][index][key]), (index, key)
    assert reference["rng"]["python"] == resumed["rng"]["python"]
    assert torch.equal(reference["rng"]["torch"], resumed["rng"]["torch"])


def test_a_stale_gang_is_refused_and_stops_while_the_new_attempts_resume_bit_exactly(
    tmp_path: Path,
) -> None:
    """Attempt 1 trains on after attempt 2 took over; attempt 3 resumes from attempt 2."""
    common = ["--hidden", "16", "--layers", "2"]
    world = 2
    reference = launch(
        world,
        tmp_path / "reference-checkpoints",
        tmp_path / "reference-logs",
        [*common, "--steps", str(STEPS), "--dump", str(tmp_path / "reference-{rank}.pt")],
    )
    try:
        assert reference.wait(timeout=180) == [0] * world, reference.tail()
    finally:
        reference.kill()

    folder = tmp_path / "checkpoints"
    logs = tmp_path / "logs"
    # Attempt 1 would train far beyond the job's steps: it is the rank nobody stops.
    stale = launch(
        world,
        folder,
        logs,
        [*common, "--steps", "100000", "--save-every", "2", "--step-sleep", "0.5"],
        attempt=1,
    )
    second = None
    try:
        stale.wait_for_event("checkpoint_committed", timeout=120)
        second = launch(
            world, folder, logs, [*common, "--steps", str(STEPS), "--step-sleep", "0.1"], attempt=2
        )
        resumed = second.wait_for_event("resumed", timeout=120)
        resumed_at = resumed[0]["step"]
        assert all(event["step"] == resumed_at for event in resumed)
        assert resumed_at < STEPS - 10, "attempt 2 started too late to train after the claim"
        # The stale gang's next save is refused: it says why and exits, every rank alike.
        assert stale.wait(timeout=60) == [FENCED_EXIT_CODE] * world, stale.tail()
        second.wait_for_step(resumed_at + 3, timeout=120)
        second.ranks[0].signal(signal.SIGTERM)
        assert second.wait(timeout=120) == [0] * world, second.tail()
    finally:
        stale.kill()
        if second is not None:
            second.kill()

    line = fenced_line(2, 1)
    for rank in stale.ranks:
        assert f"gracetrap: {line}" in rank.text(), rank.text()[-2000:]
        events = rank.events()
        committed = [e["step"] for e in events if e["event"] == "checkpoint_committed"]
        # Every commit of attempt 1 is older than the state attempt 2 resumed from.
        assert committed and max(committed) == resumed_at - 1, (committed, resumed_at)
        assert any(e["event"] == "checkpoint_skipped" and e["reason"] == line for e in events)
        assert events[-1]["event"] == "exiting" and events[-1]["code"] == FENCED_EXIT_CODE
        # It trained past its last commit (resumed_at - 1), so its refused commits were
        # of higher steps: at least resumed_at, which a loaded machine may leave it at.
        assert rank.steps()[-1][0] >= resumed_at
    assert not [i for i in complete_checkpoints(folder) if i.epoch == 1 and i.step >= resumed_at]

    stopped_at = second.ranks[0].steps()[-1][0]
    third = launch(
        world,
        folder,
        logs,
        [*common, "--steps", str(STEPS), "--dump", str(tmp_path / "resumed-{rank}.pt")],
        attempt=3,
    )
    try:
        assert third.wait(timeout=180) == [0] * world, third.tail()
    finally:
        third.kill()
    for rank in range(world):
        assert [e["step"] for e in third.ranks[rank].events() if e["event"] == "resumed"] == [
            stopped_at + 1
        ]
        # Attempt 1 up to the claim, attempt 2, attempt 3: the uninterrupted run's losses.
        lineage = (
            stale.ranks[rank].steps()[:resumed_at]
            + second.ranks[rank].steps()
            + third.ranks[rank].steps()
        )
        assert lineage == reference.ranks[rank].steps()
        _assert_same_state(
            _load(tmp_path / f"reference-{rank}.pt"), _load(tmp_path / f"resumed-{rank}.pt")
        )


# ------------------------------------- real processes: a commit against a claim


def _worker(folder: Path, attempt: int, *args: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "QM_JOB_ID": "42",
        "QM_ATTEMPT": str(attempt),
        "QM_CHECKPOINT_DIR": str(folder),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def _wait_for_line(process: subprocess.Popen[str], wanted: str, timeout: float) -> list[str]:
    assert process.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line.rstrip("\n"))
        if line.startswith(wanted):
            return seen
    process.kill()
    raise AssertionError(f"no {wanted!r} line:\n" + "\n".join(seen))


def _finish(process: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str]:
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output


@pytest.mark.parametrize("stale_rank_lives", [True, False], ids=["checks-again", "killed"])
def test_a_stale_commit_renamed_in_just_after_the_claim_is_never_resumed_from(
    tmp_path: Path, stale_rank_lives: bool
) -> None:
    folder = tmp_path / "checkpoints"
    go = tmp_path / "go"
    # What attempt 2 must hand on: its state after step 5, trained without a break.
    reference = _worker(tmp_path / "reference", 1, "--steps", "6", "--dump", str(tmp_path / "r.pt"))
    assert _finish(reference)[0] == 0

    # Attempt 1 commits step 3, then its save of step 9 passes the epoch check and waits.
    hold = ["--steps", "20", "--save-after", "3", "--hold-commit", "9", "--go", str(go)]
    stale = _worker(folder, 1, *hold, *([] if stale_rank_lives else ["--die-after-rename"]))
    try:
        _wait_for_line(stale, "HOLDING", timeout=120)
        # Attempt 2 claims the folder and resumes from step 3.
        trained = tmp_path / "train"
        second = _worker(
            folder, 2, "--steps", "6", "--save-after", "5", "--wait-after-resume", str(trained)
        )
        try:
            _wait_for_line(second, "RESUMED AT 4", timeout=120)
            # Now attempt 1's commit of the higher step lands...
            go.touch()
            code, output = _finish(stale)
            # ... and attempt 2 trains on and commits step 5.
            trained.touch()
            second_code, second_output = _finish(second)
            assert second_code == 0 and "DONE" in second_output, second_output
        finally:
            second.kill()
    finally:
        stale.kill()
    if stale_rank_lives:
        # It looked again right after the rename, took its commit back and stopped.
        assert code == FENCED_EXIT_CODE, output
        assert f"gracetrap: {fenced_line(2, 1)}" in output
        assert "DONE" not in output
        assert not step_dir(folder, 9, 1).exists()
    else:
        # Killed right after the rename: its commit slipped in, complete.
        assert code == 9 and "RENAMED" in output, output
        assert (step_dir(folder, 9, 1) / ".metadata").is_file()

    third = _worker(folder, 3, "--steps", "6", "--dump", str(tmp_path / "third.pt"))
    code, output = _finish(third)
    # Attempt 2's step 5, not attempt 1's step 9: nothing left to train.
    assert code == 0 and "RESUMED AT 6" in output, output
    expected, resumed = _load(tmp_path / "r.pt"), _load(tmp_path / "third.pt")
    for name, tensor in expected["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name
    for index, moments in expected["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(value, resumed["optimizer"]["state"][index][key]), (index, key)
    assert torch.equal(expected["torch_rng"], resumed["torch_rng"])
    assert expected["python_rng"] == resumed["python_rng"]


def test_a_stale_rank_that_never_saves_stops_soon_and_a_late_one_never_trains(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "checkpoints"
    stale = _worker(folder, 1, "--steps", "1000000", "--step-sleep", "0.01")
    try:
        _wait_for_line(stale, "STEP 3 ", timeout=120)
        claim_epoch(folder, 2)
        claimed_at = time.monotonic()
        code, output = _finish(stale, timeout=60)
    finally:
        stale.kill()
    # Rank 0 looks at the folder every few seconds between saves: no GPU burns on.
    assert time.monotonic() - claimed_at < 30
    assert code == FENCED_EXIT_CODE, output
    assert f"gracetrap: {fenced_line(2, 1)}" in output
    assert list_checkpoints(folder) == []

    # A rank of attempt 1 that starts only now is fenced before it loads anything.
    late = _worker(folder, 1, "--steps", "10")
    code, output = _finish(late)
    assert code == FENCED_EXIT_CODE, output
    assert f"gracetrap: {fenced_line(2, 1)}" in output and "RESUMED" not in output
