"""Kueue's scheduler performance test, run through the whole Quartermaster control plane.

Kueue's test (test/performance/scheduler in sigs.k8s.io/kueue) reads a generator
config of cohorts, cluster queues and workload classes, creates the workloads at
their arrival times, mimics their execution and records each workload's time to
admission. `run_quartermaster` does the same with Quartermaster:

- cohorts become parent teams and cluster queues their sub-teams, on one flavor
  (Kueue's quota resource, "cpu" in its configs, counted as GPUs): each sub-team is
  guaranteed its queue's nominal quota and may borrow up to its borrowing limit
  (and lend up to its lending limit) inside its cohort; a cohort team holds the sum
  of its queues' quotas and neither borrows nor lends, since Kueue's cohorts share
  nothing with each other. The capacity is one node of that sum, because Kueue's
  test has no nodes: its only limit is quota. A topology-aware config (Kueue's
  `tas`) has nodes: they are created as Kueue's generator creates them, with its
  names and labels, and its topology's levels become Quartermaster's
  (QM_TOPOLOGY_LABELS); `topology_nodes` says how domains are labelled.
- each distinct priority becomes a priority class of that value, preempting lower
  ones where the queues' `withinClusterQueue` is `LowerPriority`; reclaim within a
  cohort is Quartermaster's own rule (R6) and always on.
- quantities are counted in the largest unit that divides them all, at most a whole
  CPU (`GeneratorConfig.unit_millis`: 250m for `tas`, whose requests are 500m, 1250m
  and 2500m), since Quartermaster counts whole GPUs.
- each workload is a job of `podCount` ranks (one where the config says none) of
  `request` GPUs each, with the topology level it asks for (required for Kueue's
  `required` and `balanced`, only preferred for `preferred`), with the command
  `sleep <runtimeMs / 1000>`, submitted through the REST API with an API token at
  its arrival time: Kueue's generator runs every workload set of every queue as its
  own stream that waits `creationIntervalMs` before each workload, so the n-th
  workload of a set (counting from 1) arrives at n x creationIntervalMs. The
  workloads due at the same instant (the same tick of every queue's streams) go in
  one POST /jobs/batch/; `--one-by-one` sends each with its own POST /jobs/.
- a portal (gunicorn), a Celery worker, Celery beat and the listener for the ranks'
  exits (manage.py watch_exits) run as separate processes with QM_RUNTIME=mimic
  (preemption/runtimes/mimic.py): a job holds its GPUs for its running time and
  succeeds, as Kueue's runner finishes a workload `runtimeMs` after its admission; the
  listener announces each end as the runner's controller does, and a preempted job
  stops at once, as the runner evicts at once. One
  difference: Kueue's runner counts the running time from the admission, the mimic
  runtime from the launch that follows it (`launch_after_admission` says how long
  after), as a real runtime would.
- a workload class of our own configs may name its checkpoints (`checkpointEveryMs`,
  `saveOnStopMs`, keys Kueue's generator ignores); its jobs then carry them to the
  mimic runtime, which resumes a preempted job from what it kept, and the figures'
  `reclaim` counts the work the preempted attempts lost (the reclaim comparison,
  bench/kueue_reclaim.py for Kueue's side).

The figures follow Kueue's recorder (runner/recorder): a workload's time to
admission runs from its creation to its last admission (the recorder overwrites it
when an evicted workload is admitted again), here from `Job.submitted_at` to the
last attempt's `admitted_at`; usage is GPU-seconds held (admission to the end of the
attempt) over the quota's capacity for the run, as the recorder's CPU-milliseconds
used over the nominal quota and the monitored time; total time runs from the first
arrival's start to the last job's end. On a topology-aware config,
`placement_check` reads every attempt's placement and counts those spread over more
than one domain of the level their workload required (none may be) or preferred.

`scale` multiplies every workload set's count (at least one each), keeping the
queues, quotas, intervals and running times, so a smaller run spreads the same
queues' arrivals over a shorter window.

Kueue's own files are never copied here: `kueue_config_path()` finds the generator
config in the Go module cache (`go mod download -json`).

Usage (a PostgreSQL server on which it creates and drops `test_<name>` of
DATABASE_URL's database, and a Redis broker whose default queue it purges):
    DATABASE_URL=postgres://... CELERY_BROKER_URL=redis://... \\
        .venv/bin/python bench/kueue_qm.py [CONFIG] [--scale 1.0] [--probe 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import django
import yaml

import fairshare

ROOT = Path(__file__).resolve().parents[1]
# Set up Django before its models are imported; a caller that already did (pytest) keeps its setup.
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
django.setup()

from django.conf import settings  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.db.models import Max, Min  # noqa: E402
from django.test import override_settings  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench.portal_health import wait_healthy  # noqa: E402
from portal.celery import app  # noqa: E402
from portal.processes import beat_command, exits_command, web_command, worker_command  # noqa: E402
from portal.services import api_token_create  # noqa: E402
from preemption.models import FINAL_STATES, Attempt, Job, PreemptionEvent  # noqa: E402
from preemption.runtimes.mimic import (  # noqa: E402
    CHECKPOINT_EVERY_ENV,
    SAVE_ON_STOP_ENV,
    MimicRuntime,
    gang_progress,
)
from preemption.snapshot import build_snapshot, held_jobs  # noqa: E402
from quotas.models import Node, PriorityClass  # noqa: E402
from quotas.services import (  # noqa: E402
    flavor_create,
    node_upsert,
    priority_class_save,
    quota_set,
    team_create,
    team_priority_classes_set,
)

KUEUE_MODULE = "sigs.k8s.io/kueue@v0.17.0"
BASELINE = "test/performance/scheduler/configs/baseline/generator.yaml"
FLAVOR = "rf"  # the resource flavor Kueue's generator creates when the config names none
POLICIES = {"LowerPriority": "PreemptLowerPriority", "Never": "Never", "": "Never"}


# --------------------------------------------------------------------- the config


class ConfigError(ValueError):
    """The generator config cannot be translated; the message says where and why."""


@dataclass(frozen=True)
class Checkpoints:
    """How a workload class keeps its work, in our own configs' keys (Kueue's generator
    has none and ignores them): a regular checkpoint every `every_ms` of progress, and a
    save on a stop request that takes `save_on_stop_ms`. Passed to the mimic runtime as
    the job's MIMIC_CHECKPOINT_EVERY and MIMIC_SAVE_ON_STOP."""

    every_ms: int | None = None
    save_on_stop_ms: int | None = None

    def env(self) -> dict[str, str]:
        env = {}
        if self.every_ms is not None:
            env[CHECKPOINT_EVERY_ENV] = f"{self.every_ms / 1000:g}"
        if self.save_on_stop_ms is not None:
            env[SAVE_ON_STOP_ENV] = f"{self.save_on_stop_ms / 1000:g}"
        return env


