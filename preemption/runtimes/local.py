"""The local runtime: every rank a real OS process on this machine.

Each rank runs in its own session and process group, started by a keeper process (see
launcher.py) that waits on it and records its pid, start time and exit code on disk under
`<root>/<job_id>/<attempt>/<rank>/` (layout in records.py). The runtime object holds no
state of its own: a fresh LocalRuntime over the same root, in another process or after a
restart, observes exactly what the previous one did. Nodes are virtual: they come from a
configured inventory and label the ranks. Each rank is given GPU indices of its node that
no other live gang there holds, recorded in gang.json, and sees only those through
CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES (gpu_slots.py).

Isolation. A rank runs a researcher's command, so it must not reach the control plane's
secret key, database or processes, nor another job's files. Given a runner account (see
runner.py: one unprivileged user, plus a group id of the job's own), the keeper stays
root, so it can record and signal as before, and drops privileges only for the rank:
the rank runs as the runner user with the job's group as its only group, umask 077,
no way back to privileges through setuid programs (PR_SET_NO_NEW_PRIVS), `HOME`,
`TMPDIR` and working folder set to its private folder, and an environment built from
scratch (launcher.rank_environment). The folders, all made by this runtime:

    <root>/                           control plane, 0711: nobody else may list the jobs
    <root>/gangs/                     control plane, 0700: the index of live gangs and
                                      their master ports (records.py)
    <root>/gpus/                      control plane, 0700: a lock file per node, held
                                      while a launch picks its GPUs (gpu_slots.py)
    <root>/<job>/                     control plane, group = the job's, 0710: the job's
                                      ranks may pass through it, no other job's may
    <root>/<job>/<attempt>/           control plane, 0711: gang.json (which holds the
                                      job's events token) and launcher.log are 0600
    <root>/<job>/<attempt>/<rank>/    control plane, 0711: the records and rank.log are
                                      0600; the rank writes into a pipe that its keeper
                                      copies into the log, keeping its head and tail
                                      (capped_log.py), so the rank cannot forge its
                                      records nor fill the disk
    .../<rank>/work/                  the job's user and group, 0700: the private
                                      folder the rank works in
    $QM_CHECKPOINT_DIR                control plane, group = the job's, 0770: the ranks
                                      of every attempt of the job write checkpoints there;
                                      the control plane (root) reads them
    <root>/<job>/<attempt>/preemption-mtbp
                                      control plane, group = the job's, 0640: the cadence
                                      hint (QM_PREEMPTION_MTBP_FILE), replaced by rename

The cadence hint is written by the control plane, which runs as root, into a folder a
job's rank can pass through but not write; it is written through folder descriptors
opened without following links, each checked to be the control plane's own, under a
fresh name created exclusively, then renamed over the old file (a rename replaces a
link in its place, never the file a link points to). So neither a link planted in
the gang's path nor one at the file's name can turn the write to another job's files.

Every job's ranks run as a uid and gid of the job's own (runner.py), so another job's
rank is neither the owner nor in the group of `<root>/<job>/` or of the checkpoint
folder, and the kernel refuses it at the door, whatever lies behind. The same ids keep
jobs out of each other's processes: the kernel lets one process read another's
/proc/<pid>/environ (where the events token is) only when uid and gid both match, and
an unprivileged process may signal only processes of its own uid. The control plane's
own processes run as another uid altogether. What remains shared is the host network
and world-writable places such as /tmp (a rank's TMPDIR is its own folder); where
tenants must not be able to disturb each other at all, the Kubernetes runtime puts every
rank in a container of its own.

Running ranks as another user needs root: the keeper switches uid and gid, folders are
handed to a job's group, and the control plane signals and inspects processes of
another uid. (The capabilities that adds up to, CAP_SETUID, CAP_SETGID, CAP_CHOWN,
CAP_FOWNER, CAP_KILL, CAP_DAC_READ_SEARCH and CAP_SYS_PTRACE, are most of root anyway,
so root is the one setup supported and tested; runner.find_runner checks for it.) Without a runner account the ranks run as the control plane's user, in the
same folders and with the same clean environment; `preemption.runtime` refuses that in
production and warns once elsewhere. The ranks must be able to reach the Python interpreter
and the code the commands name, as any other user; `bin/runner-user` checks that with
the runner account and grants it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import secrets
import select
import shutil
import signal as signals
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from preemption.runtimes import gpu_slots, processes
from preemption.runtimes import sandbox as sandboxes
from preemption.runtimes.base import (
    MTBP_FILE_ENV,
    GangGuard,
    GangId,
    GangSpec,
    NodeInventory,
    RankObservation,
    RuntimePermanentError,
    RuntimeTemporaryError,
    mtbp_text,
    os_errors_are_temporary,
    translate_errors,
)
from preemption.runtimes.capped_log import DEFAULT_LOG_CAP, LogCap
from preemption.runtimes.launcher import inherited_environment
from preemption.runtimes.records import (
    EXIT_FILE,
    EXITS_FIFO,
    FORGOTTEN_FILE,
    GANG_FILE,
    GANG_INDEX,
    KEEPER_FILE,
    KILL_FILE,
    LAUNCHER_LOG,
    RANK_DIR_ENV,
    RANK_LOG,
    RANK_RECORDS,
    SIGNAL_FILE,
    STARTED_FILE,
    TERM_SENT_FILE,
    create_claim,
    create_record,
    read_record,
    write_record,
)
from preemption.runtimes.runner import RunnerAccount

logger = logging.getLogger(__name__)
_warned_without_sandbox = False

# The folder that holds the `preemption` package: the launcher is started there so that
# `python -m preemption.runtimes.launcher` imports this very code. Ranks run in their
# own folders, never here.
PROJECT_ROOT = Path(__file__).resolve().parents[2]

# A rank folder with no keeper record this long after it was claimed belongs to a launch
# that died before starting the rank: nothing will ever start it.
LAUNCH_TIMEOUT_SECONDS = 30.0

# How long launch() waits for the launcher to fork its keepers.
LAUNCHER_TIMEOUT_SECONDS = 60.0

ENDED_PHASES = ("exited", "lost")

# The notice signal the rank's shell wrapper survives (launcher.SHELL_PREFIX traps it).
NOTICE_SIGNALS = frozenset({"SIGUSR2"})

# The lowest master port the runtime picks (see LocalRuntime._choose_master_port).
MASTER_PORT_FLOOR = 20000

# The cadence hint's file in the gang's folder (QM_PREEMPTION_MTBP_FILE).
MTBP_FILE = "preemption-mtbp"


@dataclass(frozen=True, slots=True)
class GangProcess:
    """A live process that belongs to a gang: in a rank's process group or session, or
    carrying the rank's QM_RANK_DIR marker in its environment."""

    pid: int
    pgid: int
    sid: int
    rank: int
    cmdline: str


