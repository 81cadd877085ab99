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

``forget`` moves the record to ``<root>/forgotten/``, so that observing every
gang reads only the live ones and a forgotten gang is never launched again.
Records are written atomically (preemption.runtimes.records), so the web
process and every worker process see the same gangs.
"""

from __future__ import annotations

import math
import os
import shlex
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
# A gang may ask for at most a year: anything longer is a mistake in the command.
MAX_SECONDS = 365 * 86_400.0


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
    try:
        seconds = float(words[1])
    except ValueError:
        raise RuntimePermanentError(
            f"the mimic runtime needs a number of seconds (got {words[1]!r})"
        ) from None
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_SECONDS:
        raise RuntimePermanentError(
            f"the mimic runtime runs between 0 and {MAX_SECONDS:.0f} seconds (got {words[1]!r})"
        )
    return seconds


@translate_errors(os_errors_are_temporary)
class MimicRuntime:
    """Mimics gangs from on-disk records; implements the Runtime protocol."""

    name = "mimic"
    # A mimicked rank ends only by its clock or by the control plane's own request.
    gang_guard: GangGuard | None = None

    def __init__(self, root: Path, inventory: Sequence[NodeInventory]) -> None:
        self.root = Path(root).resolve()
        self.inventory = list(inventory)

    # ----------------------------------------------------------------- the protocol

    def launch(self, spec: GangSpec) -> None:
        """Record the gang as started now; a second launch, or one after forget, does nothing."""
        seconds = mimic_seconds(spec.command)
        if not spec.ranks:
            raise RuntimePermanentError(f"gang {spec.gang} has no ranks")
        known = {node.name for node in self.inventory}
        unknown = sorted({p.node for p in spec.ranks} - known)
        if unknown:
            raise RuntimePermanentError(f"gang {spec.gang} is placed on unknown nodes {unknown}")
        if self._forgotten(spec.gang).exists():
            return
        self._live(spec.gang).parent.mkdir(parents=True, exist_ok=True)
        record = {
            "launched_at": time.time(),
            "seconds": seconds,
            "ranks": [{"rank": p.rank, "node": p.node} for p in spec.ranks],
        }
        if create_record(self._live(spec.gang), record):
            return
        launched = read_record(self._live(spec.gang))
        if launched is not None and (
            launched["seconds"] != seconds or launched["ranks"] != record["ranks"]
        ):
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
            paths = [self._live(gang)]
        else:
            live = self.root / "live"
            paths = sorted(live.glob("*.json")) if live.is_dir() else []
        observations: list[RankObservation] = []
        for path in paths:
            record = read_record(path)
            if record is None:
                continue
            job_id, attempt = (int(part) for part in path.stem.split("-"))
            observations.extend(_observe(GangId(job_id, attempt), record, now))
        return observations

    def nodes(self) -> list[NodeInventory]:
        return list(self.inventory)

    def read_log(self, gang: GangId, rank: int, offset: int = 0, limit: int = 1 << 20) -> bytes:
        """Mimicked ranks write nothing; a rank the runtime never launched is an error."""
        if offset < 0 or limit < 0:
            raise RuntimePermanentError(f"bad log range: offset {offset}, limit {limit}")
        record = read_record(self._live(gang)) or read_record(self._forgotten(gang))
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

    def _live(self, gang: GangId) -> Path:
        return self.root / "live" / f"{gang.job_id}-{gang.attempt}.json"

    def _forgotten(self, gang: GangId) -> Path:
        return self.root / "forgotten" / f"{gang.job_id}-{gang.attempt}.json"

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


def _ended_at(record: dict[str, Any]) -> float:
    """When the gang's ranks exit: the end of its running time or the first stop asked for."""
    ends = [float(record["launched_at"]) + float(record["seconds"])]
    ends += [float(record[key]) for key in ("signal_sent_at", "killed_at") if record.get(key)]
    return min(ends)


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
