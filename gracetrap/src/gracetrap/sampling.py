"""Elastic data position: resume at any world size without skipping or repeating a sample.

A data loader's position is usually kept per rank ("rank 3 has read 1,200 samples of
its shard"), which means nothing once the job comes back with another number of
ranks: the shards are cut differently, so a resumed run either skips samples or sees
some twice. torchtitan and Megatron refuse a data-parallel size change for that reason.

Here the position is one number for the whole job: the **global sample index**, how
many positions of the epoch's permutation the job has consumed. Each optimizer step
consumes one global batch of ``global_batch`` positions, ``[consumed, consumed + G)``,
striped over the ranks: rank ``r`` of ``W`` takes the positions ``consumed + r``,
``consumed + r + W``, ... Whatever ``W`` is, the positions of one step are the same
set, so a job resized between any two steps goes on with exactly the samples that
are left.

The global batch stays the same at every size, through gradient accumulation: each
rank splits its share into micro-batches of at most ``micro_batch`` samples, and all
ranks do the same number of micro-steps, ``ceil(ceil(G / W) / b)`` (``G / (W * b)``
when that divides). When it does not divide, shares differ by one sample and a
rank's last micro-batch may be short or empty; :attr:`RankBatch.loss_scale` weights
each rank's summed loss so that DDP's average over ranks is still the mean over the
``G`` samples, exactly the gradient of the same step at any size. Since the batch
and its gradient do not change, neither does the learning rate.

Random numbers. Whatever a run draws must not depend on which rank happened to draw
it if a resized run is to be reproducible, so nothing continues a rank's stream
across a resize. :func:`seed_rank_streams` seeds the process's generators at each
step from ``(seed, epoch, step, rank)`` (dropout and the like: reproducible for a
given sequence of sizes), and :func:`sample_seed` gives each sample its own stream
from ``(seed, epoch, sample id)`` (augmentation: the same at every size). Both come
from :func:`derive_seed`, a BLAKE2b hash, and the epoch's permutation from Python's
``random.Random.random``, whose sequence for a given seed Python guarantees across
versions: a checkpoint written under one Python resumes the same order under another.

Nothing here needs torch except :func:`seed_rank_streams`, which imports it when called.
"""

from __future__ import annotations

import hashlib
import math
import random
import sys
from dataclasses import dataclass
from typing import Any

# Seeds are kept below 2**63 so that torch.manual_seed takes them as they are.
_SEED_BITS = 63
_STATE_FIELDS = ("seed", "dataset_len", "epoch", "consumed")


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that depends on every one of ``parts`` and on their order.

    It is the first 8 bytes of ``blake2b("gracetrap:" + ",".join(parts))`` (decimal
    integers), big-endian, with the top bit cleared: the same on every machine, in
    every Python and torch release, for as long as the checkpoint lives.
    """
    text = "gracetrap:" + ",".join(str(int(part)) for part in parts)
    digest = hashlib.blake2b(text.encode("ascii"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - _SEED_BITS)


def rank_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    """The seed of rank ``rank``'s streams for optimizer step ``step`` of ``epoch``."""
    return derive_seed(seed, 1, epoch, step, rank)


def sample_seed(seed: int, epoch: int, sample_id: int) -> int:
    """The seed of sample ``sample_id``'s own stream in ``epoch`` (the same at any world size)."""
    return derive_seed(seed, 2, epoch, sample_id)


def seed_rank_streams(seed: int, epoch: int, step: int, rank: int) -> int:
    """Seed Python's ``random``, NumPy's global generator and torch (CPU and every
    CUDA device) from :func:`rank_seed`; returns that seed.

    Call it on every rank before each optimizer step's first draw: a resumed run then
    draws what an uninterrupted run with the same sequence of world sizes drew,
    whatever was restored from the checkpoint. NumPy gets the seed's low 32 bits,
    which is all its legacy seeding takes.
    """
    import torch

    value = rank_seed(seed, epoch, step, rank)
    random.seed(value)
    torch.manual_seed(value)
    try:
        import numpy
    except ImportError:
        return value
    numpy.random.seed(value & 0xFFFF_FFFF)
    return value


def permutation(dataset_len: int, seed: int, epoch: int) -> list[int]:
    """The order of ``range(dataset_len)`` in ``epoch``: a Fisher-Yates shuffle driven
    by ``random.Random(derive_seed(seed, 0, epoch)).random()``.

    ``random()``'s sequence is the part of Python's generator whose reproducibility
    across versions is documented (``shuffle`` and ``randrange`` are not), hence the
    shuffle written out here. It costs about a second per million samples.
    """
    order = list(range(dataset_len))
    draw = random.Random(derive_seed(seed, 0, epoch)).random
    for last in range(dataset_len - 1, 0, -1):
        pick = min(int(draw() * (last + 1)), last)
        order[last], order[pick] = order[pick], order[last]
    return order


