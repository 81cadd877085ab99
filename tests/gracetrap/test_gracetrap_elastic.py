"""Resume at another world size: real ranks, real SIGTERMs, gloo on CPU.

An uninterrupted 4-rank run of examples/train_elastic.py against the same run
stopped by SIGTERM at 4 ranks and resumed at 2, stopped and resumed at 3 (a size
that divides neither the global batch's micro-batches nor the short last batch
evenly), stopped and resumed at 4 again.
"""

from __future__ import annotations

import math
import signal
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from gracetrap_gang import REPO, Gang, launch

EXAMPLE = REPO / "examples" / "train_elastic.py"
DATASET_LEN = 58  # 4 full global batches of 12 and a short one of 10 per epoch
EPOCHS = 4
ARGS = [
    "--epochs",
    str(EPOCHS),
    "--dataset-len",
    str(DATASET_LEN),
    "--global-batch",
    "12",
    "--micro-batch",
    "3",
    "--hidden",
    "8",
    "--seed",
    "5",
]
# Every resize changes how each step's gradient is summed (which samples a rank adds
# up, then the all-reduce over another number of ranks): float32 sums in another
# order differ in their last bits, and Adam carries such differences on. Measured on
# this run: the final loss 9e-8 apart (relative), the sum of squared parameters 1e-8.
# A single sample skipped and another repeated in one step of the 20 moves them by
# 1e-3 and 6e-3. The bound sits a hundred times above the first and as far below
# the second.
RELATIVE_TOLERANCE = 1e-5


@dataclass
class Run:
    """What the ranks of one or more gangs printed."""

    samples: dict[int, list[tuple[int, int, list[int]]]]  # step -> (epoch, world, ids) per rank
    losses: dict[int, set[str]]  # step -> the loss every rank printed (float.hex)
    final_loss: float
    params: float


def _read(gangs: list[Gang]) -> Run:
    samples: dict[int, list[tuple[int, int, list[int]]]] = {}
    losses: dict[int, set[str]] = {}
    final_loss = params = math.nan
    for gang in gangs:
        for rank in gang.ranks:
            for line in rank.text().splitlines():
                words = line.split()
                if words[:1] == ["SAMPLES"]:
                    ids = [int(i) for i in words[7].split(",")] if len(words) == 8 else []
                    samples.setdefault(int(words[1]), []).append(
                        (int(words[3]), int(words[5]), ids)
                    )
                elif words[:1] == ["STEP"] and len(words) == 8:
                    losses.setdefault(int(words[1]), set()).add(words[7])
                elif words[:2] == ["FINAL", "LOSS"]:
                    final_loss, params = float.fromhex(words[2]), float.fromhex(words[4])
    return Run(samples, losses, final_loss, params)


def _per_epoch(run: Run) -> dict[int, Counter[int]]:
    seen: dict[int, Counter[int]] = {}
    for shares in run.samples.values():
        for epoch, _, ids in shares:
            seen.setdefault(epoch, Counter()).update(ids)
    return seen


def _stop(gang: Gang, after_step: int, victim: int) -> int:
    """SIGTERM one rank once every rank passed ``after_step``; return the agreed stop step."""
    try:
        gang.wait_for_step(after_step, timeout=240)
        gang.ranks[victim].signal(signal.SIGTERM)
        codes = gang.wait(timeout=240)
    finally:
        gang.kill()
    assert codes == [0] * len(gang.ranks), gang.tail()
    last = {rank.steps()[-1][0] for rank in gang.ranks}
    assert len(last) == 1, gang.tail()
    return last.pop()


