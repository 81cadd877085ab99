"""A runtime that starts nothing: each gang "runs" for the seconds its command names.

It mimics execution the way Kueue's scheduler performance test runner does
(test/performance/scheduler/runner/controller in sigs.k8s.io/kueue): a workload
holds its quota for its class's running time and then finishes, and an evicted
one stops at once. It exists to measure the control plane alone (the REST API,
the scheduling cycle, the reconcilers) with nothing on the machine competing for
the CPU, and it is refused in production settings (portal/settings.py), because
a portal that shows jobs as succeeded without running them must never be
mistaken for a cluster.

The only command it accepts is ``sleep SECONDS``. A launch writes one record per
gang, ``<root>/live/<job>-<attempt>.json``, holding the launch time, the running
time and the placement; a signal or kill adds the time it was asked for. Ranks
are derived from the record and the clock:

- running from the launch until launch + SECONDS, then exited with code 0;
- exited with code 0 at the signal's time when signalled before that (the runner
  evicts at once, and an exit after a stop request is a clean stop);
- exited with code 137 at the kill's time when killed before either.

A mimicked workload may also keep checkpoints, as training code with gracetrap
does; its job's environment says how (names a job may set, unlike QM_*):

- ``MIMIC_CHECKPOINT_EVERY=S``: a regular checkpoint every S seconds of progress;
- ``MIMIC_SAVE_ON_STOP=S``: asked to stop, it stops training and saves where it
  is, which takes S seconds; it exits 0 once the save is written, and a kill
  before that loses the save (the kill's exit code, 137).

A later attempt of the same job resumes from the last checkpoint its previous
attempt kept and runs only the seconds left. Without either variable a workload
keeps nothing, as Kueue's runner's workloads: every attempt starts over.
``gang_progress`` says, for one gang's record, how far it got and how much of
that it kept, which is what a benchmark needs to count the work a preemption
lost.

``watch_exits`` tells the control plane when gangs end, as a real runtime's exit
notices do (and as Kueue's runner finishes a workload at its time): it reads each
record once, when it appears or changes, and wakes at the earliest end it knows of.

``forget`` moves the record to ``<root>/forgotten/``, so that observing every
gang reads only the live ones and a forgotten gang is never launched again.
Records are written atomically (preemption.runtimes.records), so the web
process and every worker process see the same gangs.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from preemption.runtimes.base import (
    GangGuard,
    GangId,
    GangSpec,
    NodeInventory,
    RankObservation,
    RuntimePermanentError,
    os_errors_are_temporary,
    translate_errors,
)
from preemption.runtimes.records import create_record, read_record, write_record

KILLED_EXIT_CODE = 128 + 9
# How often the exit watcher looks for gangs launched, stopped or killed since it last
# looked; ends it already knows of wake it at their time.
WATCH_POLL_SECONDS = 0.05
# A gang may ask for at most a year: anything longer is a mistake in the command.
MAX_SECONDS = 365 * 86_400.0
CHECKPOINT_EVERY_ENV = "MIMIC_CHECKPOINT_EVERY"
SAVE_ON_STOP_ENV = "MIMIC_SAVE_ON_STOP"


@dataclass(frozen=True, slots=True)
class GangProgress:
    """Seconds of a job's work: where a gang started, how far it got, what it kept.

    ``reached`` counts up to the stop request when there was one, since a workload
    asked to stop trains no further; ``lost`` is what the job must do again.
    """

    resumed_from: float
    reached: float
    kept: float

    @property
    def lost(self) -> float:
        return self.reached - self.kept


def _seconds(value: str, subject: str) -> float:
    """A number of seconds the mimic runtime can use; RuntimePermanentError otherwise."""
    try:
        seconds = float(value)
    except ValueError:
        raise RuntimePermanentError(
            f"{subject} needs a number of seconds (got {value!r})"
        ) from None
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_SECONDS:
        raise RuntimePermanentError(
            f"{subject} takes between 0 and {MAX_SECONDS:.0f} seconds (got {value!r})"
        )
    return seconds


def _env_seconds(env: Any, name: str) -> float | None:
    """A mimicked workload's setting in seconds, None when the job does not set it."""
    value = env.get(name)
    return None if value is None else _seconds(value, name)


