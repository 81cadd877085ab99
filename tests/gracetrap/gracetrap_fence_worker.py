"""One rank of a job attempt, in a process of its own, for the fencing tests.

It trains a small model deterministically under a real :class:`gracetrap.Trap`
(``QM_ATTEMPT`` and ``QM_CHECKPOINT_DIR`` from the environment, as a runtime sets
them), saves after the steps it is told to, and dumps its state at the end.

``--hold-commit STEP`` reproduces the race a stale rank can lose only by luck: the
save of STEP passes the trap's check of the folder's epoch, then waits (printing
``HOLDING``) until the file ``--go`` exists, then renames its ``.metadata`` into
place. In that wait the test lets a newer attempt claim the folder. With
``--die-after-rename`` the process is then killed by itself before the trap can
check again, as a rank that loses its node at that instant: its commit slipped in.
``--wait-after-resume FILE`` holds a newer attempt between its resume and its
training until FILE exists, so that the stale commit lands in between.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from gracetrap import Trap


def _hold_the_commit(go: Path, die_after_rename: bool) -> None:
    """Make the next DCP commit wait for ``go`` between the trap's check and the rename."""
    real_finish = FileSystemWriter.finish

    def held_finish(self: FileSystemWriter, *args: Any, **kwargs: Any) -> None:
        print("HOLDING", flush=True)
        while not go.exists():
            time.sleep(0.01)
        real_finish(self, *args, **kwargs)
        if die_after_rename:
            print("RENAMED", flush=True)
            os._exit(9)

    FileSystemWriter.finish = held_finish  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-after", type=int, action="append", default=[])
    parser.add_argument("--hold-commit", type=int, default=None)
    parser.add_argument("--go", type=Path, default=None)
    parser.add_argument("--die-after-rename", action="store_true")
    parser.add_argument("--dump", type=Path, default=None)
    parser.add_argument("--wait-after-resume", type=Path, default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    random.seed(1)
    trap = Trap(state={"model": model, "optimizer": optimizer})
    start = trap.resume()
    print(f"RESUMED AT {start}", flush=True)
    while args.wait_after_resume is not None and not args.wait_after_resume.exists():
        time.sleep(0.01)
    for step in range(start, args.steps):
        inputs = torch.randn(5, 4) * (1.0 + random.random())
        loss = model(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"STEP {step} LOSS {loss.item().hex()}", flush=True)
        time.sleep(args.step_sleep)
        if trap.should_stop(step):
            trap.save_and_exit(step)
        if step == args.hold_commit:
            assert args.go is not None
            _hold_the_commit(args.go, args.die_after_rename)
            trap.save(step)
        elif step in args.save_after:
            trap.save(step)
    if args.dump is not None:
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate(),
            },
            args.dump,
        )
    trap.close()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