def test_a_run_resized_4_2_3_4_sees_every_sample_once_and_ends_at_the_same_loss(
    tmp_path: Path,
) -> None:
    steps_per_epoch = math.ceil(DATASET_LEN / 12)
    total_steps = EPOCHS * steps_per_epoch
    reference = launch(4, tmp_path / "reference", tmp_path / "reference-logs", ARGS, script=EXAMPLE)
    try:
        assert reference.wait(timeout=400) == [0] * 4, reference.tail()
    finally:
        reference.kill()

    checkpoints = tmp_path / "elastic"
    logs = tmp_path / "elastic-logs"
    paced = [*ARGS, "--step-sleep", "0.3"]
    gangs: list[Gang] = []
    resumed_at = 0
    stops: list[int] = []
    for attempt, world_size in enumerate([4, 2, 3], start=1):
        # At 2 ranks a DataLoader worker reads ahead of training: what it prefetched
        # past the stop step must not count as consumed.
        workers = ["--workers", "1"] if world_size == 2 else []
        gang = launch(
            world_size, checkpoints, logs, [*paced, *workers], attempt=attempt, script=EXAMPLE
        )
        gangs.append(gang)
        # Each gang does at least two steps: a first one on the state it loaded.
        stop = _stop(gang, after_step=resumed_at + 1, victim=1)
        for rank in gang.ranks:
            events = rank.events()
            if attempt > 1:
                assert [e["step"] for e in events if e["event"] == "resumed"] == [resumed_at]
                sizes = [
                    (e["world_size"], e["saved_world_size"])
                    for e in events
                    if e["event"] == "resumed"
                ]
                assert sizes == [(world_size, len(gangs[-2].ranks))], sizes
            assert [e["step"] for e in events if e["event"] == "checkpoint_committed"] == [stop]
            assert f"RESUMED {resumed_at} WORLD {world_size} " in rank.text()
        assert stop < total_steps - 1, "the gang finished before its stop: pace it slower"
        stops.append(stop)
        resumed_at = stop + 1
    last = launch(4, checkpoints, logs, ARGS, attempt=4, script=EXAMPLE)
    gangs.append(last)
    try:
        assert last.wait(timeout=400) == [0] * 4, last.tail()
    finally:
        last.kill()

    expected = _read([reference])
    elastic = _read(gangs)
    # Exact: each step took the same global batch as the uninterrupted run's, and each
    # epoch every sample exactly once, whatever the world size of the step.
    assert sorted(elastic.samples) == list(range(total_steps))
    for step, shares in elastic.samples.items():
        batch = sorted(i for _, _, ids in shares for i in ids)
        assert batch == sorted(i for _, _, ids in expected.samples[step] for i in ids), step
    sizes = {step: {world for _, world, _ in shares} for step, shares in elastic.samples.items()}
    assert {size for found in sizes.values() for size in found} == {2, 3, 4}
    seen = _per_epoch(elastic)
    assert seen == _per_epoch(expected)
    assert seen == {epoch: Counter(range(DATASET_LEN)) for epoch in range(EPOCHS)}
    assert sum(seen.values(), Counter()).total() == EPOCHS * DATASET_LEN

    # Every rank of a step agrees on its loss; up to the first stop the run is the
    # uninterrupted one (same size, same order), bit for bit.
    assert all(len(found) == 1 for found in elastic.losses.values())
    for step in range(stops[0] + 1):
        assert elastic.losses[step] == expected.losses[step], step
    widest = 0.0
    for step, found in elastic.losses.items():
        (mine,) = found
        (theirs,) = expected.losses[step]
        relative = abs(float.fromhex(mine) - float.fromhex(theirs)) / float.fromhex(theirs)
        assert relative <= RELATIVE_TOLERANCE, (step, mine, theirs)
        widest = max(widest, relative)
    difference = abs(elastic.final_loss - expected.final_loss)
    params_difference = abs(elastic.params - expected.params)
    assert difference <= RELATIVE_TOLERANCE * abs(expected.final_loss), (
        f"final loss {elastic.final_loss!r} against {expected.final_loss!r}"
    )
    assert params_difference <= RELATIVE_TOLERANCE * abs(expected.params), (
        f"sum of squared parameters {elastic.params!r} against {expected.params!r}"
    )
    print(
        f"ELASTIC stops {stops} samples {sum(seen.values(), Counter()).total()} "
        f"final loss {elastic.final_loss!r} reference {expected.final_loss!r} "
        f"difference {difference:.3e} (relative {difference / abs(expected.final_loss):.3e}) "
        f"params relative {params_difference / abs(expected.params):.3e} "
        f"widest step loss relative {widest:.3e}"
    )


def _preempted_run(root: Path, plan: list[tuple[int, int | None]], args: list[str]) -> list[Gang]:
    """One gang per (world size, step it preempts itself after; None: to the end)."""
    gangs = []
    for attempt, (world_size, preempt_at) in enumerate(plan, start=1):
        stop = [] if preempt_at is None else ["--preempt-at", str(preempt_at)]
        gang = launch(
            world_size,
            root / "checkpoints",
            root / "logs",
            [*args, *stop],
            attempt=attempt,
            script=EXAMPLE,
        )
        gangs.append(gang)
        try:
            assert gang.wait(timeout=400) == [0] * world_size, gang.tail()
        finally:
            gang.kill()
        if preempt_at is not None:
            for rank in gang.ranks:
                committed = [
                    e["step"] for e in rank.events() if e["event"] == "checkpoint_committed"
                ]
                assert committed == [preempt_at], gang.tail()
    return gangs


