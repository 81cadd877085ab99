"""The exits pipe: how keepers tell the control plane at once that a rank has exited.

Each keeper writes its job's id on a line of ``<root>/exits`` once its rank has
exited (records.py). This reads the pipe; it makes the pipe, the control plane's
alone, and refuses anything else at its name. It never signals a process.
"""

from __future__ import annotations

import contextlib
import os
import select
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from preemption.runtimes.base import RuntimePermanentError
from preemption.runtimes.local.folders import control_plane_folder
from preemption.runtimes.records import EXITS_FIFO


def watch_exits(root: Path, stop: threading.Event, on_exit: Callable[[list[int]], None]) -> None:
    """Call ``on_exit`` with the ids of the jobs whose ranks have just exited, until
    ``stop`` is set (base.ExitWatcher).

    Each keeper writes its job's id on a line of the runtime's exits pipe once its
    rank has exited (records.py); this reads them, so the control plane can look at
    those jobs at once rather than at its next periodic pass. Exits that arrive
    together are reported in one call; a line that is not a job's id makes it an
    empty list, which asks for a look at every job. The
    pipe is made here, the control plane's alone (0600 in a folder only it may
    list), and is refused if something else sits at its name.
    """
    control_plane_folder(root, 0o711)
    path = root / EXITS_FIFO
    with contextlib.suppress(FileExistsError):
        os.mkfifo(path, 0o600)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    # A writer of its own keeps the pipe open between keepers, so an idle pipe
    # reads as empty rather than at its end.
    writer: int | None = None
    try:
        found = os.fstat(reader)
        if not stat.S_ISFIFO(found.st_mode) or found.st_uid != os.geteuid():
            raise RuntimePermanentError(f"{path} is not this control plane's exits pipe")
        os.fchmod(reader, 0o600)
        writer = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        while not stop.is_set():
            ready, _, _ = select.select([reader], [], [], 0.5)
            if not ready:
                continue
            read = b""
            with contextlib.suppress(BlockingIOError):
                while chunk := os.read(reader, 4096):
                    read += chunk
            on_exit(_announced_jobs(read))
    finally:
        if writer is not None:
            os.close(writer)
        os.close(reader)


def _announced_jobs(lines: bytes) -> list[int]:
    """The job ids the keepers wrote on the exits pipe; an empty list (look at every
    job) when a line is not one, as a keeper of an older launcher writes a bare line."""
    jobs: set[int] = set()
    for line in lines.split(b"\n")[:-1]:
        if not line.isdigit() or len(line) > 18:
            return []
        jobs.add(int(line))
    return sorted(jobs)
