"""Run examples/train_ddp.py gangs to their end, many times, and report how each rank exited.

Usage: gracetrap_exit_runs.py <shutdown|destroy> <runs> <world size> <folder>

The ranks of each run are forked from this process, which imported torch once, so a
run costs the training and the exit rather than an interpreter start per rank; each
rank still ends through the interpreter's normal shutdown, where the abort at exit
happened. Prints one JSON line: the exit codes of every run and the runs whose
stderr mentions "terminate called".
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch  # noqa: F401  (imported once here, before any fork)
from gracetrap_gang import free_port, load_example

train_ddp = load_example()


def main() -> None:
    """Run the gangs one after another."""
    ending, runs, world_size, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    codes: list[list[int]] = []
    aborted: list[int] = []
    for run in range(runs):
        port = free_port()
        children = []
        for rank in range(world_size):
            pid = os.fork()
            if pid == 0:
                stderr = os.open(out / f"run{run}-rank{rank}.err", os.O_WRONLY | os.O_CREAT)
                stdout = os.open(out / f"run{run}-rank{rank}.out", os.O_WRONLY | os.O_CREAT)
                os.dup2(stderr, 2)
                os.dup2(stdout, 1)
                os.environ.update(
                    RANK=str(rank),
                    WORLD_SIZE=str(world_size),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    OMP_NUM_THREADS="1",
                )
                arguments = ["--steps", "3", "--ending", ending]
                # sys.exit, not os._exit: the rank goes through interpreter shutdown.
                sys.exit(train_ddp.main([*arguments, "--checkpoint-dir", str(out / f"ck{run}")]))
            children.append(pid)
        codes.append([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children])
        errors = "".join(
            (out / f"run{run}-rank{rank}.err").read_text(errors="replace")
            for rank in range(world_size)
        )
        if "terminate called" in errors:
            aborted.append(run)
    print(json.dumps({"ending": ending, "codes": codes, "aborted": aborted}), flush=True)


if __name__ == "__main__":
    main()
