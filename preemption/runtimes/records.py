"""The on-disk records of the local runtime, shared by the runtime and its launcher.

Layout under the runtime's root (`var/runs` by default)::

    <job_id>/<attempt>/gang.json         the launched spec, master port, each rank's GPU indices,
                                         who ranks run as, launch time
    <job_id>/<attempt>/forgotten.json    tombstone written by forget(); the gang is never relaunched
    <job_id>/<attempt>/launcher.log      stderr of the launcher processes
    <job_id>/<attempt>/<rank>/keeper.json   pid and start ticks of the process waiting on the rank
    <job_id>/<attempt>/<rank>/started.json  pid, process group, start ticks and start time of the rank
    <job_id>/<attempt>/<rank>/signal.json   when SIGTERM was asked for, and the grace window
    <job_id>/<attempt>/<rank>/term.sent     claim: whoever creates it delivers the SIGTERM
    <job_id>/<attempt>/<rank>/kill.json     when SIGKILL was asked for
    <job_id>/<attempt>/<rank>/exit.json     exit code (128+N for signal N), exit time, signal
    <job_id>/<attempt>/<rank>/rank.log      the rank's stdout and stderr
    <job_id>/<attempt>/<rank>/work/         the rank's private working folder (its HOME)
    gangs/<job_id>.<attempt>.<master_port>  one empty entry per gang launched and not yet
                                         forgotten: the runtime lists and the master ports
                                         it has promised, read with one directory listing
    gpus/<node>.lock                     one lock file per node, flocked while a launch picks
                                         the GPUs of its ranks there (gpu_slots.py)
    exits.fifo                           a named pipe, the control plane's only (0600): a
                                         keeper writes a line to it when its rank has exited,
                                         if someone listens (LocalRuntime.watch_exits)

Every JSON record is written to a temporary file and renamed into place, so a reader sees
either nothing or the whole record. Records that must be written once (the gang spec, the
SIGTERM claim) are linked into place, which fails when another writer got there first.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

GANG_FILE = "gang.json"
FORGOTTEN_FILE = "forgotten.json"
GANG_INDEX = "gangs"
EXITS_FIFO = "exits.fifo"
LAUNCHER_LOG = "launcher.log"
KEEPER_FILE = "keeper.json"
STARTED_FILE = "started.json"
SIGNAL_FILE = "signal.json"
TERM_SENT_FILE = "term.sent"
KILL_FILE = "kill.json"
EXIT_FILE = "exit.json"
RANK_LOG = "rank.log"
WORK_FOLDER = "work"

# Files forget() removes from a rank folder; the log stays.
RANK_RECORDS = (KEEPER_FILE, STARTED_FILE, SIGNAL_FILE, TERM_SENT_FILE, KILL_FILE, EXIT_FILE)

# The environment variable that marks every process of a rank, children included. It lets
# the orphan scan find processes that left the rank's process group or session.
RANK_DIR_ENV = "QM_RANK_DIR"


def _temporary_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _write_temporary(path: Path, record: dict[str, Any], *, durable: bool) -> Path:
    tmp = _temporary_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, json.dumps(record, sort_keys=True).encode())
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    return tmp


def write_record(path: Path, record: dict[str, Any], *, durable: bool = False) -> None:
    """Write a JSON record atomically, replacing any earlier one.

    `durable` also flushes it to disk; the launcher uses it for exit codes, which exist
    nowhere else once the rank's process has been reaped.
    """
    tmp = _write_temporary(path, record, durable=durable)
    os.replace(tmp, path)
    if durable:
        # The rename itself is durable only once the folder holding it is flushed.
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def create_record(path: Path, record: dict[str, Any]) -> bool:
    """Write a JSON record atomically unless one exists; True when this call wrote it."""
    tmp = _write_temporary(path, record, durable=False)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    return True


def create_claim(path: Path) -> bool:
    """Create an empty file unless it exists; True when this call created it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def read_record(path: Path) -> dict[str, Any] | None:
    """Read a JSON record, or None when it does not exist (yet)."""
    try:
        with open(path, "rb") as handle:
            record = json.loads(handle.read())
    except FileNotFoundError:
        return None
    if not isinstance(record, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return record
