"""How bench/kueue_reclaim.py turns Workload updates into lost work: pure logic over objects
shaped as the API server returns Kueue's v1beta2 Workloads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.kueue_reclaim import (
    RECLAIM_CONFIG,
    WorkloadWatch,
    checkpoint_every,
    lost_since_checkpoint,
)


def workload(uid: str, *conditions: tuple[str, str, str], cpu: str = "10") -> dict[str, Any]:
    return {
        "metadata": {
            "uid": uid,
            "name": f"borrower-0-{uid}",
            "namespace": "borrower-1-0-cohort-0",
            "labels": {"kueue.x-k8s.io/performance-scheduler-class": "borrower"},
        },
        "spec": {
            "podSets": [
                {
                    "name": "main",
                    "count": 1,
                    "template": {
                        "spec": {"containers": [{"resources": {"requests": {"cpu": cpu}}}]}
                    },
                }
            ]
        },
        "status": {
            "conditions": [
                {"type": kind, "status": status, "reason": reason}
                for kind, status, reason in conditions
            ]
        },
    }


ADMITTED = ("Admitted", "True", "Admitted")
NOT_ADMITTED = ("Admitted", "False", "NoReservation")
EVICTED = ("Evicted", "True", "Preempted")
NOT_EVICTED = ("Evicted", "False", "QuotaReserved")


def test_work_since_admission_is_lost_at_each_eviction() -> None:
    watch = WorkloadWatch(Path("kubeconfig-never-read"))
    watch.observe(workload("a"), 100.0)  # created, pending
    watch.observe(workload("a", ADMITTED), 101.0)
    watch.observe(workload("a", ADMITTED), 105.0)  # an unrelated update changes nothing
    watch.observe(workload("a", ADMITTED, EVICTED), 113.0)  # preempted after 12 s
    watch.observe(workload("a", NOT_ADMITTED, EVICTED), 113.5)  # the runner gives the quota back
    watch.observe(workload("a", ADMITTED, NOT_EVICTED), 140.0)  # admitted again: counting restarts
    watch.observe(workload("a", ADMITTED, EVICTED), 143.0)  # preempted again after 3 s
    watch.observe(workload("b", ADMITTED), 100.0)  # never evicted: loses nothing

    figures = watch.figures()
    assert figures["workloads_seen"] == 2
    assert figures["victims"] == 1
    assert figures["evictions"] == 2
    assert figures["lost_gpu_seconds"] == pytest.approx((12 + 3) * 10)
    assert figures["rerun_gpu_seconds"] == pytest.approx((12 + 3) * 10)
    assert figures["eviction_reasons"] == {"Preempted": 2}
    assert figures["by_class"]["borrower"]["lost_gpu_seconds"] == pytest.approx(150)


def test_an_eviction_before_any_admission_loses_nothing() -> None:
    watch = WorkloadWatch(Path("kubeconfig-never-read"))
    watch.observe(workload("a", NOT_ADMITTED, EVICTED), 100.0)
    assert watch.figures()["evictions"] == 0


def test_requests_in_millicores_are_read_as_units() -> None:
    watch = WorkloadWatch(Path("kubeconfig-never-read"))
    watch.observe(workload("a", ADMITTED, cpu="2500m"), 10.0)
    watch.observe(workload("a", ADMITTED, EVICTED, cpu="2500m"), 14.0)
    assert watch.figures()["lost_gpu_seconds"] == pytest.approx(10.0)


def test_a_class_that_checkpoints_loses_only_the_work_since_its_last_checkpoint() -> None:
    watch = WorkloadWatch(Path("kubeconfig-never-read"), {"borrower": 5.0})
    watch.observe(workload("a", ADMITTED), 100.0)
    watch.observe(workload("a", ADMITTED, EVICTED), 112.0)  # checkpoints at 5 and 10 s
    watch.observe(workload("a", ADMITTED, NOT_EVICTED), 120.0)
    watch.observe(workload("a", ADMITTED, EVICTED), 123.0)  # none yet: 3 s lost
    figures = watch.figures()
    assert figures["lost_gpu_seconds"] == pytest.approx((2 + 3) * 10)
    # Kueue's runner starts a victim over: it runs everything again.
    assert figures["rerun_gpu_seconds"] == pytest.approx((12 + 3) * 10)
    assert figures["by_class"]["borrower"] == {
        "victims": 1,
        "evictions": 2,
        "lost_gpu_seconds": pytest.approx(50),
    }


def test_the_cadence_is_read_per_class_from_the_config() -> None:
    assert checkpoint_every(RECLAIM_CONFIG) == {"borrower": 10.0}
    assert lost_since_checkpoint(25.0, 10.0) == pytest.approx(5.0)
    assert lost_since_checkpoint(25.0, None) == 25.0
