"""Process inspection for the local runtime and the drills, through psutil.

A pid alone does not identify a process, since pids are reused; a pid together with the
process's creation time does, so records keep both and every liveness check compares
them. The creation time is psutil's: the start in clock ticks since boot plus the boot
time, which the kernel derives from the wall clock and psutil reads anew on every call.
A stepped or slewed clock therefore moves the same process's creation time by a second
or more between the record and a later check, so the check allows that much; a pid is
only reused once the pid space has wrapped, never within seconds of the first start.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import psutil

ZOMBIE_STATES = frozenset({psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD})
# How far a live process's creation time may read from its record (see above).
CREATED_AT_TOLERANCE_SECONDS = 2.0
# The errors psutil raises for a process that exited meanwhile or is not ours to read.
GONE_OR_DENIED = (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError, PermissionError)


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """What the runtime needs to know of one live process."""

    pid: int
    pgid: int
    sid: int
    created_at: float


def created_at(pid: int) -> float | None:
    """When a process was created (seconds since the epoch), or None when it is gone."""
    try:
        return float(psutil.Process(pid).create_time())
    except GONE_OR_DENIED:
        return None


def same_start(recorded: float, read: float) -> bool:
    """True when a creation time read now is the one recorded (see the module docstring)."""
    return abs(read - recorded) <= CREATED_AT_TOLERANCE_SECONDS


def group_is_recorded(pgid: int, leader_created_at: float | None) -> bool:
    """False when the recorded process group's number now leads another group.

    The kernel keeps a process group's number while any member lives, so a group whose
    leader exited still holds the same number; once the group is empty the number may
    go to a new process, which then leads a group of its own under it. Signalling the
    recorded number would then reach that stranger's group. A leader recorded without a
    creation time had already exited when it was recorded, so any process under its
    number now is a stranger.
    """
    try:
        created_at = psutil.Process(pgid).create_time()
    except GONE_OR_DENIED:
        return True
    return leader_created_at is not None and same_start(leader_created_at, created_at)


def is_alive(pid: int, expected_created_at: float | None) -> bool:
    """True while the process with this pid (and creation time, when given) runs and is
    not a zombie."""
    try:
        process = psutil.Process(pid)
        if process.status() in ZOMBIE_STATES:
            return False
        return expected_created_at is None or same_start(expected_created_at, process.create_time())
    except GONE_OR_DENIED:
        return False


def live_processes(skip: int | None = None) -> Iterator[ProcessInfo]:
    """Every live, non-zombie process at the moment of the call, with its process group
    and session (which psutil does not expose, so os.getpgid and os.getsid are asked)."""
    for process in psutil.process_iter(["status", "create_time"]):
        if process.pid == skip or process.info["status"] in ZOMBIE_STATES:
            continue
        try:
            pgid, sid = os.getpgid(process.pid), os.getsid(process.pid)
        except GONE_OR_DENIED:
            continue
        created = process.info["create_time"]
        if created is None:
            continue
        yield ProcessInfo(pid=process.pid, pgid=pgid, sid=sid, created_at=float(created))


def environ_value(pid: int, name: str) -> str | None:
    """The value of one environment variable of a process as it was started, if readable."""
    try:
        return psutil.Process(pid).environ().get(name)
    except GONE_OR_DENIED:
        return None


def command_line(pid: int) -> str:
    """The command line of a process, arguments joined by spaces ("" when unreadable)."""
    try:
        return " ".join(psutil.Process(pid).cmdline()).strip()
    except GONE_OR_DENIED:
        return ""


def listening_ports(pid: int) -> set[int]:
    """The TCP ports (IPv4 and IPv6) a process listens on."""
    try:
        connections = psutil.Process(pid).net_connections(kind="tcp")
    except GONE_OR_DENIED:
        return set()
    return {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN and c.laddr}