@dataclass(frozen=True)
class WorkloadClass:
    name: str
    runtime_ms: int
    priority: int
    # Per pod, in the config's units (`GeneratorConfig.unit_millis`).
    request: int
    checkpoints: Checkpoints = Checkpoints()
    pods: int = 1
    # The topology level the pods ask for (its name in the config's topology), and how:
    # "required", "preferred" or "balanced" (Kueue's slice-required request, each
    # `slice_size` pods inside one domain).
    topology_level: str | None = None
    topology_constraint: str = ""
    slice_size: int | None = None


@dataclass(frozen=True)
class TopologyLevel:
    """One level of the config's topology, outermost first: `count` domains under each
    domain of the level above, read from the node label `node_label`."""

    name: str
    count: int
    node_label: str


@dataclass(frozen=True)
class Topology:
    """The config's topology section: its levels and the capacity of each node (the
    innermost level's domains), in the config's units."""

    name: str
    levels: tuple[TopologyLevel, ...]
    node_capacity: int
    # The label Kueue's resource flavor selects its nodes by (value "tas").
    flavor_node_label: str = ""


@dataclass(frozen=True)
class WorkloadSet:
    count: int
    interval_ms: int
    workloads: tuple[WorkloadClass, ...]


@dataclass(frozen=True)
class QueueSet:
    class_name: str
    count: int
    nominal: int
    borrowing_limit: int | None
    lending_limit: int | None
    within_cluster_queue: str
    workload_sets: tuple[WorkloadSet, ...]


@dataclass(frozen=True)
class CohortSet:
    class_name: str
    count: int
    queue_sets: tuple[QueueSet, ...]


@dataclass(frozen=True)
class GeneratorConfig:
    flavor: str
    cohorts: tuple[CohortSet, ...]
    # What one unit of Quartermaster's counts stands for, in thousandths of the config's
    # resource (millicores): 1000 where every quantity is whole, less where a request
    # is "500m" (Quartermaster counts whole GPUs).
    unit_millis: int = 1000
    topology: Topology | None = None


def _whole(value: Any, where: str) -> int:
    """A Kubernetes quantity that is a whole, non-negative number ("20", 20)."""
    text = str(value).strip()
    if not re.fullmatch(r"\d+", text):
        raise ConfigError(f"{where}: expected a whole number of units, got {value!r}")
    return int(text)


def _optional_whole(value: Any, where: str) -> int | None:
    return None if value is None or value == "" else _whole(value, where)


def _checkpoints(workload: dict[str, Any], where: str) -> Checkpoints:
    every = _optional_whole(workload.get("checkpointEveryMs"), f"{where}.checkpointEveryMs")
    if every == 0:
        raise ConfigError(f"{where}.checkpointEveryMs: must be more than 0")
    save = _optional_whole(workload.get("saveOnStopMs"), f"{where}.saveOnStopMs")
    return Checkpoints(every_ms=every, save_on_stop_ms=save)


# The constraints of Kueue's generator (tasConstraint) and whether Quartermaster's job
# must keep all its ranks inside one domain of the level. Quartermaster has no slices:
# a "balanced" workload (Kueue's slice-required request, each slice of `sliceSize`
# pods inside one domain) is mapped to the whole gang inside one domain, which holds
# every slice inside one domain too; it is stricter than Kueue's request, never looser.
TOPOLOGY_REQUIRED = {"required": True, "balanced": True, "preferred": False}


def _millis(value: Any, where: str) -> int:
    """A Kubernetes CPU quantity in thousandths: "20" or 20 is 20000, "500m" is 500,
    "1.5" is 1500."""
    text = str(value).strip()
    match = re.fullmatch(r"(\d+)(?:\.(\d{1,3}))?|(\d+)m", text)
    if not match:
        raise ConfigError(f"{where}: expected a quantity such as 20 or 500m, got {value!r}")
    if match.group(3) is not None:
        return int(match.group(3))
    return int(match.group(1)) * 1000 + int((match.group(2) or "0").ljust(3, "0"))


def _quantities(data: dict[str, Any]) -> list[int]:
    """Every quantity of the resource in the config, in thousandths: the queues' quotas
    and limits, the workloads' requests and the nodes' capacity."""
    found = []
    for c, cohort in enumerate(data["cohorts"]):
        for q, qs in enumerate(cohort.get("queuesSets") or []):
            where = f"cohorts[{c}].queuesSets[{q}]"
            for key in ("nominalQuota", "borrowingLimit", "lendingLimit"):
                if qs.get(key) not in (None, ""):
                    found.append(_millis(qs[key], f"{where}.{key}"))
            for w, ws in enumerate(qs.get("workloadsSets") or []):
                for k, wl in enumerate(ws.get("workloads") or []):
                    at = f"{where}.workloadsSets[{w}].workloads[{k}].request"
                    found.append(_millis(wl.get("request"), at))
    levels = (data.get("topology") or {}).get("levels") or []
    if levels:
        cpu = ((levels[-1] or {}).get("capacity") or {}).get("cpu") or "96"
        found.append(_millis(cpu, f"topology.levels[{len(levels) - 1}].capacity.cpu"))
    return found


