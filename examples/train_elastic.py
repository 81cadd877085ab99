"""Train with DDP over gloo (CPU) and resume at any world size, sample for sample.

A preempted or resized job comes back with however many ranks the cluster gives
it. This script does what gracetrap/README.md's "Resuming at another world size"
asks of a training script:

- the data position is a global sample index (``gracetrap.ElasticSampler``),
  registered in the trap's state beside the model and the optimizer, so that the
  checkpoint holds how far the job got, not how far each rank got;
- every step takes the same global batch at any world size: each rank takes its
  stripe of it (``sampler.take``), reads it through a DataLoader whose batch sampler
  is the sampler's plan for the rest of the epoch (``sampler.batch_sampler``, which
  lets the loader read ahead without moving the saved position), and accumulates gradients over its micro-batches
  (DDP's ``no_sync`` for all but the last), each micro-batch's loss being a sum
  scaled by ``loss_scale``, so the gradient is the mean over the global batch
  however many ranks share it; the learning rate therefore stays as it is;
- random numbers come from streams seeded per step (``seed_rank_streams``, for
  dropout) and per sample (``sample_seed``, for augmentation), never from a rank's
  stream continued across a resize;
- model and optimizer state come back through the trap's DCP load, which reads a
  checkpoint written by any number of ranks.

Launch it like examples/train_ddp.py (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
the QM_* variables per rank). Each step prints, on every rank::

    SAMPLES <step> EPOCH <epoch> WORLD <world size> IDS <this rank's sample ids, comma-separated>
    STEP <step> RANK <rank> LOSS <mean loss of the global batch> HEX <float.hex()>

and at the end rank 0 prints ``FINAL LOSS <hex> PARAMS <hex of the sum of squares of
every parameter>``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from gracetrap import (
    ElasticSampler,
    Trap,
    derive_seed,
    sample_seed,
    seed_rank_streams,
    worker_init_fn,
)

FEATURES = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of the example."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="passes over the dataset")
    parser.add_argument("--dataset-len", type=int, default=240, help="samples in the dataset")
    parser.add_argument("--global-batch", type=int, default=24, help="samples per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per rank and pass")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--hidden", type=int, default=32, help="width of the hidden layer")
    parser.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="dropout probability; its masks come from the per-rank streams, so a run "
        "resized elsewhere draws other masks than an uninterrupted one",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for weights, order and data")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
    parser.add_argument("--save-every", type=int, default=0, help="regular checkpoint interval")
    parser.add_argument("--checkpoint-dir", default=None, help="default: $QM_CHECKPOINT_DIR")
    parser.add_argument(
        "--preempt-at",
        type=int,
        default=None,
        help="the last rank sends itself SIGTERM after this step, so that a test stops the "
        "gang at a step it chose (the trap's usual path: agree, save, exit 0)",
    )
    return parser.parse_args(argv)


class SyntheticRegression(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """Sample ``i`` of an epoch: its id, features drawn from ``(seed, i)`` and a linear target.

    The augmentation noise of sample ``i`` in an epoch comes from ``sample_seed(seed,
    epoch, i)``: the same whichever rank reads the sample, at any world size, and in
    whichever DataLoader worker.
    """

    def __init__(self, *, seed: int, length: int, epoch: int = 0) -> None:
        self.seed = seed
        self.length = length
        self.epoch = epoch
        self.true_weights = torch.randn(
            FEATURES, 1, generator=torch.Generator().manual_seed(derive_seed(seed, 10))
        )

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        features, target = self.sample(index, self.epoch)
        return index, features, target

    def sample(self, index: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Features and target of sample ``index`` as seen in ``epoch``."""
        features = torch.randn(
            FEATURES, generator=torch.Generator().manual_seed(derive_seed(self.seed, 11, index))
        )
        target = features @ self.true_weights
        noise = torch.Generator().manual_seed(sample_seed(self.seed, epoch, index))
        augmented = features + 0.05 * torch.randn(FEATURES, generator=noise)
        return augmented, target

    def for_epoch(self, epoch: int) -> SyntheticRegression:
        """The same samples, augmented as in ``epoch``."""
        return SyntheticRegression(seed=self.seed, length=self.length, epoch=epoch)


