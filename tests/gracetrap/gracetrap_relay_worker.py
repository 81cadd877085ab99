"""A gang with one slow rank, for the relay: the word of a stop while the ranks wait.

Rank 0 takes ``--slow-seconds`` over each step (in Python's sleep); the other ranks
are quick and wait for it in the step's all-reduce, inside gloo, where Python runs
no signal handler until the collective returns. Each rank prints
``STEP <n> <time the step ended>`` after its all-reduce, and stops through the trap.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from gracetrap import Trap


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slow-seconds", type=float, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with Trap(os.environ["QM_CHECKPOINT_DIR"], {}) as trap:
        for step in trap.steps(10_000):
            if rank == 0:
                time.sleep(args.slow_seconds)
            dist.all_reduce(torch.ones(1))
            print(f"STEP {step} {time.time():.6f}", flush=True)


if __name__ == "__main__":
    main()
