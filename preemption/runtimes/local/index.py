"""The index of a local runtime's live gangs: which gangs exist and their master ports.

``<root>/gangs/`` holds an empty file ``<job>.<attempt>.<master port>`` for each gang
launched and not yet forgotten (records.py), so a question about every gang costs
one listing rather than a walk through every job folder. It reads and lists; it
never starts or signals a process.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from preemption.runtimes.base import GangId
from preemption.runtimes.local.folders import gang_folder
from preemption.runtimes.records import GANG_FILE, GANG_INDEX, create_claim, read_record


def index_entry(gang: GangId, master_port: int) -> str:
    """The name of a gang's entry in the index."""
    return f"{gang.job_id}.{gang.attempt}.{master_port}"


def known_gangs(root: Path) -> list[GangId]:
    """The gangs launched and not yet forgotten, from the index."""
    if not root.is_dir():
        return []
    return sorted(
        (gang for gang in listed_gangs(root) if (gang_folder(root, gang) / GANG_FILE).exists()),
        key=lambda gang: (gang.job_id, gang.attempt),
    )


def listed_gangs(root: Path) -> dict[GangId, int]:
    """Each gang in the index, with the master port it was promised."""
    listed: dict[GangId, int] = {}
    for name in os.listdir(gang_index(root)):
        parts = name.split(".")
        if len(parts) == 3 and all(part.isdigit() for part in parts):
            listed[GangId(job_id=int(parts[0]), attempt=int(parts[1]))] = int(parts[2])
    return listed


def gang_index(root: Path) -> Path:
    """The index of gangs, made from a scan of every job folder if the root has none.

    Every launch and every pass of the reconciler asks which gangs exist and which
    ports they hold; the folder of every job ever run would take a walk through
    thousands of folders for that, and the index takes one listing. A root written
    before the index existed is listed once, in a folder of this process's own that
    is then renamed into place: a process that loses that race keeps the winner's
    index, which is never empty (its marker file stops a rename from replacing it).
    """
    index = root / GANG_INDEX
    if index.is_dir():
        return index
    building = root / f".{GANG_INDEX}.{os.getpid()}.{secrets.token_hex(4)}"
    building.mkdir(mode=0o700)
    try:
        create_claim(building / ".built")
        for gang in _scan_gangs(root):
            record = read_record(gang_folder(root, gang) / GANG_FILE)
            if record is not None:
                create_claim(building / index_entry(gang, int(record["master_port"])))
        try:
            os.rename(building, index)
        except OSError:
            if not index.is_dir():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return index


def _scan_gangs(root: Path) -> list[GangId]:
    """Every gang with a record, found by walking every job folder."""
    gangs: list[GangId] = []
    for job_dir in root.iterdir():
        if not job_dir.name.isdigit() or not job_dir.is_dir():
            continue
        for attempt_dir in job_dir.iterdir():
            if attempt_dir.name.isdigit() and (attempt_dir / GANG_FILE).exists():
                gangs.append(GangId(job_id=int(job_dir.name), attempt=int(attempt_dir.name)))
    return sorted(gangs, key=lambda gang: (gang.job_id, gang.attempt))