def micro_steps(global_size: int, world_size: int, micro_batch: int) -> int:
    """Micro-steps every rank does for a global batch of ``global_size`` samples:
    ``ceil(ceil(global_size / world_size) / micro_batch)``, at least 1."""
    return max(1, math.ceil(math.ceil(global_size / world_size) / micro_batch))


def even_world_sizes(global_batch: int, micro_batch: int, largest: int) -> list[int]:
    """World sizes up to ``largest`` at which every rank does the same whole number of
    full micro-batches of ``micro_batch`` (``world_size * micro_batch`` divides
    ``global_batch``)."""
    return [size for size in range(1, largest + 1) if global_batch % (size * micro_batch) == 0]


@dataclass(frozen=True, slots=True)
class RankBatch:
    """One rank's part of one global batch (one optimizer step).

    ``micro_batches`` has the same length on every rank; a rank's last ones may be
    short or empty when ``world_size * micro_batch`` does not divide the batch. Sum
    the per-sample losses of a micro-batch, multiply by ``loss_scale`` and call
    ``backward()``: DDP divides the summed gradients by the world size, which makes
    them the mean over the ``global_size`` samples of the step.
    """

    epoch: int
    start: int
    global_size: int
    rank: int
    world_size: int
    sample_ids: tuple[int, ...]
    micro_batches: tuple[tuple[int, ...], ...]

    @property
    def loss_scale(self) -> float:
        """``world_size / global_size``: turns a rank's summed loss into its share of
        the global mean, once DDP averages over ranks."""
        return self.world_size / self.global_size


