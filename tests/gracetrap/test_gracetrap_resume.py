"""Resume integrity: a preempted and resumed run equals an uninterrupted one, bit for bit."""

from __future__ import annotations

import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gracetrap_gang import launch

STEPS = 40
# Three ranks: with two, a+b == b+a hides any change in the order of the reduction.
WORLD_SIZE = 3


def _load_dump(path: Path) -> dict[str, Any]:
    dump: dict[str, Any] = torch.load(path, weights_only=False)
    return dump


def _assert_identical(reference: dict[str, Any], resumed: dict[str, Any]) -> None:
    assert reference["loss_hex"] == resumed["loss_hex"]
    assert reference["model"].keys() == resumed["model"].keys()
    for name, tensor in reference["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name
    reference_optimizer, resumed_optimizer = reference["optimizer"], resumed["optimizer"]
    assert reference_optimizer["param_groups"] == resumed_optimizer["param_groups"]
    assert reference_optimizer["state"].keys() == resumed_optimizer["state"].keys()
    for index, moments in reference_optimizer["state"].items():
        assert set(moments) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in moments.items():
            assert torch.equal(value, resumed_optimizer["state"][index][key]), (index, key)
    reference_rng, resumed_rng = reference["rng"], resumed["rng"]
    assert reference_rng["python"] == resumed_rng["python"]
    assert torch.equal(reference_rng["torch"], resumed_rng["torch"])
    for mine, theirs in zip(reference_rng["numpy"], resumed_rng["numpy"], strict=True):
        assert np.array_equal(mine, theirs)


def test_preempted_and_resumed_run_matches_the_uninterrupted_one(tmp_path: Path) -> None:
    common = ["--steps", str(STEPS), "--hidden", "16", "--layers", "2"]
    reference = launch(
        WORLD_SIZE,
        tmp_path / "reference-checkpoints",
        tmp_path / "reference-logs",
        [*common, "--dump", str(tmp_path / "reference-{rank}.pt")],
    )
    try:
        assert reference.wait(timeout=120) == [0] * WORLD_SIZE, reference.tail()
    finally:
        reference.kill()

    chooser = random.Random()
    preempt_after = chooser.randrange(3, STEPS - 10)
    victim = chooser.randrange(WORLD_SIZE)
    print(f"preempting rank {victim} once every rank has done step {preempt_after}")
    checkpoint_dir = tmp_path / "checkpoints"
    first = launch(
        WORLD_SIZE,
        checkpoint_dir,
        tmp_path / "logs",
        [*common, "--step-sleep", "0.03"],
    )
    try:
        first.wait_for_step(preempt_after, timeout=120)
        first.ranks[victim].signal(signal.SIGTERM)
        assert first.wait(timeout=120) == [0] * WORLD_SIZE, first.tail()
    finally:
        first.kill()
    stopped_at = first.ranks[0].steps()[-1][0]
    assert stopped_at < STEPS - 1, "the preemption came too late to test a resume"

    second = launch(
        WORLD_SIZE,
        checkpoint_dir,
        tmp_path / "logs",
        [*common, "--dump", str(tmp_path / "resumed-{rank}.pt")],
        attempt=2,
    )
    try:
        assert second.wait(timeout=120) == [0] * WORLD_SIZE, second.tail()
    finally:
        second.kill()

    for rank in range(WORLD_SIZE):
        resumed_events = [e for e in second.ranks[rank].events() if e["event"] == "resumed"]
        assert [e["step"] for e in resumed_events] == [stopped_at + 1]
        # Every loss, before and after the preemption, equals the uninterrupted run's.
        assert first.ranks[rank].steps() + second.ranks[rank].steps() == (
            reference.ranks[rank].steps()
        )
        _assert_identical(
            _load_dump(tmp_path / f"reference-{rank}.pt"),
            _load_dump(tmp_path / f"resumed-{rank}.pt"),
        )