def _topology(data: dict[str, Any], unit: int, where: str) -> Topology | None:
    """The config's topology section, as Kueue's generator reads it (runner/generator's
    TopologyConfig): at least two levels, the last one the nodes, each with its count."""
    section = data.get("topology")
    if not section:
        return None
    raw_levels = section.get("levels") if isinstance(section, dict) else None
    if not isinstance(raw_levels, list) or len(raw_levels) < 2:
        raise ConfigError(f"{where}: topology.levels must list at least two levels")
    levels = []
    for i, level in enumerate(raw_levels):
        at = f"{where}: topology.levels[{i}]"
        name, label = str(level.get("name") or ""), str(level.get("nodeLabel") or "")
        if not name or not label:
            raise ConfigError(f"{at}: every level needs a name and a nodeLabel")
        count = _whole(level.get("count"), f"{at}.count")
        if count < 1:
            raise ConfigError(f"{at}.count: must be at least 1")
        levels.append(TopologyLevel(name=name, count=count, node_label=label))
    if len({level.name for level in levels}) < len(levels):
        raise ConfigError(f"{where}: topology level names must differ")
    cpu = ((raw_levels[-1] or {}).get("capacity") or {}).get("cpu") or "96"
    flavor = data.get("resourceFlavor") or {}
    return Topology(
        name=str(section.get("name") or "default"),
        levels=tuple(levels),
        node_capacity=_millis(cpu, f"{where}: topology node capacity") // unit,
        flavor_node_label=str(flavor.get("nodeLabel") or ""),
    )


def _workload_topology(
    wl: dict[str, Any], topology: Topology | None, at: str
) -> tuple[str | None, str, int | None]:
    """A workload class's topology request: the level's name, the constraint and the
    slice size; a level is named in the config by its node label."""
    label = str(wl.get("tasLevel") or "")
    if not label:
        return None, "", None
    if topology is None:
        raise ConfigError(f"{at}.tasLevel: the config has no topology section")
    names = {level.node_label: level.name for level in topology.levels}
    if label not in names:
        raise ConfigError(
            f"{at}.tasLevel: {label!r} is none of the topology's node labels ({', '.join(names)})"
        )
    constraint = str(wl.get("tasConstraint") or "")
    if constraint not in TOPOLOGY_REQUIRED:
        raise ConfigError(
            f"{at}.tasConstraint: {constraint!r} is not translated "
            f"(one of {', '.join(TOPOLOGY_REQUIRED)})"
        )
    slice_size = _optional_whole(wl.get("sliceSize"), f"{at}.sliceSize")
    return names[label], constraint, slice_size


def load_config(path: Path) -> GeneratorConfig:
    """Read a Kueue scheduler performance generator config (runner/generator's Config),
    topology-aware ones included (a topology section, podCount, tasLevel,
    tasConstraint, sliceSize).

    Quartermaster counts whole units, so the config's quantities are counted in the
    largest unit that divides all of them (`unit_millis`): a whole CPU where they are
    all whole, 250m for Kueue's tas config (requests of 500m, 1250m and 2500m).
    """
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict) or not data.get("cohorts"):
        raise ConfigError(f"{path}: the config must contain at least one cohort")
    # At most a whole CPU, so configs of whole quantities keep their numbers.
    unit = math.gcd(1000, *_quantities(data))
    topology = _topology(data, unit, str(path))

    def quantity(value: Any, where: str) -> int:
        return _millis(value, where) // unit

    def optional_quantity(value: Any, where: str) -> int | None:
        return None if value is None or value == "" else quantity(value, where)

    flavor = str((data.get("resourceFlavor") or {}).get("name") or FLAVOR)
    cohorts = []
    for c, cohort in enumerate(data["cohorts"]):
        queue_sets = []
        for q, qs in enumerate(cohort.get("queuesSets") or []):
            where = f"cohorts[{c}].queuesSets[{q}]"
            within = str(qs.get("withinClusterQueue") or "")
            if within not in POLICIES:
                raise ConfigError(f"{where}.withinClusterQueue: {within!r} is not translated")
            workload_sets = []
            for w, ws in enumerate(qs.get("workloadsSets") or []):
                classes = []
                for k, wl in enumerate(ws.get("workloads") or []):
                    at = f"{where}.workloadsSets[{w}].workloads[{k}]"
                    pods = _whole(wl.get("podCount") or 1, f"{at}.podCount")
                    if pods < 1:
                        raise ConfigError(f"{at}.podCount: must be at least 1")
                    level, constraint, slice_size = _workload_topology(wl, topology, at)
                    classes.append(
                        WorkloadClass(
                            name=str(wl["className"]),
                            runtime_ms=_whole(wl.get("runtimeMs", 0), f"{at}.runtimeMs"),
                            priority=int(wl.get("priority", 0)),
                            request=quantity(wl["request"], f"{at}.request"),
                            checkpoints=_checkpoints(wl, at),
                            pods=pods,
                            topology_level=level,
                            topology_constraint=constraint,
                            slice_size=slice_size,
                        )
                    )
                workload_sets.append(
                    WorkloadSet(
                        count=_whole(ws["count"], f"{where}.workloadsSets[{w}].count"),
                        interval_ms=_whole(
                            ws.get("creationIntervalMs", 0),
                            f"{where}.workloadsSets[{w}].creationIntervalMs",
                        ),
                        workloads=tuple(classes),
                    )
                )
            queue_sets.append(
                QueueSet(
                    class_name=str(qs["className"]),
                    count=_whole(qs["count"], f"{where}.count"),
                    nominal=quantity(qs["nominalQuota"], f"{where}.nominalQuota"),
                    borrowing_limit=optional_quantity(
                        qs.get("borrowingLimit"), f"{where}.borrowingLimit"
                    ),
                    lending_limit=optional_quantity(
                        qs.get("lendingLimit"), f"{where}.lendingLimit"
                    ),
                    within_cluster_queue=within,
                    workload_sets=tuple(workload_sets),
                )
            )
        cohorts.append(
            CohortSet(
                class_name=str(cohort["className"]),
                count=_whole(cohort["count"], f"cohorts[{c}].count"),
                queue_sets=tuple(queue_sets),
            )
        )
    return GeneratorConfig(
        flavor=flavor, cohorts=tuple(cohorts), unit_millis=unit, topology=topology
    )


@dataclass(frozen=True)
class Queue:
    """One cluster queue: a sub-team of its cohort's team."""

    name: str
    cohort: str
    class_name: str
    nominal: int
    borrowing_limit: int | None
    lending_limit: int | None


@dataclass(frozen=True)
class Workload:
    """One workload: a job submitted `arrival_s` after the start."""

    name: str
    queue: str
    class_name: str
    request: int
    priority: int
    runtime_ms: int
    arrival_s: float
    checkpoints: Checkpoints = Checkpoints()
    # A gang of `pods` ranks of `request` units each; a topology level its ranks ask
    # to share a domain of, as a requirement or only a preference.
    pods: int = 1
    topology_level: str | None = None
    topology_required: bool = True
    topology_constraint: str = ""
    slice_size: int | None = None

    @property
    def units(self) -> int:
        """What the whole workload holds while it runs."""
        return self.pods * self.request


