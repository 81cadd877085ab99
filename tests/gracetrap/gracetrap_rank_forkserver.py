"""One rank's trial server: fork a run of examples/train_ddp.py per line on stdin.

Each line is ``<checkpoint dir> <master port> <steps> <env as k=v,... or -> [options]``; the
child becomes this server's rank of a fresh gloo gang on that port and runs the
example, whose STEP and QM_EVENT lines come out on this server's stdout. The server
prints ``CHILD <pid>`` when the child starts and ``EXIT <code>`` when it is gone.
Forking from a process that imported torch once costs milliseconds, where a fresh
interpreter costs seconds, so many SIGKILLs of real two-rank gangs fit in one test.
"""

from __future__ import annotations

import os
import sys

import torch  # noqa: F401  (imported once here, before any fork)
from gracetrap_gang import load_example

train_ddp = load_example()


def main() -> None:
    """Serve trials until stdin closes."""
    rank, world_size, *model_args = sys.argv[1:]
    for line in sys.stdin:
        checkpoint_dir, port, steps, extra, *more = line.split()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.environ.update(
                    RANK=rank,
                    WORLD_SIZE=world_size,
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=port,
                    QM_CHECKPOINT_DIR=checkpoint_dir,
                )
                if extra != "-":
                    os.environ.update(item.split("=", 1) for item in extra.split(","))
                code = train_ddp.main(["--steps", steps, *model_args, *more])
            finally:
                sys.stdout.flush()
                os._exit(code)
        print(f"CHILD {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        # A child killed between a line's text and its newline leaves that line open:
        # the marker starts a line of its own (the reader drops the empty lines).
        print(f"\nEXIT {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    main()
