"""Finding a gang's live processes in one scan of the process table.

A process belongs to a rank by its process group or session, by the rank's
QM_RANK_DIR marker in its environment, or (sandboxed) by its cgroup. The scan only
reads the process table and the rank records; it never signals anything.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from preemption.runtimes import processes
from preemption.runtimes import sandbox as sandboxes
from preemption.runtimes.base import GangId
from preemption.runtimes.local.folders import gang_folder
from preemption.runtimes.records import KEEPER_FILE, RANK_DIR_ENV, STARTED_FILE, read_record


@dataclass(frozen=True, slots=True)
class GangProcess:
    """A live process that belongs to a gang: in a rank's process group or session, or
    carrying the rank's QM_RANK_DIR marker in its environment."""

    pid: int
    pgid: int
    sid: int
    rank: int
    cmdline: str


def processes_of(
    root: Path, records: Mapping[GangId, dict[str, Any]]
) -> dict[GangId, list[GangProcess]]:
    """Every live process of each gang (given with its record), from one scan of
    the process table.

    A process belongs to a rank when it is in the rank's process group or session
    (and started no earlier than the rank, so a reused pid is not mistaken for it), or
    when its environment carries the rank's QM_RANK_DIR marker, which catches children
    that started a session of their own. Where a reused process group number was
    recorded by ranks of two gangs, the process belongs to the later of them that
    started no later than it.
    """
    # Process group -> (rank's start, gang, rank), oldest first.
    groups: dict[int, list[tuple[float, GangId, int]]] = {}
    # Gang folder -> (gang, earliest start): every process of a rank started after
    # the rank's keeper, which recorded its own start before starting the rank, so
    # an older process cannot belong to the gang. (0, no bound, when no keeper has.)
    folders: dict[str, tuple[GangId, float]] = {}
    for gang, record in records.items():
        gang_dir = gang_folder(root, gang)
        starts: list[float] = []
        for rank in range(len(record["ranks"])):
            keeper = read_record(gang_dir / str(rank) / KEEPER_FILE)
            if keeper is not None:
                starts.append(float(keeper.get("created_at") or 0))
            started = read_record(gang_dir / str(rank) / STARTED_FILE)
            if started is not None:
                created = float(started.get("created_at") or 0)
                groups.setdefault(int(started["pgid"]), []).append((created, gang, rank))
                starts.append(created)
        folders[str(gang_dir)] = (gang, min(starts, default=0.0))
    found: dict[GangId, list[GangProcess]] = {gang: [] for gang in records}
    if not folders:
        return found
    # A sandboxed gang's cgroups hold every process it started, marker or not.
    members: dict[int, tuple[GangId, int]] = {}
    for gang, record in records.items():
        if record.get("sandbox") is not None:
            for pid, rank in sandboxes.pids(record["sandbox"]).items():
                members[pid] = (gang, rank)
    for owners in groups.values():
        owners.sort(key=lambda owner: owner[0])
    oldest = min(start for _, start in folders.values())
    table = list(processes.live_processes(skip=os.getpid()))
    leaders = {process.pid: process.created_at for process in table}
    for process in table:
        owner = members.get(process.pid) or _group_owner(groups, process, leaders)
        if owner is None and process.created_at >= oldest:
            owner = _marked_owner(folders, process)
        if owner is not None:
            found[owner[0]].append(
                GangProcess(
                    pid=process.pid,
                    pgid=process.pgid,
                    sid=process.sid,
                    rank=owner[1],
                    cmdline=processes.command_line(process.pid),
                )
            )
    return found


def _group_owner(
    groups: dict[int, list[tuple[float, GangId, int]]],
    process: processes.ProcessInfo,
    leaders: Mapping[int, float],
) -> tuple[GangId, int] | None:
    """The (gang, rank) whose process group or session the process is in.

    While a process holds the group's number as its pid (`leaders`: the live processes'
    creation times), the group is the rank's whose recorded leader it is, and nobody's
    when no rank recorded it: the number was reused for a stranger's group. Once the
    leader has exited the number stays with the group's other members, so they belong
    to the last rank that recorded it and started no later than the process.
    """
    for group in (process.pgid, process.sid):
        owner = None
        leader_created_at = leaders.get(group)
        for started, gang, rank in groups.get(group, ()):
            if leader_created_at is not None:
                # A start of 0 is a rank that exited before its start could be read, so
                # a live leader is never it.
                if started and processes.same_start(started, leader_created_at):
                    owner = (gang, rank)
            elif process.created_at >= started:
                owner = (gang, rank)
        if owner is not None:
            return owner
    return None


def _marked_owner(
    folders: dict[str, tuple[GangId, float]], process: processes.ProcessInfo
) -> tuple[GangId, int] | None:
    """The (gang, rank) whose QM_RANK_DIR marker (``<gang folder>/<rank>``) the process
    carries in its environment, if it started no earlier than that gang."""
    marker = processes.environ_value(process.pid, RANK_DIR_ENV)
    if marker is None:
        return None
    folder, _, tail = marker.rpartition(os.sep)
    entry = folders.get(folder)
    if entry is None or not tail.isdigit() or process.created_at < entry[1]:
        return None
    return entry[0], int(tail)
