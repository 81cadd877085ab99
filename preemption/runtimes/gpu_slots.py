"""Which GPUs of its node each rank of the local runtime may see.

The engine places a gang as a number of ranks per node, each of `gpus_per_rank` GPUs,
and guarantees that a node's ranks fit its GPUs (R1). Which GPUs those are is the
runtime's to decide: at launch it gives each rank concrete indices on its node, 0 to
the node's GPU count less one (from the inventory, inventory.py), none of them held by
another live gang on that node, and records them in the gang's record (gang.json,
`gpu_indices`, one list per rank). The rank's keeper hands them to the rank as
CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES (launcher.rank_environment), so a rank
of one GPU no longer sees every GPU of the host.

What a gang holds is read from the records on disk, never from memory, so that another
control-plane process, or this one after a restart, sees the same allocation. A gang
holds its GPUs from the moment its record is written until every one of its ranks has
ended (exited, or lost: its keeper and process gone); a forgotten gang has no record
and holds nothing. That is the ending the engine reads from the runtime's observations,
so a gang's GPUs are free here when the engine counts them free (R1). A gang recorded
before GPUs were assigned holds none that anyone can know of, and its ranks see none.

Launches of one control-plane process run side by side, and several processes may
share a root; the allocation of a node is made atomic by an exclusive `flock` on a lock
file of the node's in `<root>/gpus/`, held from reading what live gangs hold until the
new gang's record and index entry are written. A gang on several nodes takes their
locks in the order of the nodes' names, so two launches never wait on each other in a
circle. flock locks belong to the open file, so two threads of one process exclude
each other as two processes do; the kernel drops a lock when its holder dies.

On a real GPU host the inventory's node is this host, and the indices are its devices
as CUDA numbers them. Nothing checks that the host has as many GPUs as the inventory
names: a node configured with more than exist hands out indices of devices that are
not there, and a rank given only those sees no GPU at all (CUDA ignores an index past
the last device). Configure QM_LOCAL_NODES to match the machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from urllib.parse import quote

from preemption.runtimes.base import RankPlacement

# The folder under the runtime's root that holds one lock file per node.
LOCK_FOLDER = "gpus"


class GpuShortage(ValueError):
    """A node has fewer free GPUs than the gang's ranks there ask for."""


@contextlib.contextmanager
def node_locks(root: Path, nodes: Iterable[str]) -> Iterator[None]:
    """Hold the GPU lock of each of ``nodes`` (under ``root``) until the block ends.

    The locks are taken in the order of the nodes' names (see the module docstring).
    The folder and its files are made here, the control plane's only (0700 and 0600).
    """
    folder = root / LOCK_FOLDER
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    with contextlib.ExitStack() as held:
        for node in sorted(set(nodes)):
            # Quoted, so that a node name is always one plain file name of its own.
            path = folder / f"{quote(node, safe='')}.lock"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            held.callback(os.close, fd)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield


def assign_gpus(
    placements: Sequence[RankPlacement],
    gpus_per_rank: int,
    capacity: Mapping[str, int],
    held: Mapping[str, set[int]],
) -> list[list[int]]:
    """The GPU indices of each rank, in the order of the ranks' numbers.

    Each node's free indices (those below its ``capacity`` that no live gang ``held``)
    go out lowest first, to its ranks in the order of their local rank, ``gpus_per_rank``
    each, so that no two ranks share one. Raises GpuShortage naming the node when its
    free indices do not cover its ranks.
    """
    wanted: dict[str, int] = {}
    for placement in placements:
        wanted[placement.node] = wanted.get(placement.node, 0) + gpus_per_rank
    free: dict[str, list[int]] = {}
    for node in sorted(wanted):
        taken = held.get(node, set())
        free[node] = [index for index in range(capacity[node]) if index not in taken]
        if len(free[node]) < wanted[node]:
            raise GpuShortage(
                f"node {node} has {len(free[node])} of its {capacity[node]} GPUs free, "
                f"and the gang's ranks there need {wanted[node]}"
            )
    indices: dict[int, list[int]] = {}
    for placement in sorted(
        placements, key=lambda placement: (placement.local_rank, placement.rank)
    ):
        available = free[placement.node]
        indices[placement.rank] = available[:gpus_per_rank]
        del available[:gpus_per_rank]
    return [indices[rank] for rank in sorted(indices)]