@dataclass
class Expansion:
    flavor: str
    unit_millis: int = 1000
    topology: Topology | None = None
    cohorts: dict[str, list[Queue]] = field(default_factory=dict)
    workloads: list[Workload] = field(default_factory=list)
    policies: dict[int, str] = field(default_factory=dict)


def expand(config: GeneratorConfig, scale: float = 1.0) -> Expansion:
    """Every cohort, queue and workload of the config, named as Kueue's generator names them."""
    if not (math.isfinite(scale) and scale > 0):
        raise ConfigError(f"scale must be a positive number, got {scale!r}")
    out = Expansion(flavor=config.flavor, unit_millis=config.unit_millis, topology=config.topology)
    for cohort_set in config.cohorts:
        for c in range(cohort_set.count):
            cohort = f"{cohort_set.class_name}-{c}"
            queues = out.cohorts.setdefault(cohort, [])
            for qs_index, qs in enumerate(cohort_set.queue_sets):
                for q in range(qs.count):
                    queue = Queue(
                        name=f"{qs.class_name}-{qs_index}-{q}-{cohort}",
                        cohort=cohort,
                        class_name=qs.class_name,
                        nominal=qs.nominal,
                        borrowing_limit=qs.borrowing_limit,
                        lending_limit=qs.lending_limit,
                    )
                    queues.append(queue)
                    for ws_index, ws in enumerate(qs.workload_sets):
                        count = max(1, round(ws.count * scale))
                        for s in range(count):
                            for k, wl in enumerate(ws.workloads):
                                policy = POLICIES[qs.within_cluster_queue]
                                if out.policies.setdefault(wl.priority, policy) != policy:
                                    raise ConfigError(
                                        f"priority {wl.priority} is used by queues with different "
                                        "withinClusterQueue policies; Quartermaster's priority "
                                        "classes hold one policy each"
                                    )
                                order = s * len(ws.workloads) + k + 1
                                out.workloads.append(
                                    Workload(
                                        name=f"{wl.name}-{ws_index}-{s}-{k}",
                                        queue=queue.name,
                                        class_name=wl.name,
                                        request=wl.request,
                                        priority=wl.priority,
                                        runtime_ms=wl.runtime_ms,
                                        arrival_s=order * ws.interval_ms / 1000.0,
                                        checkpoints=wl.checkpoints,
                                        pods=wl.pods,
                                        topology_level=wl.topology_level,
                                        topology_required=TOPOLOGY_REQUIRED.get(
                                            wl.topology_constraint, True
                                        ),
                                        topology_constraint=wl.topology_constraint,
                                        slice_size=wl.slice_size,
                                    )
                                )
    out.workloads.sort(key=lambda w: w.arrival_s)
    return out


def priority_class_name(value: int) -> str:
    """The priority class that stands for one of the config's priorities."""
    return f"kueue-{value}" if value >= 0 else f"kueue-minus-{-value}"


