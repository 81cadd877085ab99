"""The elastic drill's exact check on the ranks' printed lines: a resize that kept every
step's global batch passes, one that skipped, repeated or moved a sample does not, and
the final loss is held to the stated tolerance. Real runs of the training script are in
tests/gracetrap/test_gracetrap_elastic.py and the drill's own test."""

from __future__ import annotations

from drills.elastic_samples import LOSS_RELATIVE_TOLERANCE, TrainingRecord, compare_samples

# Two epochs of 8 samples, a global batch of 4: 2 steps an epoch, 4 steps.
ORDER = [[3, 0, 6, 5], [1, 7, 2, 4], [6, 2, 0, 7], [4, 1, 5, 3]]


def _logs(steps: range, world: int, *, order: list[list[int]] = ORDER) -> list[str]:
    """The lines each of `world` ranks prints for `steps`, as train_elastic.py prints them."""
    logs = [""] * world
    for step in steps:
        epoch = step // 2
        batch = order[step]
        share = len(batch) // world
        for rank in range(world):
            ids = batch[rank * share : (rank + 1) * share]
            logs[rank] += (
                f"SAMPLES {step} EPOCH {epoch} WORLD {world} IDS {','.join(map(str, ids))}\n"
                f"STEP {step} RANK {rank} LOSS 0.5 HEX {(0.5).hex()}\n"
            )
    return logs


def _final(logs: list[str], loss: float, params: float) -> list[str]:
    return [logs[0] + f"FINAL LOSS {loss.hex()} PARAMS {params.hex()}\n", *logs[1:]]


def _reference() -> TrainingRecord:
    record = TrainingRecord()
    record.add_attempt(_final(_logs(range(4), 4), 0.25, 10.0))
    return record


def test_a_run_shrunk_and_grown_at_agreed_steps_is_exact() -> None:
    resized = TrainingRecord()
    resized.add_attempt(_logs(range(0, 1), 4))
    resized.add_attempt(_logs(range(1, 3), 2))
    resized.add_attempt(_final(_logs(range(3, 4), 4), 0.25 * (1 + 1e-7), 10.0))

    check = compare_samples(resized, _reference())

    assert check.exact and check.loss_within_tolerance
    assert (check.samples_seen, check.samples_expected) == (16, 16)
    assert check.world_sizes == (2, 4)
    assert check.steps_differing == check.steps_repeated == ()


def test_a_step_run_again_after_a_resize_is_not_exact() -> None:
    resized = TrainingRecord()
    resized.add_attempt(_logs(range(0, 2), 4))
    # The next attempt resumed one step too early: step 1 ran twice.
    resized.add_attempt(_final(_logs(range(1, 4), 2), 0.25, 10.0))

    check = compare_samples(resized, _reference())

    assert not check.exact
    assert check.steps_repeated == (1,)
    assert check.steps_differing == (1,)
    assert check.samples_seen == 20


def test_a_sample_skipped_and_another_repeated_is_not_exact() -> None:
    moved = [list(batch) for batch in ORDER]
    moved[2] = [6, 2, 0, 6]  # sample 7 skipped in epoch 1, sample 6 seen twice
    resized = TrainingRecord()
    resized.add_attempt(_final(_logs(range(4), 4, order=moved), 0.25, 10.0))

    check = compare_samples(resized, _reference())

    assert not check.exact and not check.epochs_identical
    assert check.steps_differing == (2,)
    assert check.samples_seen == check.samples_expected


def test_a_missing_step_is_not_exact() -> None:
    resized = TrainingRecord()
    resized.add_attempt(_final(_logs(range(3), 4), 0.25, 10.0))

    check = compare_samples(resized, _reference())

    assert not check.exact
    assert check.steps_differing == (3,)


def test_the_final_loss_is_held_to_the_stated_tolerance() -> None:
    for relative, within in (
        (LOSS_RELATIVE_TOLERANCE / 2, True),
        (LOSS_RELATIVE_TOLERANCE * 2, False),
    ):
        resized = TrainingRecord()
        resized.add_attempt(_final(_logs(range(4), 4), 0.25 * (1 + relative), 10.0))
        assert compare_samples(resized, _reference()).loss_within_tolerance is within, relative
    # A run that never printed its final loss is not within any tolerance.
    unfinished = TrainingRecord()
    unfinished.add_attempt(_logs(range(4), 4))
    assert not compare_samples(unfinished, _reference()).loss_within_tolerance
