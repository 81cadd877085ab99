"""Trace loaders: turn published job traces into :class:`TraceJob` rows.

Three formats are read:

* ``generic``: a CSV with the header ``submit_time,duration,gpus,team`` (seconds, one row per job).
* ``openb``: the Alibaba PAI 2023 pod list (``openb_pod_list_default.csv``).  Pods without a GPU
  and pods never scheduled are dropped, fractional GPUs are rounded up, the duration is
  ``deletion_time - scheduled_time`` and each pod is assigned to a team with probability
  proportional to that team's guarantee, drawn from a seeded generator.
* ``sia``: the Sia artifact workloads (``name,time,application,num_replicas,batch_size``).  The
  files carry no duration, so each application gets a fixed amount of GPU work (see
  :data:`SIA_GPU_HOURS`) divided over its replicas; teams are drawn like openb's.

Quota files (``team,guarantee``), the Helios Venus daily virtual-cluster sizes and cluster files
are read here too, so that every input of a simulation goes through one module.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

FORMATS = ("generic", "openb", "sia")

# The team used when a trace names none and no quotas say how to spread its jobs.
DEFAULT_TEAM = "default"

# The Sia workload files give the arrival time and replica count of each job but not how long it
# runs (the Sia simulator derives it from throughput models).  These amounts of GPU work follow the
# size classes of the Pollux/Sia workload (cifar10 and ncf small, bert and deepspeech2 medium,
# yolov3 large, imagenet extra large); a job runs for this many GPU-hours divided by its replicas.
SIA_GPU_HOURS: Mapping[str, float] = {
    "cifar10": 0.5,
    "ncf": 0.5,
    "bert": 4.0,
    "deepspeech2": 6.0,
    "yolov3": 40.0,
    "imagenet": 300.0,
}


class TraceError(ValueError):
    """A trace, quota or cluster file could not be read; the message names the file and row."""


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One job of a trace: when it arrives, how long it runs undisturbed, its GPUs and team."""

    name: str
    submit_time: float
    duration: float
    gpus: int
    team: str


@dataclass(frozen=True, slots=True)
class ClusterNode:
    """One node of the simulated cluster (every node holds GPUs of the single flavor ``gpu``).

    ``model`` is the GPU model a node list names (empty when it names none); ``topology``
    maps a level ("block", "rack") to the node's domain there, as the engine's nodes do.
    """

    name: str
    gpus: int
    model: str = ""
    topology: Mapping[str, str] = field(default_factory=dict)


def _rows(path: Path, required: Sequence[str]) -> Iterable[tuple[int, dict[str, str]]]:
    try:
        handle = path.open(newline="")
    except OSError as error:
        raise TraceError(f"{path}: cannot open ({error.strerror})") from error
    with handle:
        reader = csv.DictReader(handle)
        header = [name.strip() for name in (reader.fieldnames or [])]
        missing = [name for name in required if name not in header]
        if missing:
            raise TraceError(f"{path}: missing column(s) {', '.join(missing)}")
        reader.fieldnames = header
        for number, row in enumerate(reader, start=2):
            yield number, {key: (value or "").strip() for key, value in row.items() if key}


def _number(path: Path, line: int, row: Mapping[str, str], column: str) -> float:
    text = row.get(column, "")
    try:
        value = float(text)
    except ValueError as error:
        raise TraceError(f"{path}:{line}: column {column} is not a number: {text!r}") from error
    if not math.isfinite(value):
        raise TraceError(f"{path}:{line}: column {column} is not finite: {text!r}")
    return value


class TeamPicker:
    """Draws a team for each job with probability proportional to the team's guarantee.

    Teams whose guarantee is zero never get a job.  Without any positive guarantee every job goes
    to :data:`DEFAULT_TEAM`.  The draw uses its own seeded generator, so a trace loads the same way
    every time for the same seed.
    """

    def __init__(self, guarantees: Mapping[str, int] | None, seed: int) -> None:
        positive = sorted((team, g) for team, g in (guarantees or {}).items() if g > 0)
        self._teams = [team for team, _ in positive] or [DEFAULT_TEAM]
        self._weights = [float(g) for _, g in positive] or [1.0]
        self._random = random.Random(seed)

    def pick(self) -> str:
        """Return the team of the next job."""
        if len(self._teams) == 1:
            return self._teams[0]
        return self._random.choices(self._teams, weights=self._weights)[0]


