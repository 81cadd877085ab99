"""Kueue's side of the reclaim comparison: owners come back for the quota they lent.

Runs Kueue's own runner and minimalkueue (bench/kueue_side.py) on a generator
config of our own, bench/kueue_configs/reclaim/generator.yaml: in each cohort,
borrower queues fill the whole cohort with long workloads at once, and the owner
queues, whose quota that borrowing used, submit their own work later with
``reclaimWithinCohort: Any``, so Kueue preempts borrowers to give the owners
their nominal quota back.

Kueue's recorder counts evictions per workload class but not the work a victim
had done when it was evicted, so this module also watches the Workload objects
through the API server the runner starts (its kubeconfig lands in the run's
output folder) and notes, for every workload, when it was admitted and when it
was evicted. The runner mimics execution by counting a workload's runtime from
its admission and starts that count again after a re-admission: a victim runs
again everything it ran since its admission (``rerun_gpu_seconds``). The config's
workload classes say how often their work is checkpointed (``checkpointEveryMs``,
a key of our own that Kueue's generator ignores); the work a victim lost is what it
ran since its last regular checkpoint (``lost_gpu_seconds``), since Kueue knows of
no checkpoint to ask for before it evicts. Both are times the workload's request
(quota units; the generator requests ``cpu``, which stands for GPUs in this
comparison). Quartermaster's side of the same config is bench/kueue_qm.py's
``reclaim`` figures.

Kueue's generator has no ``borrowWithinCohort`` setting (its QueuesSet carries
nominalQuota, borrowingLimit, reclaimWithinCohort and withinClusterQueue only,
and it reads configs leniently, so an extra key would be dropped without a word);
the scenario therefore relies on ``reclaimWithinCohort`` alone.

Usage: .venv/bin/python bench/kueue_reclaim.py [--config PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import yaml  # noqa: E402
from kubernetes import client, config, watch  # noqa: E402
from kubernetes.utils import parse_quantity  # noqa: E402

from bench.kueue_side import KueueRunError, run_kueue  # noqa: E402

RECLAIM_CONFIG = REPO_ROOT / "bench" / "kueue_configs" / "reclaim" / "generator.yaml"
CLASS_LABEL = "kueue.x-k8s.io/performance-scheduler-class"
GROUP, VERSION, PLURAL = "kueue.x-k8s.io", "v1beta2", "workloads"


@dataclass
class Eviction:
    ran_s: float
    request: float
    reason: str


@dataclass
class WorkloadHistory:
    name: str
    class_name: str
    request: float
    admitted_at: float | None = None
    evicted: bool = False
    evictions: list[Eviction] = field(default_factory=list)


def checkpoint_every(generator_config: Path) -> dict[str, float]:
    """Seconds between regular checkpoints for each workload class of the config that
    names its cadence (`checkpointEveryMs`)."""
    data = yaml.safe_load(Path(generator_config).read_text()) or {}
    every: dict[str, float] = {}
    for cohort in data.get("cohorts") or []:
        for queue_set in cohort.get("queuesSets") or []:
            for workload_set in queue_set.get("workloadsSets") or []:
                for workload in workload_set.get("workloads") or []:
                    if workload.get("checkpointEveryMs"):
                        every[str(workload["className"])] = workload["checkpointEveryMs"] / 1000
    return every


def lost_since_checkpoint(ran_s: float, every_s: float | None) -> float:
    """Seconds of work since the last regular checkpoint, after `ran_s` from the start."""
    if not every_s:
        return ran_s
    return ran_s - math.floor(ran_s / every_s) * every_s


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return None


def _is_true(obj: dict[str, Any], kind: str) -> bool:
    cond = _condition(obj, kind)
    return cond is not None and cond.get("status") == "True"


def _request(obj: dict[str, Any]) -> float:
    total = 0.0
    for pod_set in (obj.get("spec") or {}).get("podSets") or []:
        count = pod_set.get("count", 1)
        for container in pod_set["template"]["spec"].get("containers") or []:
            requests = (container.get("resources") or {}).get("requests") or {}
            if "cpu" in requests:
                total += float(parse_quantity(requests["cpu"])) * count
    return total


class WorkloadWatch:
    """Follows every Workload's admissions and evictions as the API server reports them.

    Times are taken when the watch event arrives (the conditions' own
    lastTransitionTime has whole-second resolution only).
    """

    def __init__(self, kubeconfig: Path, every: dict[str, float] | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.every = every or {}
        self.workloads: dict[str, WorkloadHistory] = {}
        self.stop_event = threading.Event()
        self.error: str | None = None

    def observe(self, obj: dict[str, Any], now: float) -> None:
        meta = obj["metadata"]
        history = self.workloads.get(meta["uid"])
        if history is None:
            history = WorkloadHistory(
                name=f"{meta['namespace']}/{meta['name']}",
                class_name=(meta.get("labels") or {}).get(CLASS_LABEL, ""),
                request=_request(obj),
            )
            self.workloads[meta["uid"]] = history
        admitted = _is_true(obj, "Admitted")
        evicted = _is_true(obj, "Evicted")
        if evicted and not history.evicted and history.admitted_at is not None:
            cond = _condition(obj, "Evicted") or {}
            history.evictions.append(
                Eviction(now - history.admitted_at, history.request, str(cond.get("reason", "")))
            )
            history.admitted_at = None
        elif admitted and not evicted and history.admitted_at is None:
            history.admitted_at = now
        elif not admitted:
            history.admitted_at = None
        history.evicted = evicted

    def run(self) -> None:
        while not self.kubeconfig.is_file():
            if self.stop_event.wait(0.05):
                return
        # The runner writes the kubeconfig in one call; give it a moment to land whole.
        time.sleep(0.2)
        configuration = client.Configuration()
        config.load_kube_config(
            config_file=str(self.kubeconfig), client_configuration=configuration
        )
        # The API server goes away when the runner ends, before this watch is told to
        # stop: a refused connection is handled below, not retried and logged by urllib3.
        configuration.retries = 0
        api = client.CustomObjectsApi(client.ApiClient(configuration))
        resource_version = None
        while not self.stop_event.is_set():
            try:
                if resource_version is None:
                    listing = api.list_cluster_custom_object(GROUP, VERSION, PLURAL)
                    now = time.time()
                    for obj in listing.get("items", []):
                        self.observe(obj, now)
                    resource_version = listing["metadata"]["resourceVersion"]
                stream = watch.Watch().stream(
                    api.list_cluster_custom_object,
                    GROUP,
                    VERSION,
                    PLURAL,
                    resource_version=resource_version,
                    timeout_seconds=5,
                )
                for event in stream:
                    obj = event["object"]
                    resource_version = obj["metadata"]["resourceVersion"]
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self.observe(obj, time.time())
                    if self.stop_event.is_set():
                        break
            except Exception as exc:  # the API server goes away when the runner ends
                if self.stop_event.is_set():
                    return
                self.error = f"{type(exc).__name__}: {exc}"
                if self.stop_event.wait(0.5):
                    return
                resource_version = None

    def figures(self) -> dict[str, Any]:
        victims = [h for h in self.workloads.values() if h.evictions]
        by_class: dict[str, dict[str, float]] = {}
        reasons: dict[str, int] = {}
        evictions = 0
        lost = rerun = 0.0
        for h in victims:
            every = self.every.get(h.class_name)
            entry = by_class.setdefault(
                h.class_name, {"victims": 0, "evictions": 0, "lost_gpu_seconds": 0.0}
            )
            entry["victims"] += 1
            for e in h.evictions:
                entry["evictions"] += 1
                entry["lost_gpu_seconds"] += lost_since_checkpoint(e.ran_s, every) * e.request
                lost += lost_since_checkpoint(e.ran_s, every) * e.request
                rerun += e.ran_s * e.request
                reasons[e.reason] = reasons.get(e.reason, 0) + 1
                evictions += 1
        return {
            "workloads_seen": len(self.workloads),
            "evictions": evictions,
            "victims": len(victims),
            "lost_gpu_seconds": round(lost, 1),
            "rerun_gpu_seconds": round(rerun, 1),
            "eviction_reasons": reasons,
            "by_class": by_class,
        }


def run_kueue_reclaim(
    generator_config: Path = RECLAIM_CONFIG, *, timeout: str = "20m"
) -> dict[str, Any]:
    """Kueue's figures on the reclaim config plus the work its victims lost."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    output_dir = REPO_ROOT / "var" / "bench" / "kueue" / f"reclaim-{stamp}"
    output_dir.mkdir(parents=True)
    observer = WorkloadWatch(output_dir / "kubeconfig", checkpoint_every(generator_config))
    thread = threading.Thread(target=observer.run, daemon=True)
    thread.start()
    try:
        result = run_kueue(generator_config, output_dir=output_dir, timeout=timeout)
    finally:
        observer.stop_event.set()
        thread.join(timeout=30)
    result["reclaim"] = observer.figures()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=RECLAIM_CONFIG)
    args = parser.parse_args(argv)
    try:
        result = run_kueue_reclaim(args.config)
    except KueueRunError as exc:
        print(f"kueue_reclaim: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
