"""The checkpoint directory: ``step_N/`` folders, the ``latest`` pointer, retention.

A ``step_N`` folder counts as a checkpoint only once ``torch.distributed.checkpoint``
has written its ``.metadata`` file, which it does last, after every rank's data is
on disk. Everything else here keeps that invariant true across a kill at any moment:
the pointer is replaced by rename, and a folder being deleted is first renamed out
of the ``step_N`` namespace so that a half-deleted folder can never look complete.

Fencing. A rank of an older attempt can outlive its attempt unseen (a node that lost
only its kubelet, a network partition, a rank no sandbox holds) and go on writing to
the job's folder while a newer attempt trains from it. The folder therefore has an
epoch, the highest attempt that claimed it: each attempt creates its own
``epoch-<attempt>`` file (``O_EXCL``) before it loads anything, so the epoch only
ever grows and two claimants never overwrite each other's claim. Each attempt saves
into folders of its own, ``step_N.attempt_E``, so an older attempt can never write
into a newer one's files; a rank checks the epoch before its commit and right after
it, and stops once a newer attempt owns the folder (:class:`FencedError`). Resuming
orders commits by (epoch, step), so even a commit that slipped in between a claim
and its writer's check never wins over the newer attempt's own. A folder named
``step_N`` (written without an attempt, or before fencing existed) is epoch 0.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METADATA_FILE = ".metadata"
LATEST_POINTER = "latest"
EPOCH_PREFIX = "epoch-"
_STEP_DIR = re.compile(r"^step_(\d+)(?:\.attempt_(\d+))?$")
_EPOCH_FILE = re.compile(r"^epoch-(\d+)$")
_DISCARD_PREFIX = ".discard-"


class FencedError(RuntimeError):
    """A newer attempt of the job has claimed the checkpoint folder: this rank must stop.

    Its arguments are plain integers so that it crosses process boundaries intact
    (DCP gathers a failed commit's exception to every rank by pickle).
    """

    def __init__(self, owner: int, mine: int) -> None:
        super().__init__(owner, mine)
        self.owner = owner
        self.mine = mine

    def __str__(self) -> str:
        return fenced_line(self.owner, self.mine)


def fenced_line(owner: int, mine: int) -> str:
    """The one line a fenced rank logs before it stops."""
    return f"fenced: attempt {owner} of this job owns the checkpoints now; attempt {mine} stops"


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A checkpoint folder on disk: the completed step it holds and whether it is complete."""

    step: int
    path: Path
    complete: bool
    epoch: int = 0

    @property
    def order(self) -> tuple[int, int]:
        """How new the checkpoint is: a newer attempt's commit is newer than any older
        attempt's, whatever their steps."""
        return (self.epoch, self.step)


def step_dir(checkpoint_dir: Path, step: int, epoch: int = 0) -> Path:
    """The folder that holds the checkpoint taken after ``step`` by attempt ``epoch``."""
    if epoch == 0:
        return checkpoint_dir / f"step_{step}"
    return checkpoint_dir / f"step_{step}.attempt_{epoch}"


def current_epoch(checkpoint_dir: Path) -> int:
    """The highest attempt that claimed the folder (0 when none did)."""
    try:
        entries = os.scandir(checkpoint_dir)
    except FileNotFoundError:
        return 0
    with entries:
        epochs = [int(m.group(1)) for e in entries if (m := _EPOCH_FILE.match(e.name))]
    return max(epochs, default=0)


def claim_epoch(checkpoint_dir: Path, epoch: int, *, owner: str = "") -> int:
    """Claim the folder for attempt ``epoch``; return the folder's epoch afterwards.

    The claim is a file of its own, created with ``O_EXCL`` and made durable before
    this returns, so that the epoch (the highest such file) can only grow: no
    claimant can lower it, however the claims interleave. The ranks of one attempt
    all claim the same file, and all but the first find it there. A return value
    above ``epoch`` means a newer attempt owns the folder already.
    """
    if epoch < 1:
        raise ValueError(f"an attempt number starts at 1, not {epoch}")
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    claim = checkpoint_dir / f"{EPOCH_PREFIX}{epoch}"
    try:
        fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        pass
    else:
        # Who claimed, for a person reading the folder; the epoch is in the name.
        with os.fdopen(fd, "w") as handle:
            json.dump({"attempt": epoch, "owner": owner, "claimed_at": time.time()}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        fsync_dir(checkpoint_dir)
    return current_epoch(checkpoint_dir)


def is_complete(path: Path) -> bool:
    """True when the checkpoint folder's metadata file exists, i.e. the save committed."""
    return (path / METADATA_FILE).is_file()


def list_checkpoints(checkpoint_dir: Path) -> list[CheckpointInfo]:
    """Every checkpoint folder, newest first by (epoch, step), complete or not."""
    found: list[CheckpointInfo] = []
    try:
        entries = list(os.scandir(checkpoint_dir))
    except FileNotFoundError:
        return []
    for entry in entries:
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False):
            path = Path(entry.path)
            epoch = int(match.group(2)) if match.group(2) is not None else 0
            found.append(CheckpointInfo(int(match.group(1)), path, is_complete(path), epoch))
    found.sort(key=lambda info: info.order, reverse=True)
    return found


def complete_checkpoints(checkpoint_dir: Path) -> list[CheckpointInfo]:
    """Complete checkpoints only, newest first: the candidates for resuming."""
    return [info for info in list_checkpoints(checkpoint_dir) if info.complete]


def folder_bytes(path: Path) -> int:
    """Total size of the regular files directly inside ``path``."""
    total = 0
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            total += entry.stat(follow_symlinks=False).st_size
    return total


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_pointer(checkpoint_dir: Path) -> dict[str, Any] | None:
    """The ``latest`` pointer's content, or None when it is absent or unreadable."""
    try:
        content = json.loads((checkpoint_dir / LATEST_POINTER).read_text())
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None


def write_pointer(
    checkpoint_dir: Path,
    *,
    step: int,
    seconds: float,
    nbytes: int,
    world_size: int,
    epoch: int = 0,
) -> None:
    """Replace ``latest`` atomically: write a temporary file, fsync, rename, fsync the folder."""
    content = {
        "step": step,
        "path": step_dir(checkpoint_dir, step, epoch).name,
        "epoch": epoch,
        "seconds": seconds,
        "bytes": nbytes,
        "world_size": world_size,
        "committed_at": time.time(),
    }
    temporary = checkpoint_dir / f".{LATEST_POINTER}.tmp-{os.getpid()}"
    with open(temporary, "w") as handle:
        json.dump(content, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, checkpoint_dir / LATEST_POINTER)
    fsync_dir(checkpoint_dir)


def discard(path: Path) -> None:
    """Delete a checkpoint folder so that no kill can leave a complete-looking remnant."""
    target = path.with_name(f"{_DISCARD_PREFIX}{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(path, target)
    except FileNotFoundError:
        return
    shutil.rmtree(target, ignore_errors=True)


def prune(checkpoint_dir: Path, keep: int) -> list[int]:
    """Keep the newest ``keep`` complete checkpoints and drop stale leftovers.

    Incomplete folders older than the newest complete checkpoint are leftovers of a
    killed save and are dropped too; an incomplete folder newer than that may be a
    save in progress and is left alone. "Newer" is by (epoch, step), the order a
    resume follows, so every attempt that prunes keeps the same checkpoints. Returns
    the steps removed.
    """
    removed: list[int] = []
    checkpoints = list_checkpoints(checkpoint_dir)
    complete = [info for info in checkpoints if info.complete]
    newest_complete = complete[0].order if complete else None
    for info in complete[max(keep, 1) :]:
        discard(info.path)
        removed.append(info.step)
    for info in checkpoints:
        if not info.complete and newest_complete is not None and info.order < newest_complete:
            discard(info.path)
            removed.append(info.step)
    for entry in os.scandir(checkpoint_dir):
        # Remnants of a deletion or a pointer write interrupted by a kill.
        if entry.name.startswith(_DISCARD_PREFIX) and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        elif entry.name.startswith(f".{LATEST_POINTER}.tmp-"):
            try:
                pid = int(entry.name.rsplit("-", 1)[1])
            except ValueError:
                continue
            if pid != os.getpid():
                Path(entry.path).unlink(missing_ok=True)
    return sorted(removed)