@translate_errors(os_errors_are_temporary)
class LocalRuntime:
    """Runs gangs as local process groups; implements the Runtime protocol."""

    name = "local"
    # A local rank ends only by itself or by the control plane's own signal.
    gang_guard: GangGuard | None = None
    # The checkpoint notice reaches a rank as the signal its trap announced.
    notice_delivery = "signal"

    def __init__(
        self,
        root: Path,
        inventory: Sequence[NodeInventory],
        python: str = sys.executable,
        master_addr: str = "127.0.0.1",
        runner: RunnerAccount | None = None,
        sandbox: sandboxes.SandboxConfig | None = None,
        log_cap: LogCap = DEFAULT_LOG_CAP,
    ) -> None:
        # An absolute root, since the launcher and the ranks run in another folder and
        # the orphan scan compares the QM_RANK_DIR marker as a string.
        self.root = Path(root).resolve()
        self.inventory = list(inventory)
        self.python = python
        self.master_addr = master_addr
        # Who ranks run as; None runs them as this process's own user (see the docstring).
        self.runner = runner
        # Whether ranks run in a sandbox (sandbox.py); None never makes one.
        self.sandbox = sandbox
        # How much of each rank's log its keeper keeps (capped_log.py).
        self.log_cap = log_cap

    def watch_exits(self, stop: threading.Event, on_exit: Callable[[list[int]], None]) -> None:
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
        _control_plane_folder(self.root, 0o711)
        path = self.root / EXITS_FIFO
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

    # ----------------------------------------------------------------- the protocol

    def launch(self, spec: GangSpec) -> None:
        """Start every rank of the gang, each under its own keeper.

        Idempotent and safe against a concurrent launch: each rank is claimed by creating
        its folder, so a rank is started at most once, and a launch that died halfway is
        completed by the next one. A forgotten gang is never launched again.
        """
        self._validate(spec)
        sandboxed = self._sandboxed()
        gang_dir = self.gang_dir(spec.gang)
        if (gang_dir / FORGOTTEN_FILE).exists():
            return
        claimed: list[int] = []
        try:
            self._prepare_folders(spec)
            index = self._gang_index()
            if not (gang_dir / GANG_FILE).exists():
                # The first launch picks the master port and the GPUs; a concurrent one
                # loses the race to write the record and uses the winner's.
                self._record_gang(spec, sandboxed, index)
            if spec.mtbp_seconds is not None:
                self.publish_preemption_risk(spec.gang, spec.mtbp_seconds, team=spec.team)
            launched = read_record(gang_dir / GANG_FILE)
            if launched is not None and not _same_gang(launched, spec):
                # The same (job, attempt) launched with another command or placement
                # means ids were reused over an old root: starting nothing and observing
                # the old gang would mislead the control plane.
                raise RuntimePermanentError(
                    f"gang {spec.gang} was already launched under {gang_dir} "
                    "with another command, placement or checkpoint folder"
                )
            if launched is not None:
                # Listed before any keeper starts, so a gang with a live rank is listed.
                create_claim(index / _index_entry(spec.gang, int(launched["master_port"])))
            for placement in spec.ranks:
                try:
                    (gang_dir / str(placement.rank)).mkdir(mode=0o700)
                except FileExistsError:
                    continue
                claimed.append(placement.rank)
                if self.runner is not None:
                    # The rank passes through to its work folder; its records stay 0600.
                    os.chmod(gang_dir / str(placement.rank), 0o711)
        except OSError as error:
            self._release_claims(gang_dir, claimed)
            raise RuntimeTemporaryError(f"cannot prepare {gang_dir}: {error}") from error
        if claimed:
            self._start_keepers(gang_dir, claimed)

    def signal(self, gang: GangId, grace_seconds: float) -> None:
        """Send SIGTERM to every rank's process group at once, each exactly once.

        The requests are recorded first, then the signals go out in one tight loop, so
        the last rank hears it microseconds after the first rather than after the file
        writes of every rank before it. A rank whose process has not started yet gets the
        signal from its keeper, which checks for the request right after starting it (and
        does not start a rank asked to stop before it began).
        """
        gang_dir = self.gang_dir(gang)
        record = read_record(gang_dir / GANG_FILE)
        if record is None:
            return
        sent_at = time.time()
        groups: list[int] = []
        try:
            for rank in range(len(record["ranks"])):
                rank_dir = gang_dir / str(rank)
                if not rank_dir.is_dir() or (rank_dir / EXIT_FILE).exists():
                    continue
                requested = create_record(
                    rank_dir / SIGNAL_FILE,
                    {"signal_sent_at": sent_at, "grace_seconds": grace_seconds},
                )
                if not requested:
                    continue
                pgid = _recorded_group(read_record(rank_dir / STARTED_FILE))
                if pgid is not None and create_claim(rank_dir / TERM_SENT_FILE):
                    groups.append(pgid)
        except OSError as error:
            raise RuntimeTemporaryError(f"cannot signal gang {gang}: {error}") from error
        finally:
            # Ranks already claimed must get their signal even when a later rank failed:
            # nobody else will send it.
            for pgid in groups:
                _signal_group(pgid, signals.SIGTERM)

    def notice(self, gang: GangId, signal_name: str) -> None:
        """Send the checkpoint notice signal to every started, live rank's process group.

        Unlike SIGTERM it is neither recorded nor claimed: a repeat is harmless (the
        trap treats copies within a second of its answer as the same notice), and a
        rank that has not started yet has nothing to checkpoint.
        """
        if signal_name not in NOTICE_SIGNALS:
            raise RuntimePermanentError(
                f"{signal_name!r} is not a notice signal this runtime sends "
                f"({', '.join(sorted(NOTICE_SIGNALS))})"
            )
        signum = getattr(signals, signal_name)
        gang_dir = self.gang_dir(gang)
        record = read_record(gang_dir / GANG_FILE)
        if record is None:
            return
        groups: list[int] = []
        for rank in range(len(record["ranks"])):
            rank_dir = gang_dir / str(rank)
            if not rank_dir.is_dir() or (rank_dir / EXIT_FILE).exists():
                continue
            pgid = _recorded_group(read_record(rank_dir / STARTED_FILE))
            if pgid is not None:
                groups.append(pgid)
        # Read every record first, then signal in one tight loop, as signal() does.
        for pgid in groups:
            _signal_group(pgid, signum)

    def kill(self, gang: GangId) -> None:
        """SIGKILL every live rank's process group and every leftover process of the gang."""
        gang_dir = self.gang_dir(gang)
        record = read_record(gang_dir / GANG_FILE)
        if record is None:
            return
        try:
            for rank in range(len(record["ranks"])):
                rank_dir = gang_dir / str(rank)
                if not rank_dir.is_dir() or (rank_dir / EXIT_FILE).exists():
                    continue
                create_record(rank_dir / KILL_FILE, {"kill_sent_at": time.time()})
                pgid = _recorded_group(read_record(rank_dir / STARTED_FILE))
                if pgid is not None:
                    _signal_group(pgid, signals.SIGKILL)
            if record.get("sandbox") is not None:
                # Every process the gang started, whatever group or session it made:
                # none can leave its rank's cgroup or PID namespace, so nothing is left
                # for a scan of the process table to find.
                sandboxes.kill(record["sandbox"])
                return
        except OSError as error:
            raise RuntimeTemporaryError(f"cannot kill gang {gang}: {error}") from error
        # Without a sandbox, children that left their rank's process group, or outlived a
        # rank that already exited, would otherwise hold GPUs and ports forever.
        for process in self.gang_processes(gang):
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signals.SIGKILL)

    def observe(self, gang: GangId | None = None) -> list[RankObservation]:
        """Observe the ranks of one gang, or of every gang under the root.

        Reads only the records on disk and the process table, so it is correct from any process.
        """
        gangs = [gang] if gang is not None else self._known_gangs()
        observations: list[RankObservation] = []
        for known in gangs:
            gang_dir = self.gang_dir(known)
            record = read_record(gang_dir / GANG_FILE)
            if record is None:
                continue
            for placement in record["ranks"]:
                observations.append(
                    self._observe_rank(known, gang_dir, placement, float(record["launched_at"]))
                )
        return observations

    def nodes(self) -> list[NodeInventory]:
        """The configured inventory of virtual nodes."""
        return list(self.inventory)

    def read_log(self, gang: GangId, rank: int, offset: int = 0, limit: int = 1 << 20) -> bytes:
        """Up to `limit` bytes of the rank's log from byte `offset`.

        A rank of the gang that has not written anything yet has an empty log; a rank the
        runtime never heard of is a permanent error.
        """
        if offset < 0 or limit < 0:
            raise RuntimePermanentError(f"bad log range: offset {offset}, limit {limit}")
        gang_dir = self.gang_dir(gang)
        rank_dir = gang_dir / str(rank)
        if not rank_dir.is_dir():
            record = read_record(gang_dir / GANG_FILE)
            if record is not None and 0 <= rank < len(record["ranks"]):
                return b""
            raise RuntimePermanentError(f"gang {gang} has no rank {rank} on this runtime")
        try:
            with open(rank_dir / RANK_LOG, "rb") as log:
                log.seek(offset)
                return log.read(limit)
        except FileNotFoundError:
            return b""

    def read_log_end(self, gang: GangId, rank: int, max_bytes: int) -> tuple[bytes, int]:
        """The last `max_bytes` of the rank's log and the offset they start at, read by
        seeking from its end: a failed rank's last lines cost the same however long
        it wrote. The same refusals as `read_log` (which this asks for nothing first)."""
        if max_bytes < 0:
            raise RuntimePermanentError(f"bad log tail: {max_bytes} bytes")
        self.read_log(gang, rank, 0, 0)
        try:
            with open(self.gang_dir(gang) / str(rank) / RANK_LOG, "rb") as log:
                end = log.seek(0, os.SEEK_END)
                start = max(0, end - max_bytes)
                log.seek(start)
                return log.read(end - start), start
        except FileNotFoundError:
            return b"", 0

    def released_ports(self, gangs: Sequence[GangId]) -> dict[GangId, list[int]]:
        """Each gang's ports still bound: [] when the gang left nothing behind.

        Two independent checks: the master port must accept a fresh bind, and no process
        of the gang may hold a listening TCP socket on any port. One scan of the process
        table serves every gang of the call.
        """
        records = self._gang_records(gangs)
        found = self._processes_of(records)
        released: dict[GangId, list[int]] = {gang: [] for gang in gangs}
        for gang, record in records.items():
            bound: set[int] = set()
            master_port = int(record["master_port"])
            if not _port_is_free(master_port):
                bound.add(master_port)
            for process in found[gang]:
                bound |= processes.listening_ports(process.pid)
            released[gang] = sorted(bound)
        return released

    def forget(self, gang: GangId) -> None:
        """Drop the records of a finished gang, keep its logs, and never launch it again."""
        gang_dir = self.gang_dir(gang)
        record = read_record(gang_dir / GANG_FILE)
        if record is None:
            return
        live = [o.rank for o in self.observe(gang) if o.phase not in ENDED_PHASES]
        if live:
            raise RuntimePermanentError(f"gang {gang} still has live ranks {live}")
        if record.get("sandbox") is not None:
            sandboxes.release(record["sandbox"])
        write_record(gang_dir / FORGOTTEN_FILE, {"forgotten_at": time.time()})
        # Unlisted before its record goes: a forget cut short here is completed by the
        # next one, which still finds the record.
        (self.root / GANG_INDEX / _index_entry(gang, int(record["master_port"]))).unlink(
            missing_ok=True
        )
        for rank in range(len(record["ranks"])):
            for name in RANK_RECORDS:
                (gang_dir / str(rank) / name).unlink(missing_ok=True)
        (gang_dir / GANG_FILE).unlink(missing_ok=True)

    def publish_preemption_risk(self, gang: GangId, mtbp_seconds: float, *, team: str) -> None:
        """Write the gang's cadence hint file (see the module docstring), unless it
        already says the same."""
        del team  # one root holds every team's gangs
        text = mtbp_text(mtbp_seconds).encode()
        gid = None if self.runner is None else self.runner.job_gid(gang.job_id)
        folder = _open_control_plane_path(self.root, (str(gang.job_id), str(gang.attempt)))
        try:
            with contextlib.suppress(OSError):
                current = os.open(MTBP_FILE, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder)
                try:
                    if os.read(current, 64) == text:
                        return
                finally:
                    os.close(current)
            temporary = f".{MTBP_FILE}.{os.getpid()}.{random.getrandbits(32):08x}"
            # O_EXCL never follows a link at the name: the file is a new one of ours.
            out = os.open(
                temporary,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                0o600,
                dir_fd=folder,
            )
            try:
                try:
                    if gid is not None:
                        os.fchown(out, -1, gid)
                    os.fchmod(out, 0o600 if gid is None else 0o640)
                    os.write(out, text)
                finally:
                    os.close(out)
                os.replace(temporary, MTBP_FILE, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary, dir_fd=folder)
                raise
        finally:
            os.close(folder)

    # ------------------------------------------------------------- beyond the protocol

    def gang_dir(self, gang: GangId) -> Path:
        """The folder holding the gang's records and logs."""
        return self.root / str(gang.job_id) / str(gang.attempt)

    def gang_processes(self, gang: GangId) -> list[GangProcess]:
        """Every live process of the gang, found by scanning the process table (see
        `_processes_of`)."""
        return self._processes_of(self._gang_records([gang])).get(gang, [])

    def _gang_records(self, gangs: Sequence[GangId]) -> dict[GangId, dict[str, Any]]:
        """The gang record of each gang the runtime still knows."""
        records = {gang: read_record(self.gang_dir(gang) / GANG_FILE) for gang in gangs}
        return {gang: record for gang, record in records.items() if record is not None}

    def _processes_of(
        self, records: Mapping[GangId, dict[str, Any]]
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
            gang_dir = self.gang_dir(gang)
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

    def find_orphans(self, gang: GangId) -> list[GangProcess]:
        """Live processes of ranks that have already exited or been lost.

        After a gang has ended this must be empty; the chaos drill checks it.
        """
        ended = {o.rank for o in self.observe(gang) if o.phase in ENDED_PHASES}
        return [process for process in self.gang_processes(gang) if process.rank in ended]

    # ---------------------------------------------------------------------- internals

    def _validate(self, spec: GangSpec) -> None:
        if not spec.command.strip():
            raise RuntimePermanentError(f"gang {spec.gang} has an empty command")
        if not spec.ranks:
            raise RuntimePermanentError(f"gang {spec.gang} has no ranks")
        numbers = sorted(placement.rank for placement in spec.ranks)
        if numbers != list(range(len(spec.ranks))):
            raise RuntimePermanentError(
                f"gang {spec.gang} must number its ranks 0..{len(spec.ranks) - 1}, got {numbers}"
            )
        if self.runner is not None:
            try:
                self.runner.job_gid(spec.job_id)
            except ValueError as error:
                raise RuntimePermanentError(str(error)) from error
        known = {node.name for node in self.inventory}
        unknown = sorted({p.node for p in spec.ranks if p.node not in known})
        if unknown:
            raise RuntimePermanentError(
                f"gang {spec.gang} is placed on nodes not in the inventory: {unknown}"
            )

    def _sandboxed(self) -> bool:
        """Whether this launch makes a sandbox: always with QM_LOCAL_SANDBOX=on (a
        machine that cannot make one refuses the launch), where the machine can with
        `auto` (else a warning, once per process, says why not), never with `off`."""
        if self.sandbox is None or self.sandbox.mode == "off":
            return False
        found = sandboxes.support()
        if found.available:
            return True
        if self.sandbox.mode == "on":
            raise RuntimePermanentError(
                f"QM_LOCAL_SANDBOX=on, and this machine cannot sandbox ranks: {found.reason}"
            )
        global _warned_without_sandbox
        if not _warned_without_sandbox:
            _warned_without_sandbox = True
            logger.warning(
                "ranks of the local runtime run without a sandbox (they can see every "
                "process and reach every port of this host, with no limits): %s",
                found.reason,
            )
        return False

    def _record_gang(self, spec: GangSpec, sandboxed: bool, index: Path) -> None:
        """Write the gang's record, with the GPUs of each rank, and list it in the index.

        Under the GPU locks of the gang's nodes (gpu_slots.py), from reading what the
        live gangs hold until the record and its index entry exist, so that a
        concurrent launch of another gang either sees this one's GPUs or waits.
        """
        gang_dir = self.gang_dir(spec.gang)
        nodes = {placement.node for placement in spec.ranks}
        with gpu_slots.node_locks(self.root, nodes):
            if (gang_dir / GANG_FILE).exists():
                return
            capacity = {node.name: node.gpus for node in self.inventory}
            try:
                gpu_indices = gpu_slots.assign_gpus(
                    spec.ranks, spec.gpus_per_rank, capacity, self._held_gpus(nodes)
                )
            except gpu_slots.GpuShortage as error:
                # The engine placed the gang on GPUs this runtime's records still give
                # to live gangs: launching would share them.
                raise RuntimePermanentError(f"cannot launch gang {spec.gang}: {error}") from error
            record = self._gang_record(spec, sandboxed, gpu_indices)
            if create_record(gang_dir / GANG_FILE, record):
                create_claim(index / _index_entry(spec.gang, int(record["master_port"])))

    def _held_gpus(self, nodes: set[str]) -> dict[str, set[int]]:
        """The GPU indices of ``nodes`` that live gangs hold, read from their records.

        A gang holds them until every one of its ranks has ended (exited or lost); a
        gang recorded without `gpu_indices` (before they were assigned) holds none.
        """
        held: dict[str, set[int]] = {node: set() for node in nodes}
        for gang in self._listed_gangs():
            record = read_record(self.gang_dir(gang) / GANG_FILE)
            if record is None or not record.get("gpu_indices"):
                continue
            placed = [
                (str(placement["node"]), indices)
                for placement, indices in zip(record["ranks"], record["gpu_indices"], strict=True)
                if placement["node"] in nodes
            ]
            if not placed:
                continue
            if all(o.phase in ENDED_PHASES for o in self.observe(gang)):
                continue
            for node, indices in placed:
                held[node].update(int(index) for index in indices)
        return held

    def _gang_record(
        self, spec: GangSpec, sandboxed: bool, gpu_indices: list[list[int]]
    ) -> dict[str, Any]:
        sandbox = None
        if sandboxed:
            assert self.sandbox is not None
            sandbox = sandboxes.prepare(
                sandboxes.gang_name(self.root, spec.job_id, spec.attempt),
                self.gang_dir(spec.gang),
                # The flavor's own limits where it sets them (asked once per gang).
                self.sandbox.limits_for(spec.flavor, spec.gpus_per_rank),
            )
        return {
            "job_id": spec.job_id,
            "attempt": spec.attempt,
            "command": spec.command,
            "ranks": _placement_records(spec),
            "gpus_per_rank": spec.gpus_per_rank,
            # Per rank, in the order of `ranks`: the indices of its node's GPUs it sees.
            "gpu_indices": gpu_indices,
            "grace_seconds": spec.grace_seconds,
            "priority_class": spec.priority_class,
            "env": {**spec.env, MTBP_FILE_ENV: str(self.gang_dir(spec.gang) / MTBP_FILE)},
            "image": spec.image,
            "team": spec.team,
            "flavor": spec.flavor,
            "master_addr": self.master_addr,
            "master_port": self._choose_master_port(),
            "run_as": None
            if self.runner is None
            else {
                "user": self.runner.name,
                "uid": self.runner.job_uid(spec.job_id),
                "gid": self.runner.job_gid(spec.job_id),
            },
            "launched_at": time.time(),
            "sandbox": sandbox,
            "log_cap": self.log_cap.record(),
        }

    def _prepare_folders(self, spec: GangSpec) -> None:
        """Make the root, job, gang and checkpoint folders with the owners and modes that
        the module docstring lays out."""
        gid = None if self.runner is None else self.runner.job_gid(spec.job_id)
        self.root.parent.mkdir(parents=True, exist_ok=True)
        _control_plane_folder(self.root, 0o711)
        job_dir = self.root / str(spec.job_id)
        _control_plane_folder(job_dir, 0o700 if gid is None else 0o710, group=gid)
        _control_plane_folder(job_dir / str(spec.attempt), 0o700 if gid is None else 0o711)
        checkpoint_dir = spec.env.get("QM_CHECKPOINT_DIR")
        if checkpoint_dir:
            checkpoints = Path(checkpoint_dir)
            missing = [p for p in reversed(checkpoints.parents) if not p.exists()]
            for parent in missing:
                # Pass-through only, so no rank can list the other jobs' checkpoints.
                parent.mkdir(mode=0o711, exist_ok=True)
            _control_plane_folder(checkpoints, 0o700 if gid is None else 0o770, group=gid)

    def _choose_master_port(self) -> int:
        """A port for the gang's rendezvous, free now and promised to no other gang here.

        It comes from below the kernel's ephemeral range where that leaves room, so an
        outgoing connection cannot take it between launch and rank 0 binding it.
        """
        promised = set(self._listed_gangs().values())
        ephemeral_floor = _ephemeral_port_floor()
        if ephemeral_floor - MASTER_PORT_FLOOR >= 1000:
            for _ in range(100):
                port = random.randrange(MASTER_PORT_FLOOR, ephemeral_floor)
                if port not in promised and _port_is_free(port):
                    return port
        while True:
            port = _free_port(self.master_addr)
            if port not in promised:
                return port

    def _start_keepers(self, gang_dir: Path, ranks: list[int]) -> None:
        try:
            forked = launch_server(self.python).start_keepers(gang_dir, ranks)
        except OSError as error:
            self._release_claims(gang_dir, ranks)
            raise RuntimeTemporaryError(f"cannot start the launcher: {error}") from error
        missing = [rank for rank in ranks if rank not in forked]
        if missing:
            self._release_claims(gang_dir, missing)
            raise RuntimeTemporaryError(
                f"the launcher started no keeper for ranks {missing} "
                f"(see {gang_dir / LAUNCHER_LOG})"
            )

    @staticmethod
    def _release_claims(gang_dir: Path, ranks: list[int]) -> None:
        """Give back rank folders no keeper took, so the next launch retries them."""
        for rank in ranks:
            try:
                (gang_dir / str(rank)).rmdir()
            except OSError:
                continue

    def _known_gangs(self) -> list[GangId]:
        """The gangs launched and not yet forgotten, from the index."""
        if not self.root.is_dir():
            return []
        return sorted(
            (gang for gang in self._listed_gangs() if (self.gang_dir(gang) / GANG_FILE).exists()),
            key=lambda gang: (gang.job_id, gang.attempt),
        )

    def _listed_gangs(self) -> dict[GangId, int]:
        """Each gang in the index, with the master port it was promised."""
        listed: dict[GangId, int] = {}
        for name in os.listdir(self._gang_index()):
            parts = name.split(".")
            if len(parts) == 3 and all(part.isdigit() for part in parts):
                listed[GangId(job_id=int(parts[0]), attempt=int(parts[1]))] = int(parts[2])
        return listed

    def _gang_index(self) -> Path:
        """The index of gangs, made from a scan of every job folder if the root has none.

        Every launch and every pass of the reconciler asks which gangs exist and which
        ports they hold; the folder of every job ever run would take a walk through
        thousands of folders for that, and the index takes one listing. A root written
        before the index existed is listed once, in a folder of this process's own that
        is then renamed into place: a process that loses that race keeps the winner's
        index, which is never empty (its marker file stops a rename from replacing it).
        """
        index = self.root / GANG_INDEX
        if index.is_dir():
            return index
        building = self.root / f".{GANG_INDEX}.{os.getpid()}.{secrets.token_hex(4)}"
        building.mkdir(mode=0o700)
        try:
            create_claim(building / ".built")
            for gang in self._scan_gangs():
                record = read_record(self.gang_dir(gang) / GANG_FILE)
                if record is not None:
                    create_claim(building / _index_entry(gang, int(record["master_port"])))
            try:
                os.rename(building, index)
            except OSError:
                if not index.is_dir():
                    raise
        finally:
            shutil.rmtree(building, ignore_errors=True)
        return index

    def _scan_gangs(self) -> list[GangId]:
        """Every gang with a record, found by walking every job folder."""
        gangs: list[GangId] = []
        for job_dir in self.root.iterdir():
            if not job_dir.name.isdigit() or not job_dir.is_dir():
                continue
            for attempt_dir in job_dir.iterdir():
                if attempt_dir.name.isdigit() and (attempt_dir / GANG_FILE).exists():
                    gangs.append(GangId(job_id=int(job_dir.name), attempt=int(attempt_dir.name)))
        return sorted(gangs, key=lambda gang: (gang.job_id, gang.attempt))

    def _observe_rank(
        self, gang: GangId, gang_dir: Path, placement: dict[str, Any], launched_at: float
    ) -> RankObservation:
        rank = int(placement["rank"])
        rank_dir = gang_dir / str(rank)
        signal_record = read_record(rank_dir / SIGNAL_FILE)
        exit_record = read_record(rank_dir / EXIT_FILE)
        started = read_record(rank_dir / STARTED_FILE)
        if exit_record is None:
            stopping = signal_record is not None or (rank_dir / KILL_FILE).exists()
            phase = self._phase_without_exit(rank_dir, started, stopping, launched_at)
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
            signal_sent_at=(
                None if signal_record is None else float(signal_record["signal_sent_at"])
            ),
            **_end_reason(exit_record),
        )

    @staticmethod
    def _phase_without_exit(
        rank_dir: Path, started: dict[str, Any] | None, stopping: bool, launched_at: float
    ) -> str:
        live_phase = "terminating" if stopping else "running"
        if started is not None and processes.is_alive(
            int(started["pid"]), started.get("created_at")
        ):
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


