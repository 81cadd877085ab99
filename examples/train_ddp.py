"""Train a small model with DDP over gloo (CPU) under the Quartermaster trap.

The drills, the demo and the gracetrap tests launch this script once per rank with
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and the QM_* variables set (a single
process without WORLD_SIZE works too). Data is synthetic and a pure function of
(seed, step, rank), while dropout and the input noise draw from the torch, Python
and NumPy generators, so a resumed run matches an uninterrupted one bit for bit
only if the trap restores every generator.

Each step prints one parseable line:

    STEP <step> RANK <rank> LOSS <decimal> HEX <float.hex()>

Example (two ranks, on one machine)::

    for r in 0 1; do RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        QM_CHECKPOINT_DIR=/tmp/ckpt python examples/train_ddp.py --steps 200 & done
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from gracetrap import Trap, worker_init_fn

FEATURES = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of the example."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="total number of steps")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
    parser.add_argument("--save-every", type=int, default=0, help="regular checkpoint interval")
    parser.add_argument(
        "--cadence",
        action="store_true",
        help="checkpoint whenever trap.should_checkpoint() says so (QM_PREEMPTION_MTBP)",
    )
    parser.add_argument("--hidden", type=int, default=32, help="width of the hidden layers")
    parser.add_argument("--layers", type=int, default=1, help="number of hidden layers")
    parser.add_argument("--batch", type=int, default=8, help="samples per rank and step")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and data")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    parser.add_argument("--exit-code", type=int, default=0, help="exit code after preemption")
    parser.add_argument("--checkpoint-dir", default=None, help="default: $QM_CHECKPOINT_DIR")
    parser.add_argument(
        "--ending",
        choices=("shutdown", "destroy"),
        default="shutdown",
        help="end a finished run with trap.shutdown() or a bare dist.destroy_process_group()",
    )
    parser.add_argument(
        "--dump",
        default=None,
        help="write final parameters, optimizer state and RNG states here with torch.save; "
        "'{rank}' in the path is replaced by the rank (otherwise only rank 0 writes)",
    )
    return parser.parse_args(argv)


class SyntheticRegression(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Batch ``step`` of rank ``rank``: a deterministic function of (seed, step, rank)."""

    def __init__(self, *, seed: int, rank: int, batch: int) -> None:
        self.seed = seed
        self.rank = rank
        self.batch = batch
        weights = torch.Generator().manual_seed(seed)
        self.true_weights = torch.randn(FEATURES, 1, generator=weights)

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + step * 1_009 + self.rank) % (1 << 63)
        )
        inputs = torch.randn(self.batch, FEATURES, generator=generator)
        targets = inputs @ self.true_weights + 0.1 * torch.randn(self.batch, 1, generator=generator)
        return inputs, targets


class StepSampler(torch.utils.data.Sampler[int]):
    """Yields the step numbers still to do, so a resumed run reads the same batches."""

    def __init__(self, start: int, stop: int) -> None:
        self.start = start
        self.stop = stop

    def __iter__(self) -> Any:
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return max(0, self.stop - self.start)


def build_model(args: argparse.Namespace) -> nn.Module:
    """A small MLP with dropout, so that training consumes the torch generator."""
    layers: list[nn.Module] = [nn.Linear(FEATURES, args.hidden), nn.ReLU(), nn.Dropout(0.1)]
    for _ in range(args.layers - 1):
        layers += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
    layers.append(nn.Linear(args.hidden, 1))
    return nn.Sequential(*layers)


def rng_snapshot() -> dict[str, Any]:
    """The generator states, in comparable form, for --dump."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def main(argv: list[str] | None = None) -> int:
    """Train, checkpointing through the trap; returns the process exit code."""
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank() if dist.is_initialized() else 0

    # Same initial weights on every rank; DDP would broadcast rank 0's anyway.
    torch.manual_seed(args.seed)
    model = build_model(args)
    # DDP regroups its gradient buckets after a process's first step; a resumed
    # process would then reduce one step in a different layout (and so a
    # different summation order) than the uninterrupted run. With
    # find_unused_parameters the layout never changes, and resume is bit-exact.
    ddp_model: nn.Module = (
        DistributedDataParallel(model, find_unused_parameters=True) if world_size > 1 else model
    )
    optimizer = torch.optim.Adam(ddp_model.parameters(), lr=args.lr)
    # From here on each rank draws its own random numbers (dropout, input noise).
    torch.manual_seed(args.seed + 1_000 + rank)
    random.seed(args.seed + 2_000 + rank)
    np.random.seed(args.seed + 3_000 + rank)

    trap = Trap(
        checkpoint_dir=args.checkpoint_dir,
        state={"model": ddp_model, "optimizer": optimizer},
        exit_code=args.exit_code,
        keep=args.keep,
    )
    start = trap.resume()
    dataset = SyntheticRegression(seed=args.seed, rank=rank, batch=args.batch)
    # The DataLoader draws a base seed when it starts iterating; its own generator keeps
    # that draw off the global stream, which resume() has just restored.
    loader = DataLoader(
        dataset,
        generator=torch.Generator().manual_seed(args.seed),
        batch_size=None,
        sampler=StepSampler(start, args.steps),
        num_workers=args.workers,
        worker_init_fn=worker_init_fn if args.workers else None,
    )
    loss_value = float("nan")
    for step, (inputs, targets) in zip(range(start, args.steps), loader, strict=True):
        noisy = inputs + 0.01 * torch.randn_like(inputs)
        noisy = noisy * (1.0 + 0.01 * random.random()) + 0.01 * float(np.random.rand())
        loss = nn.functional.mse_loss(ddp_model(noisy), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_value = loss.item()
        print(f"STEP {step} RANK {rank} LOSS {loss_value:.9f} HEX {loss_value.hex()}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if trap.should_stop(step):
            trap.save_and_exit(step)
        if args.save_every:
            due = (step + 1) % args.save_every == 0
        else:
            due = args.cadence and trap.should_checkpoint(step)
        if due:
            trap.save(step)

    if args.dump and ("{rank}" in args.dump or rank == 0):
        torch.save(
            {
                "steps": args.steps,
                "loss_hex": loss_value.hex(),
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "rng": rng_snapshot(),
            },
            args.dump.replace("{rank}", str(rank)),
        )
    if args.ending == "destroy" and dist.is_initialized():
        # A background save still talks over its own process group: let it finish.
        trap.wait_for_save()
        dist.destroy_process_group()
    else:
        trap.shutdown()
    trap.close()
    print(f"DONE RANK {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