def kueue_config_path(relative: str = BASELINE) -> Path:
    """A file of Kueue's module, read from the Go module cache (downloaded when missing)."""
    done = subprocess.run(
        ["go", "mod", "download", "-json", KUEUE_MODULE],
        env={**os.environ, "GOFLAGS": "-mod=mod"},
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(json.loads(done.stdout)["Dir"]) / relative


# ------------------------------------------------------------------- the world


def _setup_world(expansion: Expansion) -> tuple[str, dict[str, Any]]:
    """Teams, quotas, the node, priority classes and an admin's API token, through the
    services; returns the token and the teams' limits."""
    user = get_user_model().objects.create_superuser(
        username="kueue-bench", email="kueue-bench@example.org", password=None
    )
    flavor = flavor_create(actor=None, name=expansion.flavor)
    if expansion.topology is None:
        total = sum(q.nominal for queues in expansion.cohorts.values() for q in queues)
        node_upsert(actor=None, name="kueue-quota", flavor=flavor, gpus=total)
    else:
        for name, labels in topology_nodes(expansion.topology).items():
            node_upsert(
                actor=None,
                name=name,
                flavor=flavor,
                gpus=expansion.topology.node_capacity,
                labels=labels,
            )
    classes = [
        priority_class_save(
            actor=None,
            priority_class=PriorityClass(
                name=priority_class_name(value),
                value=value,
                preemption_policy=policy,
                preemptible=True,
                grace_seconds=5,
                # No checkpoint notice before an eviction: Kueue gives none. A workload
                # class that saves when asked to stop does so within the grace window.
                notice_seconds=0,
            ),
        )
        for value, policy in sorted(expansion.policies.items())
    ]
    limits: dict[str, Any] = {}
    for cohort, queues in expansion.cohorts.items():
        parent = team_create(actor=None, slug=cohort, name=cohort)
        quota_set(
            actor=None,
            team=parent,
            flavor=flavor,
            guarantee=sum(q.nominal for q in queues),
            borrow_limit=0,
            lend_limit=0,
        )
        team_priority_classes_set(actor=None, team=parent, priority_classes=classes, may_widen=True)
        for queue in queues:
            team = team_create(actor=None, slug=queue.name, name=queue.name, parent=parent)
            quota_set(
                actor=None,
                team=team,
                flavor=flavor,
                guarantee=queue.nominal,
                borrow_limit=queue.borrowing_limit,
                lend_limit=queue.lending_limit,
            )
            limits[queue.name] = {
                "nominal": queue.nominal,
                "borrowing_limit": queue.borrowing_limit,
            }
    return api_token_create(user=user, name="kueue-bench")[1], limits


def topology_nodes(topology: Topology) -> dict[str, dict[str, str]]:
    """The nodes Kueue's generator creates for `topology` (runner/generator's
    generateTopologyNodes), by name, with their labels.

    Every combination of the levels' domains is a node, named as Kueue names it
    (node-b0-r2-n15). Kueue labels a node with the plain domain at each level
    ("rack-2") and tells domains apart by their whole path from the outermost level;
    Quartermaster tells them apart by the label's value alone, so each label here
    carries the path ("block-0.rack-2"): the same domains, and a rack-2 under another
    block is another rack, as in Kueue.
    """
    nodes: dict[str, dict[str, str]] = {}

    def visit(depth: int, path: list[str]) -> None:
        if depth == len(topology.levels):
            name = "node-" + "-".join(f"{part[0]}{part.rsplit('-', 1)[1]}" for part in path)
            labels = {
                level.node_label: ".".join(path[: i + 1]) for i, level in enumerate(topology.levels)
            }
            if topology.flavor_node_label:
                labels[topology.flavor_node_label] = "tas"
            nodes[name] = labels
            return
        level = topology.levels[depth]
        for i in range(level.count):
            visit(depth + 1, [*path, f"{level.name}-{i}"])

    visit(0, [])
    return nodes


def topology_labels_setting(topology: Topology | None) -> dict[str, str]:
    """QM_TOPOLOGY_LABELS for the config: each of its levels, outermost first, read
    from the node label Kueue's Topology names for it. Without a topology, none."""
    if topology is None:
        return {}
    return {level.name: level.node_label for level in topology.levels}


def queue_limits_env(expansion: Expansion) -> dict[str, str]:
    """Room for the whole config in the queue: Kueue's test keeps thousands of workloads
    waiting at once, all from one client, past the deployment's default caps on
    queued jobs per person (1,000) and per team (2,000), which would refuse them."""
    room = str(max(1, len(expansion.workloads)))
    return {"QM_MAX_QUEUED_JOBS_PER_USER": room, "QM_MAX_QUEUED_JOBS_PER_TEAM": room}


def topology_env(expansion: Expansion) -> dict[str, str]:
    """The settings the processes need for a topology-aware config: its levels
    (QM_TOPOLOGY_LABELS) and the nodes with their domains as the runtime's inventory
    (QM_LOCAL_NODES, name:flavor:gpus:level=domain/...). The runtime's nodes are where
    the engine's topology comes from (the sync_node_topology task writes what the
    runtime reports over the nodes' labels every minute), and the mimic runtime reports
    its inventory, which is otherwise the database's nodes without their topology."""
    topology = expansion.topology
    if topology is None:
        return {}
    labels = topology_labels_setting(topology)
    inventory = []
    for name, node_labels in topology_nodes(topology).items():
        domains = "/".join(f"{level}={node_labels[key]}" for level, key in labels.items())
        inventory.append(f"{name}:{expansion.flavor}:{topology.node_capacity}:{domains}")
    return {
        "QM_TOPOLOGY_LABELS": ",".join(f"{level}={key}" for level, key in labels.items()),
        "QM_LOCAL_NODES": ",".join(inventory),
    }


def placement_check(
    jobs: list[dict[str, Any]], node_labels: dict[str, dict[str, str]], topology: Topology | None
) -> dict[str, Any]:
    """Whether each attempt's ranks sit where its workload asked, from the placements
    recorded (`Attempt.placement`, [{"node", "ranks"}]).

    `jobs` are rows of `_collect`'s, each with its workload's `topology_level`,
    `topology_required` and its attempts' `placements`. An attempt of a workload that
    requires a level and whose nodes span more than one domain of it counts in
    `across_required`; one of a workload that only prefers it, in `across_preferred`
    (allowed, and shown). An attempt whose placement names a node the run does not
    have counts in `unknown_nodes`.
    """
    labels = topology_labels_setting(topology)
    checked = across_required = across_preferred = unknown = 0
    offenders: list[str] = []
    for job in jobs:
        level = job.get("topology_level")
        if not level:
            continue
        key = labels.get(level)
        for placement in job["placements"]:
            checked += 1
            domains = set()
            for entry in placement:
                node = node_labels.get(entry["node"])
                if node is None or key is None or key not in node:
                    unknown += 1
                    domains.add(None)
                else:
                    domains.add(node[key])
            if len(domains) > 1:
                if job["topology_required"]:
                    across_required += 1
                    offenders.append(f"{job['queue']}/{job['name']}")
                else:
                    across_preferred += 1
    return {
        "attempts_checked": checked,
        "across_required": across_required,
        "across_preferred": across_preferred,
        "unknown_nodes": unknown,
        "offenders": offenders[:20],
    }


# --------------------------------------------------------------- the processes


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _database_url() -> str:
    db = connection.settings_dict
    return (
        f"postgres://{db['USER']}:{db['PASSWORD']}@{db['HOST'] or '127.0.0.1'}:"
        f"{db['PORT'] or 5432}/{db['NAME']}"
    )


@contextmanager
def _control_plane(
    var_dir: Path, port: int, *, web_workers: int, extra_env: dict[str, str] | None = None
) -> Iterator[dict[str, Path]]:
    """The portal, a Celery worker and beat, as `make run` starts them, on PostgreSQL
    and Redis with the mimic runtime; stopped (and reaped) on the way out. `extra_env`
    adds QM_ settings of the run's own (`topology_env`)."""
    if not settings.CELERY_BROKER_URL.startswith(("redis://", "rediss://")):
        raise SystemExit("the comparison runs on Redis: set CELERY_BROKER_URL=redis://...")
    # Messages left in the broker by an earlier run would only cost the worker time.
    app.control.purge()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("QM_")},
        "DATABASE_URL": _database_url(),
        "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
        "QM_RUNTIME": "mimic",
        "QM_VAR_DIR": str(var_dir),
        "QM_PUBLIC_URL": f"http://127.0.0.1:{port}",
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "LOG_LEVEL": "WARNING",
    }
    env.update(extra_env or {})
    commands = {
        "web": web_command(bind=f"127.0.0.1:{port}", workers=web_workers, quiet=True),
        "worker": [*worker_command(hostname="kueue-bench@%h"), "--loglevel", "INFO"],
        "beat": beat_command(schedule=var_dir / "celerybeat-schedule", quiet=True),
        "exits": exits_command(),
    }
    logs = {name: var_dir / f"{name}.log" for name in commands}
    children: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, command in commands.items():
            with open(logs[name], "wb") as log:
                children[name] = subprocess.Popen(
                    command,
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        wait_healthy(port, children, timeout=60.0)
        yield logs
    finally:
        for child in children.values():
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGTERM)
        for child in children.values():
            try:
                child.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()