def load_generic(path: Path) -> list[TraceJob]:
    """Read a generic CSV trace (``submit_time,duration,gpus,team``)."""
    jobs: list[TraceJob] = []
    for line, row in _rows(path, ("submit_time", "duration", "gpus", "team")):
        gpus = _number(path, line, row, "gpus")
        duration = _number(path, line, row, "duration")
        submit_time = _number(path, line, row, "submit_time")
        if gpus < 1 or gpus != int(gpus):
            raise TraceError(f"{path}:{line}: gpus must be a whole number >= 1, got {row['gpus']}")
        if duration < 0 or submit_time < 0:
            raise TraceError(f"{path}:{line}: submit_time and duration must be >= 0")
        team = row["team"] or DEFAULT_TEAM
        jobs.append(TraceJob(f"job-{line - 1}", submit_time, duration, int(gpus), team))
    return jobs


def load_openb(path: Path, guarantees: Mapping[str, int] | None, seed: int) -> list[TraceJob]:
    """Read the openb pod list: GPU pods that were scheduled, teams drawn by guarantee."""
    picker = TeamPicker(guarantees, seed)
    jobs: list[TraceJob] = []
    required = ("name", "num_gpu", "gpu_milli", "creation_time", "deletion_time", "scheduled_time")
    for line, row in _rows(path, required):
        num_gpu = _number(path, line, row, "num_gpu")
        gpu_milli = _number(path, line, row, "gpu_milli") if row["gpu_milli"] else 0.0
        # A pod asks for num_gpu whole GPUs, or for a fraction of one (gpu_milli); a fraction
        # occupies a whole GPU here because the engine places whole GPUs.
        gpus = int(num_gpu) if num_gpu >= 1 else (1 if gpu_milli > 0 else 0)
        if gpus == 0 or not row["scheduled_time"] or not row["deletion_time"]:
            continue
        scheduled = _number(path, line, row, "scheduled_time")
        deleted = _number(path, line, row, "deletion_time")
        created = _number(path, line, row, "creation_time")
        duration = max(0.0, deleted - scheduled)
        jobs.append(TraceJob(row["name"], created, duration, gpus, picker.pick()))
    return jobs


def load_sia(path: Path, guarantees: Mapping[str, int] | None, seed: int) -> list[TraceJob]:
    """Read a Sia workload file; durations come from :data:`SIA_GPU_HOURS`, teams by guarantee."""
    picker = TeamPicker(guarantees, seed)
    jobs: list[TraceJob] = []
    for line, row in _rows(path, ("name", "time", "application", "num_replicas")):
        replicas = int(_number(path, line, row, "num_replicas"))
        if replicas < 1:
            continue
        application = row["application"]
        if application not in SIA_GPU_HOURS:
            known = ", ".join(sorted(SIA_GPU_HOURS))
            raise TraceError(f"{path}:{line}: unknown application {application!r} ({known})")
        duration = SIA_GPU_HOURS[application] * 3600.0 / replicas
        submit_time = _number(path, line, row, "time")
        jobs.append(TraceJob(row["name"], submit_time, duration, replicas, picker.pick()))
    return jobs


def load_trace(
    path: Path, trace_format: str, guarantees: Mapping[str, int] | None = None, seed: int = 0
) -> list[TraceJob]:
    """Read a trace of the given format, sorted by submit time (ties keep file order)."""
    if trace_format == "generic":
        jobs = load_generic(path)
    elif trace_format == "openb":
        jobs = load_openb(path, guarantees, seed)
    elif trace_format == "sia":
        jobs = load_sia(path, guarantees, seed)
    else:
        raise TraceError(f"unknown trace format {trace_format!r} (one of {', '.join(FORMATS)})")
    jobs.sort(key=lambda job: job.submit_time)
    return jobs


def load_quotas(path: Path) -> dict[str, int]:
    """Read a quota CSV with the header ``team,guarantee``."""
    guarantees: dict[str, int] = {}
    for line, row in _rows(path, ("team", "guarantee")):
        guarantee = _number(path, line, row, "guarantee")
        if guarantee < 0 or guarantee != int(guarantee):
            raise TraceError(f"{path}:{line}: guarantee must be a whole number >= 0")
        if not row["team"]:
            raise TraceError(f"{path}:{line}: empty team name")
        guarantees[row["team"]] = int(guarantee)
    return guarantees


