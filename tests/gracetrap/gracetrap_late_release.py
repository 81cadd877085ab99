"""Rank 0 leaves a collective in flight and exits; rank 1 joins while it shuts down.

Usage (two ranks, the runtime's environment): gracetrap_late_release.py <plain|trap> <flag>

Rank 0 starts an all-reduce, drops its tensor and exits, leaving a lot of cyclic
garbage so that the interpreter's shutdown takes a while; it creates ``flag`` as
its last act. Rank 1 joins the all-reduce only then, so that rank 0's gloo worker
thread releases the tensor while rank 0's interpreter is shutting down: the moment
at which the abort at exit happened. ``plain`` uses a tensor Python may free;
``trap`` uses the buffer the trap reduces in.
"""

from __future__ import annotations

import gc
import os
import sys
import time

import torch
import torch.distributed as dist
from gracetrap.trap import _collective_buffer


def main() -> None:
    """One rank of the scenario."""
    kind, flag = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    if kind == "trap":
        tensor = _collective_buffer("training", torch.device("cpu"), 4)
    else:
        tensor = torch.ones(4, dtype=torch.float64)
    if rank == 1:
        while not os.path.exists(flag):
            time.sleep(0.01)
    work = dist.all_reduce(tensor, async_op=True)
    if rank == 1:
        work.wait()
        return
    # Collected only by the interpreter's shutdown, which then takes a while.
    gc.disable()
    garbage: list[list[object]] = [[] for _ in range(1_500_000)]
    for item in garbage:
        item.append(item)
    del garbage, work, tensor
    open(flag, "w").close()


if __name__ == "__main__":
    main()