# ------------------------------------------------------------------ submission


def arrival_groups(workloads: list[Workload], *, together: bool) -> list[list[Workload]]:
    """The submissions, in arrival order: with `together`, every group of workloads due
    at the same instant (one tick of every queue's streams) is one batch request; else
    each workload is a request of its own."""
    if not together:
        return [[w] for w in workloads]
    groups: list[list[Workload]] = []
    for workload in workloads:
        if groups and groups[-1][0].arrival_s == workload.arrival_s:
            groups[-1].append(workload)
        else:
            groups.append([workload])
    return groups


def _job_body(workload: Workload, flavor: str) -> dict[str, Any]:
    return {
        "team": workload.queue,
        "flavor": flavor,
        "priority_class": priority_class_name(workload.priority),
        "ranks": workload.pods,
        "gpus_per_rank": workload.request,
        "command": f"sleep {workload.runtime_ms / 1000:g}",
        "name": workload.name,
        "max_attempts": 100,
        "env": workload.checkpoints.env(),
        "topology_level": workload.topology_level or "",
        "topology_required": workload.topology_required,
    }


class _Submitter(threading.Thread):
    """One API client: takes the next group of workloads due, waits for its arrival time
    and submits it on a keep-alive connection, a group of one to POST /jobs/ and a larger
    one to POST /jobs/batch/."""

    def __init__(
        self,
        port: int,
        token: str,
        flavor: str,
        groups: list[list[Workload]],
        cursor: Iterator[int],
        lock: threading.Lock,
        start: float,
    ) -> None:
        super().__init__(daemon=True)
        self.port, self.token, self.flavor = port, token, flavor
        self.groups, self.cursor, self.lock, self.start_at = groups, cursor, lock, start
        self.latencies: list[float] = []
        self.late: list[float] = []
        self.errors: list[str] = []
        # When each workload's request was answered: by then its job had committed.
        self.answered: dict[tuple[str, str], float] = {}

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        while True:
            with self.lock:
                index = next(self.cursor, None)
            if index is None:
                break
            group = self.groups[index]
            due = self.start_at + group[0].arrival_s
            time.sleep(max(0.0, due - time.time()))
            if len(group) == 1:
                path, body = "/api/v1/jobs/", _job_body(group[0], self.flavor)
            else:
                path = "/api/v1/jobs/batch/"
                body = {"jobs": [_job_body(w, self.flavor) for w in group]}
            what = f"{group[0].queue}/{group[0].name}" + (
                f" and {len(group) - 1} more" if len(group) > 1 else ""
            )
            sent = time.time()
            self.late.append(sent - due)
            try:
                connection.request("POST", path, body=json.dumps(body), headers=headers)
                response = connection.getresponse()
                text = response.read()
                if response.status != 201:
                    self.errors.append(f"{what}: {response.status} {text[:200]!r}")
                answered = time.time()
                self.answered.update({(w.queue, w.name): answered for w in group})
            except (OSError, http.client.HTTPException) as error:
                self.errors.append(f"{what}: {error!r}")
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            self.latencies.append(time.time() - sent)
        connection.close()


# --------------------------------------------------------------------- figures


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def at(fraction: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]

    return {
        "mean_s": statistics.fmean(ordered),
        "p50_s": at(0.50),
        "p99_s": at(0.99),
    }


def _peak(intervals: list[tuple[float, float, int]]) -> int:
    """The most GPUs held at once by the given (start, end, gpus) intervals; an interval
    ending at the instant another starts does not overlap it."""
    points = sorted(
        [(end, -gpus) for _, end, gpus in intervals] + [(s, g) for s, _, g in intervals]
    )
    held = peak = 0
    for _, change in points:
        held += change
        peak = max(peak, held)
    return peak


def _work_lost(mimic_root: Path, job_classes: dict[int, tuple[str, int]]) -> dict[str, Any]:
    """The work the preempted attempts lost, from the mimic runtime's records.

    An attempt stopped before the end of its work lost the progress no checkpoint kept
    (`gang_progress`), times its GPUs; the job's next attempt does exactly that again.
    `job_classes` maps each job of the run to its workload class and GPUs. The shape is
    that of Kueue's side (bench/kueue_reclaim.py), whose runner restarts a victim from
    the start, so its `rerun_gpu_seconds` exceed its `lost_gpu_seconds`; here they agree.
    """
    now = time.time()
    by_class: dict[str, dict[str, float]] = {}
    victims: set[int] = set()
    evictions = 0
    lost = 0.0
    for gang, record in MimicRuntime(mimic_root, []).records():
        if gang.job_id not in job_classes:
            continue
        if not (record.get("signal_sent_at") or record.get("killed_at")):
            continue
        progress = gang_progress(record, now)
        if progress.kept >= float(record["total"]):
            continue  # asked to stop as it finished: nothing to do again
        class_name, gpus = job_classes[gang.job_id]
        entry = by_class.setdefault(
            class_name, {"victims": 0, "evictions": 0, "lost_gpu_seconds": 0.0}
        )
        entry["victims"] += gang.job_id not in victims
        entry["evictions"] += 1
        entry["lost_gpu_seconds"] += progress.lost * gpus
        victims.add(gang.job_id)
        evictions += 1
        lost += progress.lost * gpus
    return {
        "evictions": evictions,
        "victims": len(victims),
        "lost_gpu_seconds": round(lost, 1),
        "rerun_gpu_seconds": round(lost, 1),
        "by_class": by_class,
    }