def mimic_seconds(command: str) -> float:
    """The seconds a mimicked gang runs: the argument of ``sleep SECONDS``.

    Raises RuntimePermanentError for any other command, since nothing else can be
    mimicked without running it.
    """
    try:
        words = shlex.split(command)
    except ValueError as error:
        raise RuntimePermanentError(
            f"the mimic runtime cannot parse {command!r}: {error}"
        ) from None
    if len(words) != 2 or words[0] != "sleep":
        raise RuntimePermanentError(
            f"the mimic runtime runs only 'sleep SECONDS' (got {command!r})"
        )
    return _seconds(words[1], "the mimic runtime")


@translate_errors(os_errors_are_temporary)
class MimicRuntime:
    """Mimics gangs from on-disk records; implements the Runtime protocol."""

    name = "mimic"
    # A mimicked rank ends only by its clock or by the control plane's own request.
    gang_guard: GangGuard | None = None
    # Its calls write a small file and never wait on anything: a pass makes them one
    # after another, as threads would only take turns holding the interpreter.
    calls_side_by_side = 1

    def __init__(self, root: Path, inventory: Sequence[NodeInventory]) -> None:
        self.root = Path(root).resolve()
        self.inventory = list(inventory)

    # ----------------------------------------------------------------- the protocol

    def launch(self, spec: GangSpec) -> None:
        """Record the gang as started now; a second launch, or one after forget, does nothing."""
        total = mimic_seconds(spec.command)
        checkpoint_every = _env_seconds(spec.env, CHECKPOINT_EVERY_ENV)
        if checkpoint_every == 0:
            raise RuntimePermanentError(f"{CHECKPOINT_EVERY_ENV} must be more than 0 seconds")
        save_on_stop = _env_seconds(spec.env, SAVE_ON_STOP_ENV)
        if not spec.ranks:
            raise RuntimePermanentError(f"gang {spec.gang} has no ranks")
        known = {node.name for node in self.inventory}
        unknown = sorted({p.node for p in spec.ranks} - known)
        if unknown:
            raise RuntimePermanentError(f"gang {spec.gang} is placed on unknown nodes {unknown}")
        if self._forgotten(spec.gang).exists():
            return
        self._live(spec.gang).parent.mkdir(parents=True, exist_ok=True)
        resumed_from = self._kept_before(spec.gang)
        seconds = max(0.0, total - resumed_from)
        record = {
            "launched_at": time.time(),
            "seconds": seconds,
            "total": total,
            "resumed_from": resumed_from,
            "checkpoint_every": checkpoint_every,
            "save_on_stop": save_on_stop,
            "ranks": [{"rank": p.rank, "node": p.node} for p in spec.ranks],
        }
        if create_record(self._live(spec.gang), record):
            return
        launched = read_record(self._live(spec.gang))
        same = ("seconds", "checkpoint_every", "save_on_stop", "ranks")
        if launched is not None and any(launched.get(key) != record[key] for key in same):
            raise RuntimePermanentError(
                f"gang {spec.gang} was already launched with another command or placement"
            )

    def signal(self, gang: GangId, grace_seconds: float) -> None:
        """Stop the gang now; only the first request counts."""
        self._mark(gang, "signal_sent_at")

    def kill(self, gang: GangId) -> None:
        """Kill the gang now, unless it already ended."""
        self._mark(gang, "killed_at")

    def observe(self, gang: GangId | None = None) -> list[RankObservation]:
        """The ranks of one gang, or of every live gang, as of now."""
        now = time.time()
        if gang is not None:
            record = read_record(self._live(gang))
            return [] if record is None else _observe(gang, record, now)
        live = self.root / "live"
        seen = _read_changed(
            live, _live_seen.get(live, {}), lambda path, record: (_gang_of(path), record)
        )
        _live_seen[live] = seen
        observations: list[RankObservation] = []
        for name in sorted(seen):
            found, record = seen[name][1]
            observations.extend(_observe(found, record, now))
        return observations

    def nodes(self) -> list[NodeInventory]:
        return list(self.inventory)

    def watch_exits(self, stop: threading.Event, on_exit: Callable[[list[int]], None]) -> None:
        """Call ``on_exit`` with the ids of the jobs whose gangs have just ended, at their
        end, until ``stop`` is set (preemption.runtimes.base.ExitWatcher).

        Each live record is read when it first appears and again whenever it is
        rewritten (a signal or a kill, which may bring its end forward), judged by its
        inode, size and modification time; a gang's end is announced once per end time."""
        live = self.root / "live"
        # name -> (the record's file identity, (its gang, its end))
        known: dict[str, tuple[FileIdentity, tuple[GangId, float]]] = {}
        announced: set[tuple[str, float]] = set()
        while not stop.is_set():
            known = _read_changed(
                live, known, lambda path, record: (_gang_of(path), _ended_at(record))
            )
            announced = {(name, end) for name, end in announced if name in known}
            now = time.time()
            due = {
                (name, end): gang
                for name, (_, (gang, end)) in known.items()
                if end <= now and (name, end) not in announced
            }
            if due:
                announced.update(due)
                on_exit(sorted({gang.job_id for gang in due.values()}))
            coming = [end for name, (_, (_, end)) in known.items() if (name, end) not in announced]
            stop.wait(
                min([WATCH_POLL_SECONDS, *(end - now for end in coming)])
                if coming
                else WATCH_POLL_SECONDS
            )

    def read_log(self, gang: GangId, rank: int, offset: int = 0, limit: int = 1 << 20) -> bytes:
        """Mimicked ranks write nothing; a rank the runtime never launched is an error."""
        if offset < 0 or limit < 0:
            raise RuntimePermanentError(f"bad log range: offset {offset}, limit {limit}")
        record = self.record(gang)
        if record is None or not 0 <= rank < len(record["ranks"]):
            raise RuntimePermanentError(f"gang {gang} has no rank {rank} on this runtime")
        return b""

    def released_ports(self, gangs: Sequence[GangId]) -> dict[GangId, list[int]]:
        """Mimicked ranks bind no ports."""
        return {gang: [] for gang in gangs}

    def publish_preemption_risk(self, gang: GangId, mtbp_seconds: float, *, team: str) -> None:
        """Nothing runs, so no rank reads a cadence hint: there is nothing to hand over."""

    def forget(self, gang: GangId) -> None:
        """Move a finished gang's record aside; a gang still running cannot be forgotten."""
        record = read_record(self._live(gang))
        if record is None:
            return
        live = [o.rank for o in _observe(gang, record, time.time()) if o.phase != "exited"]
        if live:
            raise RuntimePermanentError(f"gang {gang} still has live ranks {live}")
        self._forgotten(gang).parent.mkdir(parents=True, exist_ok=True)
        os.replace(self._live(gang), self._forgotten(gang))

    # ------------------------------------------------------------- beyond the protocol

    def record(self, gang: GangId) -> dict[str, Any] | None:
        """The launch record of a gang, live or forgotten; None if it never launched."""
        return read_record(self._live(gang)) or read_record(self._forgotten(gang))

    def records(self) -> Iterator[tuple[GangId, dict[str, Any]]]:
        """Every launch record, live and forgotten, with its gang."""
        for folder in ("live", "forgotten"):
            found = self.root / folder
            for path in sorted(found.glob("*.json")) if found.is_dir() else []:
                record = read_record(path)
                if record is not None:
                    yield _gang_of(path), record

    def _live(self, gang: GangId) -> Path:
        return self.root / "live" / f"{gang.job_id}-{gang.attempt}.json"

    def _forgotten(self, gang: GangId) -> Path:
        return self.root / "forgotten" / f"{gang.job_id}-{gang.attempt}.json"

    def _kept_before(self, gang: GangId) -> float:
        """The progress the job's latest earlier launched attempt kept: where this one resumes."""
        for attempt in range(gang.attempt - 1, 0, -1):
            record = self.record(GangId(gang.job_id, attempt))
            if record is not None:
                return gang_progress(record, time.time()).kept
        return 0.0

    def _mark(self, gang: GangId, field: str) -> None:
        path = self._live(gang)
        record = read_record(path)
        if record is None or record.get(field) is not None:
            return
        now = time.time()
        if _ended_at(record) <= now:
            return
        # Signal and kill may race between workers; whichever writes last keeps the
        # earlier request, since an ended rank stays ended.
        write_record(path, {**record, field: now})


