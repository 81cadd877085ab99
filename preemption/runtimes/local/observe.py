"""A local rank's state, read from its records and the process table.

What a rank is (starting, running, terminating, exited, lost) follows from the
records its keeper wrote and whether the rank and its keeper still live. It only
reads; it never starts, signals or removes anything.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from preemption.runtimes import processes
from preemption.runtimes import sandbox as sandboxes
from preemption.runtimes.base import GangId, RankObservation
from preemption.runtimes.records import (
    EXIT_FILE,
    KEEPER_FILE,
    KILL_FILE,
    SIGNAL_FILE,
    STARTED_FILE,
    read_record,
)

# A rank folder with no keeper record this long after it was claimed belongs to a launch
# that died before starting the rank: nothing will ever start it.
LAUNCH_TIMEOUT_SECONDS = 30.0

# How long launch() waits for the launcher to fork its keepers.
LAUNCHER_TIMEOUT_SECONDS = 60.0

ENDED_PHASES = ("exited", "lost")


def observe_rank(
    gang: GangId, gang_dir: Path, placement: dict[str, Any], launched_at: float
) -> RankObservation:
    """One rank's observation, from the records in its folder under ``gang_dir``."""
    rank = int(placement["rank"])
    rank_dir = gang_dir / str(rank)
    signal_record = read_record(rank_dir / SIGNAL_FILE)
    exit_record = read_record(rank_dir / EXIT_FILE)
    started = read_record(rank_dir / STARTED_FILE)
    if exit_record is None:
        stopping = signal_record is not None or (rank_dir / KILL_FILE).exists()
        phase = _phase_without_exit(rank_dir, started, stopping, launched_at)
        if phase == "lost":
            # The keeper may have recorded the exit just before it went away.
            exit_record = read_record(rank_dir / EXIT_FILE)
            started = read_record(rank_dir / STARTED_FILE)
    if exit_record is not None:
        phase = "exited"
    return RankObservation(
        job_id=gang.job_id,
        attempt=gang.attempt,
        rank=rank,
        node=str(placement["node"]),
        phase=phase,
        exit_code=None if exit_record is None else int(exit_record["exit_code"]),
        handle="" if started is None else str(started["pid"]),
        started_at=None if started is None else float(started["started_at"]),
        exited_at=None if exit_record is None else float(exit_record["exited_at"]),
        signal_sent_at=(None if signal_record is None else float(signal_record["signal_sent_at"])),
        **_end_reason(exit_record),
    )


def _phase_without_exit(
    rank_dir: Path, started: dict[str, Any] | None, stopping: bool, launched_at: float
) -> str:
    live_phase = "terminating" if stopping else "running"
    if started is not None and processes.is_alive(int(started["pid"]), started.get("created_at")):
        return live_phase
    keeper = read_record(rank_dir / KEEPER_FILE)
    if keeper is not None and processes.is_alive(int(keeper["pid"]), keeper.get("created_at")):
        # Either the rank is about to start, or it has just exited and its keeper is
        # writing the exit record.
        if started is None:
            return "terminating" if stopping else "starting"
        return live_phase
    if keeper is None and started is None:
        # Not started by anyone yet: a launch may be under way (the rank folder is
        # claimed, or not even that), so only a launch this old counts as failed.
        try:
            claimed_at = rank_dir.stat().st_mtime
        except FileNotFoundError:
            claimed_at = launched_at
        if time.time() - claimed_at < LAUNCH_TIMEOUT_SECONDS:
            return "terminating" if stopping else "starting"
    return "lost"


def _end_reason(exit_record: dict[str, Any] | None) -> dict[str, Any]:
    """The observation's end_reason and memory_limit from the rank's exit record: the
    reasons the runtime knows only (an exit record the rank's keeper wrote, never the
    rank)."""
    if exit_record is None or exit_record.get("reason") != sandboxes.OUT_OF_MEMORY:
        return {}
    limit = exit_record.get("memory_limit")
    return {
        "end_reason": sandboxes.OUT_OF_MEMORY,
        "memory_limit": int(limit) if isinstance(limit, int) else None,
    }