class ElasticSampler:
    """The data position of a job as a global sample index, resumable at any world size.

    Register it in the trap's state (``Trap(state={..., "sampler": sampler})``): its
    ``state_dict()`` is the epoch and the number of positions of that epoch's
    permutation consumed, plus the seed and the dataset's length, which must match on
    load (another seed or length would be another permutation, so the index would
    point at other samples). Every rank holds the same state.

    ``take(rank, world_size, micro_batch)`` hands this rank its part of the next
    global batch and moves the position past the whole batch; call it once per
    optimizer step on every rank, before the step. A checkpoint taken after the step
    then holds the position after it, and a job resumed from it at any size takes the
    next batch.

    The last global batch of an epoch holds what is left (``dataset_len % global_batch``
    samples when that is not 0), so that every sample of every epoch is seen exactly
    once; the epoch then rolls over to a new permutation.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        global_batch: int,
        seed: int = 0,
        epoch: int = 0,
        allow_uneven: bool = True,
    ) -> None:
        if dataset_len < 1:
            raise ValueError(f"an ElasticSampler needs at least one sample, not {dataset_len}")
        if global_batch < 1:
            raise ValueError(f"the global batch must hold at least one sample, not {global_batch}")
        if epoch < 0:
            raise ValueError(f"epochs count from 0, not {epoch}")
        self.dataset_len = dataset_len
        self.global_batch = global_batch
        self.seed = seed
        self.allow_uneven = allow_uneven
        self.epoch = epoch
        self.consumed = 0
        self._order: list[int] | None = None
        self._order_epoch = -1
        # Why the loaded position was refused, raised by the first take (see load_state_dict).
        self._refused: str | None = None

    # ----------------------------------------------------------- arithmetic

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps (global batches) in one epoch, the last one possibly short."""
        return math.ceil(self.dataset_len / self.global_batch)

    def order(self) -> list[int]:
        """This epoch's permutation of the sample ids (cached for the epoch)."""
        if self._order is None or self._order_epoch != self.epoch:
            self._order = permutation(self.dataset_len, self.seed, self.epoch)
            self._order_epoch = self.epoch
        return self._order

    def check_world_size(self, world_size: int, micro_batch: int) -> None:
        """Refuse a world size at which this sampler cannot keep the global batch.

        Every rank must get at least one sample of a full global batch (more ranks than
        samples would leave ranks with nothing to do at every step); with
        ``allow_uneven=False``, ``world_size * micro_batch`` must also divide the
        global batch, so that every micro-batch is full and all ranks are alike.
        """
        if world_size < 1:
            raise ValueError(f"a world size is at least 1, not {world_size}")
        if micro_batch < 1:
            raise ValueError(f"a micro-batch holds at least one sample, not {micro_batch}")
        if world_size > self.global_batch:
            raise ValueError(
                f"a global batch of {self.global_batch} samples cannot be spread over "
                f"{world_size} ranks: {world_size - self.global_batch} of them would have no "
                "sample at any step. Run at most "
                f"{self.global_batch} ranks, or choose a larger global batch"
            )
        if not self.allow_uneven and self.global_batch % (world_size * micro_batch):
            sizes = even_world_sizes(self.global_batch, micro_batch, self.global_batch)
            raise ValueError(
                f"a global batch of {self.global_batch} is not {world_size} ranks times a "
                f"whole number of micro-batches of {micro_batch}; with allow_uneven=False "
                f"the world sizes that keep it are {sizes}"
            )

    def peek(self, rank: int, world_size: int, micro_batch: int) -> RankBatch:
        """This rank's part of the next global batch, without moving the position."""
        self._raise_if_refused()
        self.check_world_size(world_size, micro_batch)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        start = self.consumed
        stop = min(start + self.global_batch, self.dataset_len)
        positions = range(start + rank, stop, world_size)
        order = self.order()
        share = tuple(order[position] for position in positions)
        count = micro_steps(stop - start, world_size, micro_batch)
        chunks = tuple(share[k * micro_batch : (k + 1) * micro_batch] for k in range(count))
        return RankBatch(
            epoch=self.epoch,
            start=start,
            global_size=stop - start,
            rank=rank,
            world_size=world_size,
            sample_ids=share,
            micro_batches=chunks,
        )

    def batch_sampler(self, rank: int, world_size: int, micro_batch: int) -> list[list[int]]:
        """This rank's non-empty micro-batches from the position to the end of the epoch,
        in the order ``take`` hands them out: ``DataLoader(batch_sampler=...)`` for the
        epoch (or for what is left of it after a resume).

        It leaves the position alone, so a loader may read ahead of training (workers,
        prefetching) without moving what the checkpoint saves; the training loop still
        calls ``take`` once per step and pulls one loader batch per non-empty
        micro-batch of it. An empty micro-batch (uneven shares) is not yielded, since a
        loader cannot collate nothing.
        """
        self._raise_if_refused()
        ahead = ElasticSampler(
            self.dataset_len,
            global_batch=self.global_batch,
            seed=self.seed,
            epoch=self.epoch,
            allow_uneven=self.allow_uneven,
        )
        ahead.consumed = self.consumed
        ahead._order, ahead._order_epoch = self.order(), self.epoch
        batches: list[list[int]] = []
        while ahead.epoch == self.epoch:
            work = ahead.take(rank, world_size, micro_batch)
            batches.extend(list(chunk) for chunk in work.micro_batches if chunk)
        return batches

    def take(self, rank: int, world_size: int, micro_batch: int) -> RankBatch:
        """This rank's part of the next global batch; the position moves past the batch."""
        batch = self.peek(rank, world_size, micro_batch)
        self.consumed = batch.start + batch.global_size
        if self.consumed >= self.dataset_len:
            self.epoch += 1
            self.consumed = 0
        return batch

    # ------------------------------------------------------------ Stateful

    def state_dict(self) -> dict[str, Any]:
        """The position: ``epoch`` and ``consumed`` (positions of its permutation done),
        with the ``seed`` and ``dataset_len`` the permutation is made of. Plain ints,
        which the trap saves and loads without pickle."""
        return {
            "seed": self.seed,
            "dataset_len": self.dataset_len,
            "epoch": self.epoch,
            "consumed": self.consumed,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a saved position, whatever world size saved it.

        A position saved for another seed or dataset length is refused: the same index
        would name other samples, and the epoch would silently skip and repeat some.
        The refusal is said on stderr at once and raised by the first ``take`` (or
        ``peek``, ``batch_sampler``): raised here, it would make the trap pass over
        the checkpoint for an older one, and in the end start the job again from step
        0 with a line on stderr as the only sign. The global batch may differ from
        the saving run's (the position is a sample index, not a step); keeping it is
        what keeps the learning rate right.
        """
        problem = self._problem_with(state_dict)
        if problem is not None:
            print(f"gracetrap: {problem}", file=sys.stderr, flush=True)
            self._refused = problem
            return
        self._refused = None
        self.epoch = int(state_dict["epoch"])
        self.consumed = int(state_dict["consumed"])

    def _problem_with(self, state_dict: dict[str, Any]) -> str | None:
        missing = [name for name in _STATE_FIELDS if name not in state_dict]
        if missing:
            return f"not an ElasticSampler state: {', '.join(missing)} missing"
        for name in ("seed", "dataset_len"):
            if int(state_dict[name]) != getattr(self, name):
                return (
                    f"the checkpoint's data position was saved with {name}="
                    f"{int(state_dict[name])}, this sampler has {name}={getattr(self, name)}: "
                    "its sample index would name other samples. Resume with the same "
                    "dataset and seed, or start the job afresh in another checkpoint folder"
                )
        epoch, consumed = int(state_dict["epoch"]), int(state_dict["consumed"])
        if epoch < 0 or not 0 <= consumed < self.dataset_len:
            return f"position {consumed} of epoch {epoch} is outside the dataset"
        return None

    def _raise_if_refused(self) -> None:
        if self._refused is not None:
            raise ValueError(self._refused)