# A record file's inode, size and modification time.
FileIdentity = tuple[int, int, int]
T = TypeVar("T")
# The live records observe() last read, by folder: a pass over every gang reads again
# only those rewritten since (a signal or a kill), which at a few hundred running gangs
# four times a second was most of a pass's time.
_live_seen: dict[Path, dict[str, tuple[FileIdentity, tuple[GangId, dict[str, Any]]]]] = {}


def _read_changed(
    folder: Path,
    known: dict[str, tuple[FileIdentity, T]],
    derive: Callable[[Path, dict[str, Any]], T],
) -> dict[str, tuple[FileIdentity, T]]:
    """The records now in `folder` by file name, each with what `derive` makes of it,
    read and derived again only when its file changed since `known`. A record is
    replaced whole (preemption.runtimes.records), and a rewrite only ever adds a
    field, so a changed record differs in inode, size or modification time."""
    present: dict[str, tuple[FileIdentity, T]] = {}
    with contextlib.suppress(FileNotFoundError), os.scandir(folder) as entries:
        for entry in entries:
            if not entry.name.endswith(".json"):
                continue
            try:
                found = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            identity = (found.st_ino, found.st_size, found.st_mtime_ns)
            kept = known.get(entry.name)
            if kept is not None and kept[0] == identity:
                present[entry.name] = kept
                continue
            path = Path(entry.path)
            record = read_record(path)
            if record is not None:
                present[entry.name] = (identity, derive(path, record))
    return present