class LaunchServer:
    """This process's launcher, started once and kept (launcher.py, `--serve`): it
    forks the keepers of each gang it is sent. Launches from several threads take turns;
    each costs a fork there. A launcher that died is started again at the next launch."""

    def __init__(self, python: str) -> None:
        self.python = python
        self.lock = threading.Lock()
        self.process: subprocess.Popen[bytes] | None = None

    def _running(self) -> subprocess.Popen[bytes]:
        if self.process is not None and self.process.poll() is None:
            return self.process
        self.stop()
        self.process = subprocess.Popen(
            [self.python, "-m", "preemption.runtimes.launcher", "--serve"],
            cwd=PROJECT_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        return self.process

    def stop(self) -> None:
        """Close the launcher's input, so that it exits; its keepers live on."""
        process, self.process = self.process, None
        if process is None:
            return
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def start_keepers(self, gang_dir: Path, ranks: list[int]) -> set[int]:
        """Have the launcher fork a keeper for each of ``ranks``; the ranks it forked.

        Raises OSError when the launcher cannot be started or stops answering."""
        request = json.dumps(
            {
                "gang_dir": str(gang_dir),
                "ranks": ranks,
                "environ": inherited_environment(os.environ),
            }
        ).encode()
        request += b"\n"
        with self.lock:
            for fresh in (False, True):
                process = self._running()
                assert process.stdin is not None and process.stdout is not None
                try:
                    process.stdin.write(request)
                    process.stdin.flush()
                except BrokenPipeError:
                    # It died since its last launch and never saw this one: start
                    # another, once.
                    self.stop()
                    if fresh:
                        raise
                    continue
                ready, _, _ = select.select([process.stdout], [], [], LAUNCHER_TIMEOUT_SECONDS)
                reply = process.stdout.readline() if ready else b""
                if not reply.endswith(b"\n"):
                    # Silent or gone mid-launch: whatever it forked has its own records.
                    self.stop()
                    return set()
                return {int(value) for value in reply.split()}
        return set()


# Per interpreter path: this process's launcher (a forked child starts its own).
_LAUNCH_SERVERS: dict[tuple[int, str], LaunchServer] = {}


def launch_server(python: str) -> LaunchServer:
    key = (os.getpid(), python)
    server = _LAUNCH_SERVERS.get(key)
    if server is None:
        server = _LAUNCH_SERVERS.setdefault(key, LaunchServer(python))
    return server


def _control_plane_folder(path: Path, mode: int, *, group: int | None = None) -> None:
    """Create a folder of the control plane's unless it exists, then set its group and mode.

    It is opened without following links and must be a folder this process owns: a link
    or someone else's folder in its place is refused, never handed to a job's group.
    """
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as error:
        raise RuntimePermanentError(f"{path} is not a folder: {error}") from error
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise RuntimePermanentError(
                f"{path} belongs to uid {info.st_uid}, not to the control plane ({os.geteuid()})"
            )
        if group is not None and info.st_gid != group:
            os.fchown(fd, -1, group)
        if stat.S_IMODE(info.st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _open_control_plane_path(root: Path, names: Sequence[str]) -> int:
    """A descriptor of ``root/names[0]/names[1]/...``, each step opened without following
    a link and checked to be a folder this process owns; anything else is refused."""
    try:
        folder = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as error:
        raise RuntimePermanentError(f"{root} is not a folder: {error}") from error
    path = root
    try:
        for name in ("", *names):
            if name:
                path = path / name
                try:
                    inner = os.open(
                        name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder
                    )
                except OSError as error:
                    if error.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise RuntimePermanentError(
                            f"refused to write under {path}: it is not a folder ({error.strerror})"
                        ) from error
                    raise
                os.close(folder)
                folder = inner
            owner = os.fstat(folder).st_uid
            if owner != os.geteuid():
                raise RuntimePermanentError(
                    f"refused to write under {path}: it belongs to uid {owner}, "
                    f"not to the control plane ({os.geteuid()})"
                )
    except BaseException:
        os.close(folder)
        raise
    return folder


def _announced_jobs(lines: bytes) -> list[int]:
    """The job ids the keepers wrote on the exits pipe; an empty list (look at every
    job) when a line is not one, as a keeper of an older launcher writes a bare line."""
    jobs: set[int] = set()
    for line in lines.split(b"\n")[:-1]:
        if not line.isdigit() or len(line) > 18:
            return []
        jobs.add(int(line))
    return sorted(jobs)


def _index_entry(gang: GangId, master_port: int) -> str:
    return f"{gang.job_id}.{gang.attempt}.{master_port}"


def _placement_records(spec: GangSpec) -> list[dict[str, Any]]:
    ranks = sorted(spec.ranks, key=lambda placement: placement.rank)
    return [{"rank": p.rank, "node": p.node, "local_rank": p.local_rank} for p in ranks]


def _same_gang(launched: dict[str, Any], spec: GangSpec) -> bool:
    """True when the recorded gang has the spec's command, placement and checkpoint
    folder (whose name is new for every job, so that a job numbered like an old one
    never passes for it)."""
    return bool(
        launched["command"] == spec.command
        and launched["ranks"] == _placement_records(spec)
        and launched.get("env", {}).get("QM_CHECKPOINT_DIR") == spec.env.get("QM_CHECKPOINT_DIR")
    )


def _recorded_group(started: dict[str, Any] | None) -> int | None:
    """The process group a rank's start record names, unless the rank has not started or
    its group's number now belongs to another process (processes.group_is_recorded)."""
    if started is None:
        return None
    pgid = int(started["pgid"])
    created_at = started.get("created_at")
    if not processes.group_is_recorded(pgid, None if created_at is None else float(created_at)):
        return None
    return pgid


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        # The whole group has already gone: the signal has nothing left to do.
        pass
    except PermissionError as error:
        raise RuntimePermanentError(f"not allowed to signal process group {pgid}") from error


def _ephemeral_port_floor() -> int:
    """The lowest port the kernel hands out to outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as port_range:
            return int(port_range.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_port(address: str) -> int:
    """A TCP port free on `address` right now, for the gang's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])


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


def _port_is_free(port: int) -> bool:
    """True when a fresh socket can bind the port on every IPv4 and IPv6 address.

    SO_REUSEADDR is set so that connections lingering in TIME_WAIT, which no process owns
    and the kernel clears by itself, do not count as a port still held; a listening
    socket still makes the bind fail.
    """
    families = [(socket.AF_INET, "")]
    if socket.has_ipv6:
        families.append((socket.AF_INET6, "::"))
    for family, address in families:
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind((address, port))
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return False
                if family == socket.AF_INET6:
                    # No usable IPv6 on this machine: the IPv4 check stands alone.
                    continue
                raise
    return True


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