def _collect(
    expansion: Expansion,
    limits: dict[str, Any],
    start: float,
    finished_at: float,
    mimic_root: Path,
) -> dict[str, Any]:
    classes = {(w.queue, w.name): w for w in expansion.workloads}
    jobs = list(
        Job.objects.filter(team__slug__in=limits).values(
            "id",
            "name",
            "team__slug",
            "state",
            "submitted_at",
            "finished_at",
            "ranks",
            "gpus_per_rank",
        )
    )
    attempts: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for attempt in Attempt.objects.filter(job_id__in=[j["id"] for j in jobs]).values(
        "job_id", "number", "admitted_at", "launched_at", "ended_at", "end_reason", "placement"
    ):
        attempts[attempt["job_id"]].append(attempt)
    # When victims were first chosen for each job: the GPUs they release are kept for it.
    freed_for = dict(
        PreemptionEvent.objects.preemptions()
        .filter(preemptor_id__in=[j["id"] for j in jobs])
        .values("preemptor_id")
        .annotate(first=Min("decided_at"))
        .values_list("preemptor_id", "first")
    )
    admission: dict[str, list[float]] = defaultdict(list)
    launch_delay: list[float] = []
    end_delay: list[float] = []
    held: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    rows = []
    gpu_seconds = 0.0
    for job in jobs:
        workload = classes[(job["team__slug"], job["name"])]
        tries = sorted(attempts[job["id"]], key=lambda a: a["number"])
        submitted = job["submitted_at"].timestamp()
        admitted = tries[-1]["admitted_at"].timestamp() if tries else None
        if admitted is not None:
            # A cycle stamps an admission as it writes it, after the snapshot that saw
            # the submission; the floor keeps a clock step from counting below zero.
            admission[workload.class_name].append(max(0.0, admitted - submitted))
        for attempt in tries:
            begin = attempt["admitted_at"].timestamp()
            end = attempt["ended_at"].timestamp() if attempt["ended_at"] else finished_at
            gpus = job["ranks"] * job["gpus_per_rank"]
            held[job["team__slug"]].append((begin, end, gpus))
            gpu_seconds += gpus * (end - begin)
            if attempt["launched_at"] is not None:
                launched = attempt["launched_at"].timestamp()
                launch_delay.append(launched - begin)
                if attempt["end_reason"] == "succeeded" and attempt["ended_at"]:
                    # The mimicked ranks exit `runtime` after the launch; the rest is
                    # the reconciler noticing it.
                    end_delay.append(end - launched - workload.runtime_ms / 1000)
        rows.append(
            {
                "name": job["name"],
                "queue": job["team__slug"],
                "class": workload.class_name,
                "priority": workload.priority,
                "arrival_s": workload.arrival_s,
                "submitted_s": submitted - start,
                "admitted_s": None if admitted is None else admitted - start,
                "first_admitted_s": tries[0]["admitted_at"].timestamp() - start if tries else None,
                "victims_chosen_s": freed_for[job["id"]].timestamp() - start
                if job["id"] in freed_for
                else None,
                "state": job["state"],
                "attempts": len(tries),
                "topology_level": workload.topology_level,
                "topology_required": workload.topology_required,
                "placements": [attempt["placement"] for attempt in tries],
            }
        )
    capacity = sum(q["nominal"] for q in limits.values())
    total_s = finished_at - start
    states: dict[str, int] = defaultdict(int)
    for job in jobs:
        states[job["state"]] += 1
    return {
        "workloads": len(expansion.workloads),
        "submitted": len(jobs),
        "states": dict(states),
        "total_s": total_s,
        "admission": {name: _quantiles(values) for name, values in sorted(admission.items())},
        "usage": gpu_seconds / (capacity * total_s) if total_s > 0 else 0.0,
        "preemptions": PreemptionEvent.objects.preemptions()
        .filter(job_id__in=[j["id"] for j in jobs])
        .count(),
        "launch_after_admission": _quantiles(launch_delay) if launch_delay else {},
        "end_noticed_after_exit": _quantiles(end_delay) if end_delay else {},
        "gpu_seconds": {
            "held": gpu_seconds,
            "work": sum(w.units * w.runtime_ms / 1000 for w in expansion.workloads),
        },
        "teams": {
            slug: {**limit, "peak_gpus": _peak(held.get(slug, []))}
            for slug, limit in limits.items()
        },
        "reclaim": _work_lost(
            mimic_root,
            {
                j["id"]: (
                    classes[(j["team__slug"], j["name"])].class_name,
                    j["ranks"] * j["gpus_per_rank"],
                )
                for j in jobs
            },
        ),
        "placement": placement_check(
            rows,
            {n["name"]: n["labels"] for n in Node.objects.values("name", "labels")},
            expansion.topology,
        ),
        "unit_millis": expansion.unit_millis,
        "jobs": rows,
    }


def _cycle_times(worker_log: Path) -> dict[str, Any]:
    """The worker's own account of its tasks: how many ran and how long they took."""
    pattern = re.compile(r"Task (preemption\.tasks\.\w+)\[[^\]]+\] succeeded in ([0-9.]+)s")
    spent: dict[str, list[float]] = defaultdict(list)
    for line in worker_log.read_text(errors="replace").splitlines():
        match = pattern.search(line)
        if match:
            spent[match.group(1)].append(float(match.group(2)))
    return {
        task.rsplit(".", 1)[1]: {
            "count": len(values),
            "total_s": sum(values),
            "mean_s": statistics.fmean(values),
            "max_s": max(values),
        }
        for task, values in spent.items()
    }


class _Probe(threading.Thread):
    """Times the cycle's first two steps (the snapshot from the database and the plan)
    on the live database every `every_s` seconds, reading only, so a run says where
    its cycle time goes; the rest of a cycle is writing the decisions."""

    def __init__(self, every_s: float, start: float) -> None:
        super().__init__(daemon=True)
        self.every_s, self.start_at = every_s, start
        self.stop = threading.Event()
        self.samples: list[dict[str, float]] = []

    def run(self) -> None:
        try:
            while not self.stop.wait(self.every_s):
                with transaction.atomic():
                    began = time.perf_counter()
                    snapshot = build_snapshot(now=timezone.now(), held=held_jobs())
                    built = time.perf_counter()
                    plan = fairshare.plan(snapshot)
                    planned = time.perf_counter()
                self.samples.append(
                    {
                        "at_s": time.time() - self.start_at,
                        "workloads": len(snapshot.workloads),
                        "admits": len(plan.admit),
                        "snapshot_s": built - began,
                        "plan_s": planned - built,
                    }
                )
        finally:
            connection.close()


# ------------------------------------------------------------------------ run