def load_helios_quotas(path: Path, date: str) -> dict[str, int]:
    """Read one day of the Helios daily virtual-cluster sizes as team guarantees.

    Every column but ``date`` and ``total`` is a team; teams with zero GPUs that day keep a zero
    guarantee, so they exist but receive no jobs from the team picker.
    """
    for line, row in _rows(path, ("date",)):
        if row["date"] != date:
            continue
        return {
            team: int(_number(path, line, row, team))
            for team in row
            if team not in ("date", "total")
        }
    raise TraceError(f"{path}: no row for date {date!r}")


def load_cluster(path: Path) -> list[ClusterNode]:
    """Read a cluster file: ``name,gpus`` rows, or the openb node list (``sn,...,gpu,model``).

    Nodes without GPUs are left out.  GPU models are not told apart: the simulation has one
    flavor, because the traces do not say which model a job needs.
    """
    with path.open(newline="") as handle:
        header = next(csv.reader(handle), [])
    columns = [name.strip() for name in header]
    name_column, gpus_column = ("sn", "gpu") if "sn" in columns else ("name", "gpus")
    nodes: list[ClusterNode] = []
    for line, row in _rows(path, (name_column, gpus_column)):
        gpus = _number(path, line, row, gpus_column)
        if gpus >= 1:
            name = row[name_column] or f"node-{line - 1}"
            nodes.append(ClusterNode(name, int(gpus), model=row.get("model", "")))
    if not nodes:
        raise TraceError(f"{path}: no node with GPUs")
    return nodes


def uniform_cluster(nodes: int, gpus_per_node: int) -> list[ClusterNode]:
    """Build ``nodes`` identical nodes of ``gpus_per_node`` GPUs each."""
    if nodes < 1 or gpus_per_node < 1:
        raise TraceError("--nodes and --gpus-per-node must be >= 1")
    width = max(4, len(str(nodes - 1)))
    return [ClusterNode(f"node-{index:0{width}d}", gpus_per_node) for index in range(nodes)]


def rack_layout(nodes: Sequence[ClusterNode], nodes_per_rack: int) -> list[ClusterNode]:
    """Give every node a block and a rack: ``nodes_per_rack`` consecutive nodes form a rack.

    A node list that names GPU models (the openb list) gets one block per model and racks
    inside each block, since a rack holds one kind of server and a gang never spans models
    with different interconnects; a list without models (or a uniform cluster) is one block.
    Nodes keep their order inside a model; the last rack of a block may be smaller.
    """
    if nodes_per_rack < 1:
        raise TraceError("--rack-size must be >= 1")
    by_model: dict[str, list[int]] = {}
    for index, node in enumerate(nodes):
        by_model.setdefault(node.model, []).append(index)
    placed = list(nodes)
    rack = 0
    for block, (model, members) in enumerate(by_model.items()):
        block_name = f"block-{model}" if model else f"block-{block}"
        for start in range(0, len(members), nodes_per_rack):
            for index in members[start : start + nodes_per_rack]:
                placed[index] = replace(
                    nodes[index], topology={"block": block_name, "rack": f"rack-{rack:04d}"}
                )
            rack += 1
    return placed


def derive_quotas(jobs: Sequence[TraceJob], capacity: int) -> dict[str, int]:
    """Give each team a guarantee proportional to its share of the trace's GPU time.

    Shares are rounded with the largest-remainder method so that guarantees add up to the
    cluster's capacity exactly.
    """
    gpu_seconds: dict[str, float] = {}
    for job in jobs:
        gpu_seconds[job.team] = gpu_seconds.get(job.team, 0.0) + job.gpus * job.duration
    total = sum(gpu_seconds.values())
    if total <= 0:
        teams = sorted(gpu_seconds) or [DEFAULT_TEAM]
        gpu_seconds = dict.fromkeys(teams, 1.0)
        total = float(len(teams))
    exact = {team: capacity * seconds / total for team, seconds in gpu_seconds.items()}
    guarantees = {team: math.floor(value) for team, value in exact.items()}
    leftover = capacity - sum(guarantees.values())
    by_remainder = sorted(exact, key=lambda team: (-(exact[team] - guarantees[team]), team))
    for team in by_remainder[:leftover]:
        guarantees[team] += 1
    return dict(sorted(guarantees.items()))


def write_generic(path: Path, jobs: Iterable[TraceJob]) -> None:
    """Write jobs as a generic CSV trace (the format :func:`load_generic` reads)."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["submit_time", "duration", "gpus", "team"])
        for job in jobs:
            writer.writerow([f"{job.submit_time:.3f}", f"{job.duration:.3f}", job.gpus, job.team])
