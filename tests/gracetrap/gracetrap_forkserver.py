"""Fork one trainer per kill trial from a process that has imported torch once.

Reads one checkpoint folder per line on stdin. For each it forks a child that resumes
the example model from that folder, trains one step, saves it through the trap and
then waits to be killed; the parent prints ``CHILD <pid>`` and, once the child is
gone, ``EXIT <code>``. Starting a fresh interpreter per trial would cost seconds of
torch import each; a fork costs milliseconds, so many kills fit in a short test.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from gracetrap_gang import load_example

from gracetrap import Trap

train_ddp = load_example()


def _train_one_step_and_save(checkpoint_dir: str, argv: list[str]) -> None:
    args = train_ddp.parse_args(argv)
    torch.manual_seed(args.seed)
    model = train_ddp.build_model(args)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trap = Trap(checkpoint_dir, {"model": model, "optimizer": optimizer}, keep=2)
    step = trap.resume()
    inputs, targets = train_ddp.SyntheticRegression(seed=args.seed, rank=0, batch=args.batch)[step]
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    trap.save(step)
    print(f"SAVED {step}", flush=True)
    while True:
        time.sleep(1)


def main() -> None:
    """Serve trials until stdin closes."""
    argv = sys.argv[1:]
    for line in sys.stdin:
        checkpoint_dir = line.strip()
        pid = os.fork()
        if pid == 0:
            try:
                _train_one_step_and_save(checkpoint_dir, argv)
            finally:
                sys.stdout.flush()
                os._exit(1)
        print(f"CHILD {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        # A child killed between a line's text and its newline leaves that line open:
        # the marker starts a line of its own (the reader drops the empty lines).
        print(f"\nEXIT {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    main()