def epoch_loader(
    dataset: SyntheticRegression,
    sampler: ElasticSampler,
    rank: int,
    world_size: int,
    args: argparse.Namespace,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches from the sampler's position to the end of its epoch.

    The loader reads ahead (workers, prefetching) from a plan of the epoch that does
    not move the sampler: the position the checkpoint saves moves only with ``take``,
    once per step the model has actually done.
    """
    loader = DataLoader(
        dataset.for_epoch(sampler.epoch),
        batch_sampler=sampler.batch_sampler(rank, world_size, args.micro_batch),
        num_workers=args.workers,
        worker_init_fn=worker_init_fn if args.workers else None,
        # The loader's base seed must not come from the global generator (see the README).
        generator=torch.Generator().manual_seed(args.seed),
    )
    return iter(loader)


def build_model(args: argparse.Namespace) -> nn.Module:
    """A small MLP (no batch statistics: a short or empty micro-batch is harmless)."""
    layers: list[nn.Module] = [nn.Linear(FEATURES, args.hidden), nn.ReLU()]
    if args.dropout:
        layers.append(nn.Dropout(args.dropout))
    layers.append(nn.Linear(args.hidden, 1))
    return nn.Sequential(*layers)


def main(argv: list[str] | None = None) -> int:
    """Train, checkpointing through the trap; returns the process exit code."""
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank() if dist.is_initialized() else 0

    torch.manual_seed(args.seed)  # the same initial weights at every world size
    model = build_model(args)
    ddp_model: nn.Module = (
        DistributedDataParallel(model, find_unused_parameters=True) if world_size > 1 else model
    )
    optimizer = torch.optim.Adam(ddp_model.parameters(), lr=args.lr)
    dataset = SyntheticRegression(seed=args.seed, length=args.dataset_len)
    sampler = ElasticSampler(len(dataset), global_batch=args.global_batch, seed=args.seed)
    # Refuse a world size that cannot keep the global batch before any work is done.
    sampler.check_world_size(world_size, args.micro_batch)

    trap = Trap(
        checkpoint_dir=args.checkpoint_dir,
        state={"model": ddp_model, "optimizer": optimizer, "sampler": sampler},
    )
    step = trap.resume()
    position = sampler.state_dict()
    print(
        f"RESUMED {step} WORLD {world_size} EPOCH {position['epoch']} "
        f"CONSUMED {position['consumed']}",
        flush=True,
    )
    loss_value = float("nan")
    loader_epoch, loader = -1, iter(())
    while sampler.epoch < args.epochs:
        if loader_epoch != sampler.epoch:
            loader = epoch_loader(dataset, sampler, rank, world_size, args)
            loader_epoch = sampler.epoch
        work = sampler.take(rank, world_size, args.micro_batch)
        seed_rank_streams(args.seed, work.epoch, step, rank)
        optimizer.zero_grad(set_to_none=True)
        summed = torch.zeros(())
        last = len(work.micro_batches) - 1
        for index, chunk in enumerate(work.micro_batches):
            if chunk:
                ids, inputs, targets = next(loader)
                assert tuple(ids.tolist()) == chunk, "the loader left the sampler's plan"
            else:
                # A short share's last micro-batch: still a pass, so that DDP's
                # all-reduce after the last one finds every rank there.
                inputs, targets = torch.empty(0, FEATURES), torch.empty(0, 1)
            # Gradients are all-reduced once per step, after the last micro-batch.
            syncing = index == last or world_size == 1
            with contextlib.nullcontext() if syncing else ddp_model.no_sync():
                loss = nn.functional.mse_loss(ddp_model(inputs), targets, reduction="sum")
                (loss * work.loss_scale).backward()
            summed += loss.detach()
        optimizer.step()
        if world_size > 1:
            dist.all_reduce(summed)
        loss_value = float(summed) / work.global_size
        ids = ",".join(str(i) for i in work.sample_ids)
        print(f"SAMPLES {step} EPOCH {work.epoch} WORLD {world_size} IDS {ids}", flush=True)
        print(f"STEP {step} RANK {rank} LOSS {loss_value:.9f} HEX {loss_value.hex()}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if step == args.preempt_at and rank == world_size - 1:
            signal.raise_signal(signal.SIGTERM)  # handled before it returns
        if trap.should_stop(step):
            trap.save_and_exit(step)
        if args.save_every and (step + 1) % args.save_every == 0:
            trap.save(step)
        step += 1

    squares = sum(float(p.detach().double().square().sum()) for p in model.parameters())
    if rank == 0:
        print(f"FINAL LOSS {loss_value.hex()} PARAMS {squares.hex()}", flush=True)
    trap.shutdown()
    trap.close()
    print(f"DONE RANK {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
