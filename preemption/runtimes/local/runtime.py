"""LocalRuntime: the Runtime protocol over real OS processes on this machine.

It launches, signals, kills and forgets gangs through the records under its root
(records.py) and the keepers its launcher forks (launch_server.py); it reads a
rank's state through observe.py, the gang index through index.py and a gang's
processes through scan.py. Like every runtime it imports no Django.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal as signals
import sys
import threading
import time
from collections.abc import Callable, Sequence
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
from preemption.runtimes.local.exits import watch_exits
from preemption.runtimes.local.folders import (
    MTBP_FILE,
    control_plane_folder,
    gang_folder,
    write_cadence_hint,
)
from preemption.runtimes.local.index import gang_index, index_entry, known_gangs, listed_gangs
from preemption.runtimes.local.launch_server import launch_server
from preemption.runtimes.local.observe import ENDED_PHASES, observe_rank
from preemption.runtimes.local.ports import choose_master_port, port_is_free
from preemption.runtimes.local.scan import GangProcess, processes_of
from preemption.runtimes.records import (
    EXIT_FILE,
    FORGOTTEN_FILE,
    GANG_FILE,
    GANG_INDEX,
    KILL_FILE,
    LAUNCHER_LOG,
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

# The notice signal the rank's shell wrapper survives (launcher.SHELL_PREFIX traps it).
NOTICE_SIGNALS = frozenset({"SIGUSR2"})


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
        """base.ExitWatcher: the jobs whose ranks have just exited, read from the exits
        pipe (exits.watch_exits says how)."""
        watch_exits(self.root, stop, on_exit)

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
            index = gang_index(self.root)
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
                create_claim(index / index_entry(spec.gang, int(launched["master_port"])))
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
        gangs = [gang] if gang is not None else known_gangs(self.root)
        observations: list[RankObservation] = []
        for known in gangs:
            gang_dir = self.gang_dir(known)
            record = read_record(gang_dir / GANG_FILE)
            if record is None:
                continue
            for placement in record["ranks"]:
                observations.append(
                    observe_rank(known, gang_dir, placement, float(record["launched_at"]))
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
        found = processes_of(self.root, records)
        released: dict[GangId, list[int]] = {gang: [] for gang in gangs}
        for gang, record in records.items():
            bound: set[int] = set()
            master_port = int(record["master_port"])
            if not port_is_free(master_port):
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
        (self.root / GANG_INDEX / index_entry(gang, int(record["master_port"]))).unlink(
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
        write_cadence_hint(self.root, gang, text, gid)

    # ------------------------------------------------------------- beyond the protocol

    def gang_dir(self, gang: GangId) -> Path:
        """The folder holding the gang's records and logs."""
        return gang_folder(self.root, gang)

    def gang_processes(self, gang: GangId) -> list[GangProcess]:
        """Every live process of the gang, found by scanning the process table (see
        `scan.processes_of`)."""
        return processes_of(self.root, self._gang_records([gang])).get(gang, [])

    def _gang_records(self, gangs: Sequence[GangId]) -> dict[GangId, dict[str, Any]]:
        """The gang record of each gang the runtime still knows."""
        records = {gang: read_record(self.gang_dir(gang) / GANG_FILE) for gang in gangs}
        return {gang: record for gang, record in records.items() if record is not None}

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
                # to live gangs: launching would share them. The engine counts a gang's
                # GPUs free once the database has closed its attempt, and a gang ending
                # as another is placed (an elastic gang relaunched at its new size beside
                # a job just stopped) may still be ending here: the launch is tried again,
                # with the backoff and the bound of every temporary error, rather than
                # failing the job for a moment's difference.
                raise RuntimeTemporaryError(
                    f"cannot launch gang {spec.gang} yet: {error}; a gang still ending holds them"
                ) from error
            record = self._gang_record(spec, sandboxed, gpu_indices)
            if create_record(gang_dir / GANG_FILE, record):
                create_claim(index / index_entry(spec.gang, int(record["master_port"])))

    def _held_gpus(self, nodes: set[str]) -> dict[str, set[int]]:
        """The GPU indices of ``nodes`` that live gangs hold, read from their records.

        A gang holds them until every one of its ranks has ended (exited or lost); a
        gang recorded without `gpu_indices` (before they were assigned) holds none.
        """
        held: dict[str, set[int]] = {node: set() for node in nodes}
        for gang in listed_gangs(self.root):
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
            "master_port": choose_master_port(
                set(listed_gangs(self.root).values()), self.master_addr
            ),
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
        control_plane_folder(self.root, 0o711)
        job_dir = self.root / str(spec.job_id)
        control_plane_folder(job_dir, 0o700 if gid is None else 0o710, group=gid)
        control_plane_folder(job_dir / str(spec.attempt), 0o700 if gid is None else 0o711)
        checkpoint_dir = spec.env.get("QM_CHECKPOINT_DIR")
        if checkpoint_dir:
            checkpoints = Path(checkpoint_dir)
            missing = [p for p in reversed(checkpoints.parents) if not p.exists()]
            for parent in missing:
                # Pass-through only, so no rank can list the other jobs' checkpoints.
                parent.mkdir(mode=0o711, exist_ok=True)
            control_plane_folder(checkpoints, 0o700 if gid is None else 0o770, group=gid)

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
