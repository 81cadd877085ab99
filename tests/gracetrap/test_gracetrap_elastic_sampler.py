"""The elastic sampler's arithmetic: pure logic, no processes."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from gracetrap.sampling import even_world_sizes, micro_steps, permutation

from gracetrap import ElasticSampler, derive_seed, rank_seed, sample_seed, seed_rank_streams


def _run(
    dataset_len: int, global_batch: int, sizes: list[int], micro_batch: int
) -> dict[int, Counter[int]]:
    """Take one global batch per entry of ``sizes`` (the world size of that step),
    handing the position to a fresh sampler whenever the size changes, as a resumed
    job does; return the samples seen per epoch."""
    seen: dict[int, Counter[int]] = {}
    sampler = ElasticSampler(dataset_len, global_batch=global_batch, seed=7)
    previous = sizes[0]
    for world_size in sizes:
        if world_size != previous:
            state = sampler.state_dict()
            sampler = ElasticSampler(dataset_len, global_batch=global_batch, seed=7)
            sampler.load_state_dict(state)
            previous = world_size
        shares = [sampler.peek(rank, world_size, micro_batch) for rank in range(world_size)]
        sampler.take(0, world_size, micro_batch)
        epoch = shares[0].epoch
        for share in shares:
            assert len(share.micro_batches) == len(shares[0].micro_batches)
            assert [i for chunk in share.micro_batches for i in chunk] == list(share.sample_ids)
            seen.setdefault(epoch, Counter()).update(share.sample_ids)
    return seen


# (dataset_len, global_batch, micro_batch, world size of each step); one line per case.
RESIZES = {
    "4 then 2 then 3 then 4": (50, 12, 3, [4, 4, 2, 2, 2, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4]),
    "one rank then eight": (64, 8, 1, [1, 1, 1, 8, 8, 8, 8, 8]),
    "a size per step": (30, 6, 2, [1, 2, 3, 4, 5, 6, 5, 4, 3, 2]),
    "resized in the short last batch": (25, 10, 4, [2, 2, 3, 3, 1, 1]),
}


@pytest.mark.parametrize("case", RESIZES)
def test_every_sample_of_an_epoch_is_seen_once_across_resizes(case: str) -> None:
    dataset_len, global_batch, micro_batch, sizes = RESIZES[case]
    seen = _run(dataset_len, global_batch, sizes, micro_batch)
    steps_per_epoch = -(-dataset_len // global_batch)
    complete_epochs = len(sizes) // steps_per_epoch
    for epoch in range(complete_epochs):
        assert seen[epoch] == Counter(range(dataset_len)), epoch
    # The epoch under way has seen each of its samples at most once.
    assert all(count == 1 for counter in seen.values() for count in counter.values())


def test_a_step_takes_the_same_samples_at_every_world_size() -> None:
    sampler = ElasticSampler(100, global_batch=12, seed=3)
    sampler.take(0, 4, 3)
    expected = sampler.order()[12:24]
    for world_size in range(1, 13):
        union = [i for r in range(world_size) for i in sampler.peek(r, world_size, 2).sample_ids]
        assert sorted(union) == sorted(expected), world_size
        # Striped: rank r holds positions 12 + r, 12 + r + W, ...
        last = world_size - 1
        assert sampler.peek(last, world_size, 2).sample_ids == tuple(expected[last::world_size])


# (global batch, world size, micro-batch) -> micro-steps every rank does.
MICRO_STEPS = [
    (12, 4, 3, 1),  # divides: G / (W * b)
    (12, 2, 3, 2),
    (12, 1, 3, 4),
    (12, 3, 3, 2),  # 4 samples each: a full micro-batch and one of 1
    (13, 4, 1, 4),  # shares of 4, 3, 3, 3: three ranks' last micro-batch is empty
    (2, 4, 3, 1),  # a short last batch: ranks 2 and 3 have nothing this step
    (1, 1, 8, 1),
]


@pytest.mark.parametrize(("global_size", "world_size", "micro_batch", "expected"), MICRO_STEPS)
def test_micro_steps(global_size: int, world_size: int, micro_batch: int, expected: int) -> None:
    assert micro_steps(global_size, world_size, micro_batch) == expected


def test_uneven_shares_still_weigh_each_sample_of_the_global_batch_once() -> None:
    sampler = ElasticSampler(13, global_batch=13, seed=0)
    shares = [sampler.peek(rank, 4, 1) for rank in range(4)]
    assert [len(share.sample_ids) for share in shares] == [4, 3, 3, 3]
    assert [len(share.micro_batches) for share in shares] == [4, 4, 4, 4]
    assert shares[3].micro_batches[-1] == ()
    # Each sample's loss is multiplied by W / G, and DDP divides the sum by W.
    weight = sum(len(share.sample_ids) * share.loss_scale for share in shares) / 4
    assert weight == pytest.approx(1.0)


def test_the_last_batch_of_an_epoch_is_short_and_the_epoch_rolls_over() -> None:
    sampler = ElasticSampler(25, global_batch=10, seed=1)
    assert sampler.steps_per_epoch == 3
    sizes = [sampler.take(0, 2, 5).global_size for _ in range(4)]
    assert sizes == [10, 10, 5, 10]
    assert sampler.state_dict() == {"seed": 1, "dataset_len": 25, "epoch": 1, "consumed": 10}
    assert sampler.peek(0, 2, 5).start == 10


def test_the_permutation_is_pinned_and_differs_by_epoch_and_seed() -> None:
    # Pinned: a checkpoint must resume the same order under every future release.
    assert permutation(10, 0, 0) == [6, 4, 1, 5, 8, 3, 9, 7, 0, 2]
    assert derive_seed(1, 2, 3) == 6711331042091902723
    assert sorted(permutation(1000, 5, 2)) == list(range(1000))
    assert permutation(1000, 5, 2) != permutation(1000, 5, 3)
    assert permutation(1000, 5, 2) != permutation(1000, 6, 2)
    assert derive_seed(1, 2) != derive_seed(2, 1)
    assert all(0 <= derive_seed(n) < 2**63 for n in range(100))
    # The three streams never share a seed by construction (a tag in each hash).
    assert rank_seed(0, 0, 0, 0) != sample_seed(0, 0, 0)


def test_rank_streams_are_a_function_of_seed_epoch_step_and_rank() -> None:
    def draw(seed: int, epoch: int, step: int, rank: int) -> tuple[float, float, float]:
        seed_rank_streams(seed, epoch, step, rank)
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    first = draw(1, 0, 5, 2)
    torch.rand(100)  # whatever ran in between
    assert draw(1, 0, 5, 2) == first
    assert draw(1, 0, 5, 3) != first
    assert draw(1, 0, 6, 2) != first
    assert draw(1, 1, 5, 2) != first


REFUSED_SIZES = {
    "more ranks than samples in a batch": (8, True, 9, 1, "cannot be spread over 9 ranks"),
    "uneven when refused": (
        12,
        False,
        5,
        1,
        "the world sizes that keep it are [1, 2, 3, 4, 6, 12]",
    ),
    "micro-batches uneven when refused": (12, False, 2, 4, "are [1, 3]"),
    "no micro-batch": (12, True, 2, 0, "at least one sample"),
    "no rank": (12, True, 0, 1, "at least 1"),
}


@pytest.mark.parametrize("case", REFUSED_SIZES)
def test_world_sizes_that_cannot_keep_the_global_batch_are_refused(case: str) -> None:
    global_batch, allow_uneven, world_size, micro_batch, words = REFUSED_SIZES[case]
    sampler = ElasticSampler(100, global_batch=global_batch, allow_uneven=allow_uneven)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        sampler.take(0, world_size, micro_batch)
    assert sampler.state_dict()["consumed"] == 0


def test_even_world_sizes() -> None:
    assert even_world_sizes(12, 1, 12) == [1, 2, 3, 4, 6, 12]
    assert even_world_sizes(12, 2, 8) == [1, 2, 3, 6]


def test_a_position_of_another_dataset_or_seed_is_refused_at_the_first_take(
    capsys: pytest.CaptureFixture[str],
) -> None:
    saved = ElasticSampler(50, global_batch=10, seed=1)
    saved.take(0, 2, 5)
    state = saved.state_dict()
    cases = [
        (ElasticSampler(50, global_batch=10, seed=2), state, "seed=1, this sampler has seed=2"),
        (
            ElasticSampler(60, global_batch=10, seed=1),
            state,
            "dataset_len=50, this sampler has dataset_len=60",
        ),
        (
            ElasticSampler(50, global_batch=10, seed=1),
            {key: value for key, value in state.items() if key != "consumed"},
            "consumed missing",
        ),
        (ElasticSampler(50, global_batch=10, seed=1), {**state, "consumed": 50}, "outside"),
    ]
    for sampler, loaded, words in cases:
        # Loading says so but does not raise: the trap would pass over the checkpoint.
        sampler.load_state_dict(loaded)
        assert words in capsys.readouterr().err
        for use in (sampler.take, sampler.peek, sampler.batch_sampler):
            with pytest.raises(ValueError, match=words):
                use(0, 2, 5)
        assert sampler.state_dict()["consumed"] == 0
    # Another global batch is allowed: the position is a sample index, not a step.
    other = ElasticSampler(50, global_batch=5, seed=1)
    other.load_state_dict(state)
    assert other.peek(0, 1, 5).sample_ids == tuple(saved.order()[10:15])


def test_the_batch_sampler_holds_the_micro_batches_take_hands_out_and_moves_nothing() -> None:
    sampler = ElasticSampler(13, global_batch=5, seed=2)
    sampler.take(0, 2, 2)
    state = sampler.state_dict()
    for rank in range(4):
        planned = sampler.batch_sampler(rank, 4, 1)
        assert sampler.state_dict() == state
        probe = ElasticSampler(13, global_batch=5, seed=2)
        probe.load_state_dict(state)
        taken = []
        while probe.epoch == state["epoch"]:
            taken += [list(chunk) for chunk in probe.take(rank, 4, 1).micro_batches if chunk]
        assert planned == taken, rank
    # Steps 1 and 2 of the epoch: 5 + 3 samples over 4 ranks; rank 3 has one sample in
    # the first and an empty micro-batch in the second, which the loader never sees.
    assert [len(b) for b in sampler.batch_sampler(0, 4, 1)] == [1, 1, 1]
    assert [len(b) for b in sampler.batch_sampler(3, 4, 1)] == [1]
