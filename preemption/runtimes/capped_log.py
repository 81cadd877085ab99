"""A rank's log on the local runtime, kept to a bounded size: its first bytes, its last
bytes, and one line between them that says how much was cut.

A rank runs a researcher's command, and nothing stops it from printing gigabytes: the
disk fills, and every reader of the log pays for its length. So the log keeps its head
(how the rank started, which says what it was) and its tail (how it ended, which says
why, and the trap's `QM_EVENT` lines, which come at the end), and drops the middle.

Why a pipe and a copier, not a file the rank writes itself. The rank's standard output
and error are a pipe whose reading end only its keeper holds, and the keeper copies what
arrives into `rank.log`, so the keeper is the log's only writer. Cutting the middle out
of a file another process appends to cannot be done exactly: a copy-then-truncate loses
whatever the rank appended in between, Linux's FALLOC_FL_COLLAPSE_RANGE works on some
filesystems only and in whole blocks, and a periodic check lets a fast rank fill the
disk between two looks. The pipe also hides the file from the rank, as the open file
did before (it cannot reach its records).

Why the rank's writes stay fast. The keeper reads the pipe in 1 MiB chunks, and widens
the pipe to 1 MiB where the kernel allows, so a rank writes into memory and waits only
when it outruns the disk, as it would writing the file itself. The one pause of the
keeper's own is a cut: once the part after the head reaches twice the tail, the keeper
writes the head, the cut line and the last `tail` bytes to a new file, in the kernel
(copy_file_range), and renames it over the log. That copies at most head + tail bytes
once for every `tail` bytes the rank wrote, so each byte costs about two copies at most,
and the pipe holds what the rank writes meanwhile.

What readers see. The head ends at a line's end and the tail starts at a line's start
(within 64 KiB of the exact cut, else the cut is exact), so no kept line is half a line
and a `QM_EVENT` line is kept whole or not at all. A live log may grow to head + 2 ×
tail before a cut; when the rank exits it is cut to head + tail plus the cut line, and
the keeper writes the exit record only after that, so whoever reads the log after the
exit reads its final form. The rename replaces the name, never an open file: a reader
that opened the log before a cut reads the old file to its end. A reader that follows
the log by offset sees offsets past the cut move back by what the cut dropped.

Once the rank has exited, the keeper takes what is left in the pipe and closes it: a
process the rank left behind that still writes gets EPIPE, as it would writing to a
closed terminal. A keeper that dies takes the pipe with it too, and its rank, which
nobody would record anymore, ends at its next write.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIB = 1 << 20
# How far from an exact cut the head's end or the tail's start may move to fall
# between two lines.
LINE_SLACK = 64 << 10
# How much the keeper reads from the pipe at once.
READ_CHUNK = MIB
# The pipe's size where the kernel allows it (fcntl's F_SETPIPE_SZ; Linux only).
PIPE_BYTES = MIB
F_SETPIPE_SZ = 1031
# What the keeper still takes from the pipe after the rank exited: what the rank wrote
# before it exited (at most a pipe's worth), and no endless stream from a process it
# left behind.
DRAIN_LIMIT = 4 * PIPE_BYTES


@dataclass(frozen=True)
class LogCap:
    """How much of a rank's log is kept: its first `head_bytes` and last `tail_bytes`."""

    head_bytes: int
    tail_bytes: int

    def record(self) -> dict[str, int]:
        """The form the gang record holds, which the keeper reads back."""
        return {"head_bytes": self.head_bytes, "tail_bytes": self.tail_bytes}

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None) -> LogCap:
        """The cap a gang record names; the default for a record written before caps."""
        if not record:
            return DEFAULT_LOG_CAP
        return cls(head_bytes=int(record["head_bytes"]), tail_bytes=int(record["tail_bytes"]))


DEFAULT_LOG_CAP = LogCap(head_bytes=64 * MIB, tail_bytes=64 * MIB)


def size_words(size: int) -> str:
    """A size as a person reads it: 64 MiB, 512 KiB, 1000 bytes."""
    for unit, name in ((1 << 30, "GiB"), (MIB, "MiB"), (1 << 10, "KiB")):
        if size >= unit and size % unit == 0:
            return f"{size // unit} {name}"
    return f"{size} bytes"


def cut_line(cut_bytes: int, cap: LogCap) -> bytes:
    """The line that stands where a log's middle was cut."""
    return (
        f"quartermaster: {cut_bytes} bytes of this log were cut here (the log keeps its "
        f"first {size_words(cap.head_bytes)} and last {size_words(cap.tail_bytes)})\n"
    ).encode()