def run_quartermaster(
    generator_config_path: Path,
    *,
    scale: float = 1.0,
    clients: int = 16,
    web_workers: int = 3,
    timeout_s: float = 3600.0,
    var_dir: Path | None = None,
    probe_every_s: float | None = None,
    together: bool = True,
) -> dict[str, Any]:
    """Run the config's workloads through the portal, the worker and the mimic runtime.

    With `together` (the default), the workloads due at the same instant are submitted
    as one batch (POST /jobs/batch/), as a client with a whole tick's worth of jobs in
    hand would; without it, each with its own POST /jobs/, as Kueue's runner creates
    each Workload with its own call to the API server.

    Needs Django set up on an empty PostgreSQL database that the started processes can
    reach (the caller's connection), and a Redis broker. Returns `total_s`,
    `admission` ({class: {"mean_s", "p50_s", "p99_s"}}), `usage`, `preemptions`, and
    beside them the submission's latency, each team's peak against its limits, the
    worker's task times and one row per job. With `probe_every_s`, also timings of
    the snapshot and the plan taken on the live database while the run goes on.
    """
    expansion = expand(load_config(Path(generator_config_path)), scale)
    token, limits = _setup_world(expansion)
    topology_labels = topology_labels_setting(expansion.topology)
    own_dir = var_dir is None
    if var_dir is None:
        folder = Path(tempfile.mkdtemp(prefix="qm-kueue-", dir=_scratch_parent()))
    else:
        folder = Path(var_dir)
    port = _free_port()
    try:
        with (
            override_settings(QM_TOPOLOGY_LABELS=topology_labels)
            if topology_labels
            else nullcontext(),
            _control_plane(
                folder,
                port,
                web_workers=web_workers,
                extra_env={**queue_limits_env(expansion), **topology_env(expansion)},
            ) as logs,
        ):
            start = time.time() + 1.0
            groups = arrival_groups(expansion.workloads, together=together)
            cursor = iter(range(len(groups)))
            lock = threading.Lock()
            probe = _Probe(probe_every_s, start) if probe_every_s else None
            if probe is not None:
                probe.start()
            submitters = [
                _Submitter(port, token, expansion.flavor, groups, cursor, lock, start)
                for _ in range(clients)
            ]
            for submitter in submitters:
                submitter.start()
            for submitter in submitters:
                submitter.join()
            submitted_by = time.time() - start
            finished_at = _wait_finished(set(limits), start + timeout_s)
            if probe is not None:
                probe.stop.set()
                probe.join()
        # The runtime's root under the processes' QM_VAR_DIR (settings.QM_RUNS_DIR's default).
        figures = _collect(expansion, limits, start, finished_at, folder / "runs" / "mimic")
        figures["worker_tasks"] = _cycle_times(logs["worker"])
        answered = {key: at for s in submitters for key, at in s.answered.items()}
        for row in figures["jobs"]:
            row["answered_s"] = answered[(row["queue"], row["name"])] - start
    finally:
        if own_dir:
            shutil.rmtree(folder, ignore_errors=True)
    latencies = [x for s in submitters for x in s.latencies]
    figures["submission"] = {
        "requests": len(groups),
        "done_s": submitted_by,
        "errors": [e for s in submitters for e in s.errors],
        **{f"request_{k}": v for k, v in _quantiles(latencies).items()},
        "late_max_s": max(x for s in submitters for x in s.late),
    }
    figures["scale"] = scale
    if probe is not None:
        figures["probes"] = probe.samples
    return figures


def _scratch_parent() -> Path:
    """Where a run's folder goes: in memory (/dev/shm) where the machine has it, else
    under the project's var folder.

    The mimic runtime creates a file for each launch and each stop, and what that
    costs on a disk depends on the folder, not only on the disk: on this project's
    2-core machine, creating a file took 0.03-0.05 ms in some folders of its ext4
    root and 0.7-0.95 ms in others (the inode allocator searching the folder's
    block group), and which folders were slow changed from day to day. A launch batch
    of 150 jobs then spent up to 0.15 s creating records, a cost of the disk that
    Kueue's runner, whose timers live in memory, does not pay. In memory it is
    0.02 ms. mkdtemp makes the folder private (0700) under a name no other user of
    the machine can take first."""
    memory = Path("/dev/shm")
    if memory.is_dir() and os.access(memory, os.W_OK | os.X_OK):
        return memory
    scratch = ROOT / "var" / "bench" / "qm"
    scratch.mkdir(parents=True, exist_ok=True)
    return scratch


def _wait_finished(teams: set[str], deadline: float) -> float:
    """When the last job ended; raises when jobs are still open at the deadline."""
    jobs = Job.objects.filter(team__slug__in=teams)
    while True:
        open_jobs = jobs.exclude(state__in=FINAL_STATES).count()
        if open_jobs == 0:
            last = jobs.aggregate(last=Max("finished_at"))["last"]
            return float(last.timestamp()) if last else time.time()
        if time.time() > deadline:
            raise TimeoutError(f"{open_jobs} jobs were still open at the deadline")
        time.sleep(0.5)


def run_on_fresh_database(
    generator_config_path: Path, *, scale: float = 1.0, keep: bool = False, **options: Any
) -> dict[str, Any]:
    """`run_quartermaster` on a database of its own: `test_<name>` of DATABASE_URL's
    database, created and migrated first and dropped at the end unless `keep`."""
    name = connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        return run_quartermaster(generator_config_path, scale=scale, **options)
    finally:
        # The started processes are gone; this process's own connection goes too, or
        # the database could not be dropped.
        connection.close()
        if not keep:
            connection.creation.destroy_test_db(name, verbosity=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", help="a generator config (default: Kueue's baseline)")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--keep", action="store_true", help="keep the database for a look")
    parser.add_argument("--probe", type=float, help="time the snapshot and plan every N s")
    parser.add_argument(
        "--one-by-one",
        action="store_true",
        help="submit each workload with its own POST /jobs/ instead of one batch per instant",
    )
    args = parser.parse_args()

    config = Path(args.config) if args.config else kueue_config_path()
    figures = run_on_fresh_database(
        config,
        scale=args.scale,
        keep=args.keep,
        probe_every_s=args.probe,
        together=not args.one_by_one,
    )
    jobs = figures.pop("jobs")
    shown = {k: v for k, v in figures.items() if k not in ("teams", "probes")}
    print(json.dumps(shown, indent=1))
    probes = figures.get("probes") or []
    for sample in probes:
        print(
            f"probe at {sample['at_s']:6.1f} s: {sample['workloads']:5d} workloads, "
            f"snapshot {sample['snapshot_s']:.3f} s, plan {sample['plan_s']:.3f} s, "
            f"{sample['admits']} admits"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({**figures, "jobs": jobs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