def test_a_resized_run_with_dropout_is_reproduced_bit_for_bit(tmp_path: Path) -> None:
    """The same sizes at the same steps give the same run, bit for bit, with dropout
    drawing from the per-rank streams: also on a rank new to the job (rank 2 at 3
    ranks after 2), which finds no generator state in the checkpoint and draws from
    the streams ``seed_rank_streams`` derives at every step. (That the draws depend
    only on (seed, epoch, step, rank), not on the history of sizes, is checked in
    test_gracetrap_elastic_sampler.py.)"""
    args = [*ARGS[:1], "2", *ARGS[2:], "--dropout", "0.2"]  # 2 epochs, 10 steps
    plan: list[tuple[int, int | None]] = [(4, 2), (2, 6), (3, None)]
    first = _read(_preempted_run(tmp_path / "first", plan, args))
    second_gangs = _preempted_run(tmp_path / "second", plan, args)
    second = _read(second_gangs)
    assert "has no RNG state for rank 2" in second_gangs[2].ranks[2].text()
    assert sorted(first.losses) == list(range(2 * math.ceil(DATASET_LEN / 12)))
    assert first.losses == second.losses
    assert all(len(found) == 1 for found in first.losses.values())
    assert (first.final_loss.hex(), first.params.hex()) == (
        second.final_loss.hex(),
        second.params.hex(),
    )
    assert first.samples == second.samples


def test_a_gang_shrunk_to_one_process_and_grown_back_sees_every_sample_once(
    tmp_path: Path,
) -> None:
    """Down to a single process (no process group, no DDP wrapper: DCP reads the
    gang's checkpoint without one, under the same parameter names) and back to 2."""
    args = [*ARGS[:1], "2", *ARGS[2:]]
    steps = 2 * math.ceil(DATASET_LEN / 12)
    reference = launch(1, tmp_path / "reference", tmp_path / "reference-logs", args, script=EXAMPLE)
    try:
        assert reference.wait(timeout=400) == [0], reference.tail()
    finally:
        reference.kill()
    resized = _read(_preempted_run(tmp_path / "resized", [(2, 3), (1, 6), (2, None)], args))
    expected = _read([reference])

    assert sorted(resized.samples) == list(range(steps))
    for step, shares in resized.samples.items():
        (theirs,) = expected.samples[step]
        assert sorted(i for _, _, ids in shares for i in ids) == sorted(theirs[2]), step
    assert _per_epoch(resized) == {epoch: Counter(range(DATASET_LEN)) for epoch in range(2)}
    for step, found in resized.losses.items():
        (mine,) = found
        (theirs,) = expected.losses[step]
        relative = abs(float.fromhex(mine) - float.fromhex(theirs)) / float.fromhex(theirs)
        assert relative <= RELATIVE_TOLERANCE, (step, mine, theirs)
    assert abs(resized.params - expected.params) <= RELATIVE_TOLERANCE * expected.params


def test_a_resume_with_another_dataset_stops_at_its_first_step_instead_of_starting_over(
    tmp_path: Path,
) -> None:
    """The trap passes over a checkpoint whose objects refuse it, so the sampler refuses
    at its first step: the job stops with the reason rather than training again from
    step 0 on other samples."""
    args = [*ARGS[:1], "2", *ARGS[2:]]
    _preempted_run(tmp_path, [(2, 2)], args)
    longer = [*args[:2], "--dataset-len", "60", *args[4:]]
    resumed = launch(
        1, tmp_path / "checkpoints", tmp_path / "logs", longer, attempt=2, script=EXAMPLE
    )
    try:
        assert resumed.wait(timeout=400) == [1], resumed.tail()
    finally:
        resumed.kill()
    (rank,) = resumed.ranks
    assert [e["step"] for e in rank.events() if e["event"] == "resumed"] == [3]
    assert "ValueError: the checkpoint's data position was saved with dataset_len=58" in rank.text()
    assert "SAMPLES" not in rank.text()