class CappedLog:
    """A rank's log file, written only through `write`, that never keeps more than
    its cap's head and tail once closed (see the module docstring)."""

    def __init__(self, path: Path, cap: LogCap) -> None:
        self.path = path
        self.cap = cap
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        self._size = os.lseek(self._fd, 0, os.SEEK_END)
        # Once cut: where the head ends, and where what follows the cut line starts.
        self._head_end: int | None = None
        self._body_start = 0
        self._cut_bytes = 0

    @property
    def cut_bytes(self) -> int:
        """How many bytes of the rank's output were cut so far."""
        return self._cut_bytes

    def write(self, data: bytes) -> None:
        """Append `data`, then cut the middle if the log has grown past its live bound."""
        _write_all(self._fd, data)
        self._size += len(data)
        if self._over(slack=self.cap.tail_bytes):
            self._cut_middle()

    def close(self) -> None:
        """Cut the log to its cap, then close it."""
        try:
            if self._over(slack=0):
                self._cut_middle()
        finally:
            os.close(self._fd)

    def _over(self, *, slack: int) -> bool:
        kept_head = self._body_start if self._head_end is not None else self.cap.head_bytes
        return self._size - kept_head > self.cap.tail_bytes + slack

    def _cut_middle(self) -> None:
        source = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            if self._head_end is None:
                head_end = self._line_end_before(source, self.cap.head_bytes)
                kept_head = head_end
            else:
                head_end, kept_head = self._head_end, self._body_start
            tail_start = self._line_start_after(source, self._size - self.cap.tail_bytes)
            cut_bytes = self._cut_bytes + tail_start - kept_head
            note = cut_line(cut_bytes, self.cap)
            if head_end and os.pread(source, 1, head_end - 1) != b"\n":
                note = b"\n" + note
            staging = self.path.with_name(self.path.name + ".cut")
            target = os.open(
                staging,
                os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                0o600,
            )
            try:
                _copy_range(source, 0, head_end, target)
                _write_all(target, note)
                _copy_range(source, tail_start, self._size - tail_start, target)
                os.replace(staging, self.path)
            except BaseException:
                os.close(target)
                with contextlib.suppress(OSError):
                    os.unlink(staging)
                raise
        finally:
            os.close(source)
        os.close(self._fd)
        self._fd = target
        self._head_end = head_end
        self._body_start = head_end + len(note)
        self._size = self._body_start + self._size - tail_start
        self._cut_bytes = cut_bytes

    @staticmethod
    def _line_end_before(source: int, limit: int) -> int:
        """Just after the last newline at or before `limit`, if one is near; else `limit`."""
        start = max(0, limit - LINE_SLACK)
        window = os.pread(source, limit - start, start)
        newline = window.rfind(b"\n")
        return start + newline + 1 if newline >= 0 else limit

    @staticmethod
    def _line_start_after(source: int, start: int) -> int:
        """Just after the first newline at or after `start - 1`, if one is near; else
        `start` (a line that starts exactly at `start` is kept whole)."""
        window = os.pread(source, LINE_SLACK + 1, start - 1)
        newline = window.find(b"\n")
        return start + newline if newline >= 0 else start


def open_output_pipe() -> tuple[int, int]:
    """A pipe for a rank's output: (reading end, writing end), the reading end not
    inherited by the rank, the pipe widened where the kernel allows."""
    reading, writing = os.pipe2(os.O_CLOEXEC)
    # An unprivileged keeper may be held to the default size: a narrower pipe is
    # slower, not wrong.
    with contextlib.suppress(OSError):
        fcntl.fcntl(writing, F_SETPIPE_SZ, PIPE_BYTES)
    return reading, writing


def copy_until_exit(output: int, log: CappedLog, process: subprocess.Popen[bytes]) -> int:
    """Copy the rank's output from the pipe's reading end `output` into `log` until the
    rank exits, then what it left in the pipe; close `output`; the rank's return code.

    The rank's exit is watched through a pidfd where the kernel has them (Linux 5.3),
    else by looking every 0.2 s: the pipe alone cannot tell, since a process the rank
    left behind may hold it open long after the rank has gone.
    """
    try:
        exited: int | None = os.pidfd_open(process.pid)
    except (AttributeError, OSError):
        exited = None
    poller = select.poll()
    poller.register(output, select.POLLIN)
    if exited is not None:
        poller.register(exited, select.POLLIN)
    try:
        while True:
            ready = dict(poller.poll(None if exited is not None else 200))
            if output in ready:
                chunk = os.read(output, READ_CHUNK)
                if chunk:
                    log.write(chunk)
                else:
                    # Every writer has closed the pipe; only the exit is left to wait for.
                    poller.unregister(output)
            if exited in ready or process.poll() is not None:
                break
        returncode = process.wait()
        os.set_blocking(output, False)
        drained = 0
        while drained < DRAIN_LIMIT:
            try:
                chunk = os.read(output, READ_CHUNK)
            except BlockingIOError:
                break
            if not chunk:
                break
            log.write(chunk)
            drained += len(chunk)
        return returncode
    finally:
        if exited is not None:
            os.close(exited)
        os.close(output)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _copy_range(source: int, start: int, count: int, target: int) -> None:
    """Append `count` bytes of `source` from `start` to `target`: in the kernel where the
    filesystem allows, else through a 1 MiB buffer."""
    while count > 0:
        try:
            done = os.copy_file_range(source, target, count, start)
        except OSError as error:
            if error.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            done = len(part := os.pread(source, min(count, READ_CHUNK), start))
            _write_all(target, part)
        if done == 0:
            return
        start += done
        count -= done
