"""Small readers of Linux /proc: process identity, process groups and listening sockets.

A pid alone does not identify a process, since pids are reused; a pid together with the
process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat) does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TCP_LISTEN_STATE = "0A"


@dataclass(frozen=True, slots=True)
class ProcessStat:
    """The fields of /proc/<pid>/stat this package needs."""

    pid: int
    state: str
    ppid: int
    pgid: int
    sid: int
    start_ticks: int

    @property
    def is_zombie(self) -> bool:
        """True for a process that has exited and waits to be reaped (or is being torn down)."""
        return self.state in ("Z", "X", "x")


def read_stat(pid: int) -> ProcessStat | None:
    """The stat of a process, or None when no such process exists."""
    try:
        with open(PROC / str(pid) / "stat", "rb") as handle:
            raw = handle.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name sits in parentheses and may itself hold spaces and parentheses,
    # so the fields are counted from the last closing parenthesis.
    fields = raw[raw.rfind(")") + 2 :].split()
    return ProcessStat(
        pid=pid,
        state=fields[0],
        ppid=int(fields[1]),
        pgid=int(fields[2]),
        sid=int(fields[3]),
        start_ticks=int(fields[19]),
    )


def start_ticks(pid: int) -> int | None:
    """The start time of a process in clock ticks since boot, or None when it is gone."""
    stat = read_stat(pid)
    return None if stat is None else stat.start_ticks


def is_alive(pid: int, expected_start_ticks: int | None) -> bool:
    """True while the process with this pid and start time runs and is not a zombie."""
    stat = read_stat(pid)
    if stat is None or stat.is_zombie:
        return False
    return expected_start_ticks is None or stat.start_ticks == expected_start_ticks


def iter_pids() -> Iterator[int]:
    """Every pid in /proc at the moment of the call."""
    for entry in os.scandir(PROC):
        if entry.name.isdigit():
            yield int(entry.name)


def read_environ_value(pid: int, name: str) -> str | None:
    """The value of one environment variable of a process as it was started, if readable."""
    prefix = name.encode() + b"="
    try:
        with open(PROC / str(pid) / "environ", "rb") as handle:
            environ = handle.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def read_cmdline(pid: int) -> str:
    """The command line of a process, arguments joined by spaces ("" when unreadable)."""
    try:
        with open(PROC / str(pid) / "cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets a process holds open."""
    inodes: set[int] = set()
    try:
        entries = list(os.scandir(PROC / str(pid) / "fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        return inodes
    for entry in entries:
        try:
            target = os.readlink(entry.path)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def listening_tcp_ports() -> dict[int, int]:
    """Map the inode of every listening TCP socket (IPv4 and IPv6) to its port."""
    ports: dict[int, int] = {}
    for table in ("tcp", "tcp6"):
        try:
            with open(PROC / "net" / table) as handle:
                lines = handle.readlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != TCP_LISTEN_STATE:
                continue
            port = int(fields[1].rsplit(":", 1)[1], 16)
            ports[int(fields[9])] = port
    return ports
