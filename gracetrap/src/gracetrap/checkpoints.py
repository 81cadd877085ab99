"""The checkpoint directory: ``step_N/`` folders, the ``latest`` pointer, retention.

A ``step_N`` folder counts as a checkpoint only once ``torch.distributed.checkpoint``
has written its ``.metadata`` file, which it does last, after every rank's data is
on disk. Everything else here keeps that invariant true across a kill at any moment:
the pointer is replaced by rename, and a folder being deleted is first renamed out
of the ``step_N`` namespace so that a half-deleted folder can never look complete.
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
_STEP_DIR = re.compile(r"^step_(\d+)$")
_DISCARD_PREFIX = ".discard-"


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A checkpoint folder on disk: the completed step it holds and whether it is complete."""

    step: int
    path: Path
    complete: bool


def step_dir(checkpoint_dir: Path, step: int) -> Path:
    """The folder that holds the checkpoint taken after ``step``."""
    return checkpoint_dir / f"step_{step}"


def is_complete(path: Path) -> bool:
    """True when the checkpoint folder's metadata file exists, i.e. the save committed."""
    return (path / METADATA_FILE).is_file()


def list_checkpoints(checkpoint_dir: Path) -> list[CheckpointInfo]:
    """Every ``step_N`` folder, newest step first, complete or not."""
    found: list[CheckpointInfo] = []
    try:
        entries = list(os.scandir(checkpoint_dir))
    except FileNotFoundError:
        return []
    for entry in entries:
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False):
            path = Path(entry.path)
            found.append(CheckpointInfo(int(match.group(1)), path, is_complete(path)))
    found.sort(key=lambda info: info.step, reverse=True)
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
    checkpoint_dir: Path, *, step: int, seconds: float, nbytes: int, world_size: int
) -> None:
    """Replace ``latest`` atomically: write a temporary file, fsync, rename, fsync the folder."""
    content = {
        "step": step,
        "path": step_dir(checkpoint_dir, step).name,
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
    save in progress and is left alone. Returns the steps removed.
    """
    removed: list[int] = []
    checkpoints = list_checkpoints(checkpoint_dir)
    complete = [info for info in checkpoints if info.complete]
    newest_complete = complete[0].step if complete else None
    for info in complete[max(keep, 1) :]:
        discard(info.path)
        removed.append(info.step)
    for info in checkpoints:
        if not info.complete and newest_complete is not None and info.step < newest_complete:
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