def _gang_of(path: Path) -> GangId:
    job_id, attempt = (int(part) for part in path.stem.split("-"))
    return GangId(job_id, attempt)


def _ended_at(record: dict[str, Any]) -> float:
    """When the gang's ranks exit: the end of its running time, a kill, or a stop request
    plus the save it asks for."""
    ends = [float(record["launched_at"]) + float(record["seconds"])]
    if record.get("signal_sent_at"):
        ends.append(float(record["signal_sent_at"]) + float(record.get("save_on_stop") or 0.0))
    if record.get("killed_at"):
        ends.append(float(record["killed_at"]))
    return min(ends)


def gang_progress(record: dict[str, Any], now: float) -> GangProgress:
    """How far one mimicked gang got by `now` (or its end) and how much it kept.

    A gang that ran its seconds kept everything; one asked to stop kept its progress
    at the request once its save was written; otherwise it kept its last regular
    checkpoint, or only what it resumed from.
    """
    launched_at = float(record["launched_at"])
    seconds = float(record["seconds"])
    resumed_from = float(record.get("resumed_from") or 0.0)
    total = float(record.get("total", resumed_from + seconds))
    ended_at = _ended_at(record)
    signal_at = record.get("signal_sent_at")
    trained_until = min(ended_at, now)
    if signal_at is not None:
        trained_until = min(trained_until, float(signal_at))
    reached = resumed_from + max(0.0, trained_until - launched_at)
    if ended_at <= now and ended_at == launched_at + seconds:
        return GangProgress(resumed_from, total, total)
    save_on_stop = record.get("save_on_stop")
    # The gang ended with its save written, not killed before it.
    if (
        ended_at <= now
        and signal_at is not None
        and save_on_stop is not None
        and ended_at == float(signal_at) + float(save_on_stop)
    ):
        return GangProgress(resumed_from, reached, reached)
    kept = resumed_from
    every = record.get("checkpoint_every")
    if every:
        kept = max(kept, math.floor(reached / float(every)) * float(every))
    return GangProgress(resumed_from, reached, kept)


def _observe(gang: GangId, record: dict[str, Any], now: float) -> list[RankObservation]:
    launched_at = float(record["launched_at"])
    ended_at = _ended_at(record)
    signal_sent_at = record.get("signal_sent_at")
    killed_at = record.get("killed_at")
    exited = ended_at <= now
    if not exited:
        phase, code = "running", None
    elif killed_at is not None and float(killed_at) == ended_at:
        phase, code = "exited", KILLED_EXIT_CODE
    else:
        phase, code = "exited", 0
    return [
        RankObservation(
            job_id=gang.job_id,
            attempt=gang.attempt,
            rank=int(placement["rank"]),
            node=str(placement["node"]),
            phase=phase,
            exit_code=code,
            handle=f"mimic-{gang.job_id}-{gang.attempt}-{placement['rank']}",
            started_at=launched_at,
            exited_at=ended_at if exited else None,
            signal_sent_at=None if signal_sent_at is None else float(signal_sent_at),
        )
        for placement in record["ranks"]
    ]
