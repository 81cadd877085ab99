"""The plan's minimum runtimes, parameters of the snapshot: the fair-share anti-flap margin,
the minimum runtime before consolidation moves a job, the priority and reclaim minimums
(none by default), and each class's own minimum per preemption reason."""

from __future__ import annotations

import dataclasses
import json

import pytest
from fairshare_builders import CLASSES, cluster, nodes, preempted, reasons, run_plan, team
from fairshare_builders import workload as w

from fairshare import (
    ScenarioError,
    Snapshot,
    minimum_runtimes,
    plan,
    snapshot_from_dict,
    snapshot_to_dict,
)

N2 = nodes("n", 2, 8)
CLASS = {c.name: c for c in CLASSES}


def _borrowers(since: float) -> Snapshot:
    # Two borrowers without guarantees: a holds both nodes, started ``since`` seconds ago,
    # and b waits with nothing; a2 is the cheaper victim (less work lost).
    return cluster(
        N2,
        [team("a"), team("b")],
        [
            w("a1").gpus(8).running("n0", since=since),
            w("a2").gpus(8).running("n1", since=since, checkpoint=since / 2),
            w("b1").queue("b").gpus(8),
        ],
    )


def _scattered() -> Snapshot:
    # a's gang of 8 fits its guarantee; 6 GPUs are free but split 4 + 2.
    return cluster(
        N2,
        [team("a", guarantee=8), team("b", guarantee=8)],
        [
            w("b1").queue("b").gpus(4).running("n0", since=300),
            w("b2").queue("b").gpus(2).running("n1", since=300),
            w("a1").gpus(8),
        ],
    )


def test_defaults_are_one_minute_and_ten_minutes() -> None:
    snapshot = _borrowers(60)
    assert snapshot.fair_share_min_runtime_seconds == 60.0
    assert snapshot.consolidation_min_runtime_seconds == 600.0


@pytest.mark.parametrize(
    ("since", "threshold", "taken"),
    [(60, 60.0, True), (59, 60.0, False), (60, 120.0, False), (10, 0.0, True)],
)
def test_fair_share_moves_respect_the_anti_flap_margin(
    since: float, threshold: float, taken: bool
) -> None:
    snapshot = dataclasses.replace(_borrowers(since), fair_share_min_runtime_seconds=threshold)
    p = run_plan(snapshot)
    if taken:
        assert preempted(p) == {"a2": "fair-share"}
    else:
        assert preempted(p) == {}
        assert "free GPUs" in reasons(p)["b1"]


@pytest.mark.parametrize(("threshold", "moved"), [(600.0, False), (300.0, True), (301.0, False)])
def test_consolidation_moves_only_jobs_past_its_minimum_runtime(
    threshold: float, moved: bool
) -> None:
    snapshot = dataclasses.replace(_scattered(), consolidation_min_runtime_seconds=threshold)
    p = run_plan(snapshot)
    assert preempted(p) == ({"b2": "consolidate"} if moved else {})


def test_scenario_format_reads_writes_and_checks_the_thresholds() -> None:
    document = snapshot_to_dict(_scattered())
    assert document["consolidation_min_runtime_seconds"] == 600.0
    document["consolidation_min_runtime_seconds"] = 300
    document["fair_share_min_runtime_seconds"] = 5
    snapshot = snapshot_from_dict(json.loads(json.dumps(document)))
    assert snapshot.consolidation_min_runtime_seconds == 300.0
    assert snapshot.fair_share_min_runtime_seconds == 5.0
    assert preempted(plan(snapshot)) == {"b2": "consolidate"}
    del document["consolidation_min_runtime_seconds"]
    assert snapshot_from_dict(document).consolidation_min_runtime_seconds == 600.0

    document["fair_share_min_runtime_seconds"] = -1
    with pytest.raises(
        ScenarioError, match=r"^fair_share_min_runtime_seconds: must not be negative"
    ):
        snapshot_from_dict(document)
    document["fair_share_min_runtime_seconds"] = "soon"
    with pytest.raises(ScenarioError, match=r"^fair_share_min_runtime_seconds: expected a number"):
        snapshot_from_dict(document)


def test_a_negative_threshold_in_a_snapshot_is_refused() -> None:
    snapshot = dataclasses.replace(_scattered(), consolidation_min_runtime_seconds=-5.0)
    with pytest.raises(ScenarioError, match=r"^consolidation_min_runtime_seconds: must not"):
        plan(snapshot)


def _reclaim_from_b(since: float) -> Snapshot:
    # b borrows n1 with a job started ``since`` seconds ago; a's job fits its guarantee.
    return cluster(
        N2,
        [team("a", guarantee=8), team("b", guarantee=8)],
        [
            w("b1").queue("b").cls("low").gpus(8).running("n0", since=7200),
            w("b2").queue("b").cls("low").gpus(8).running("n1", since=since, checkpoint=0),
            w("a1").gpus(8),
        ],
    )


def test_priority_and_reclaim_minimums_default_to_none() -> None:
    snapshot = _reclaim_from_b(1.0)
    assert snapshot.priority_min_runtime_seconds == 0.0
    assert snapshot.reclaim_min_runtime_seconds == 0.0
    assert minimum_runtimes(snapshot, CLASS["low"]) == {
        "priority": 0.0,
        "fair-share": 60.0,
        "reclaim": 0.0,
        "consolidate": 600.0,
    }
    # The class floor raises every reason but reclaim; fair share follows reclaim.
    assert minimum_runtimes(snapshot, CLASS["fresh"]) == {
        "priority": 600.0,
        "fair-share": 600.0,
        "reclaim": 0.0,
        "consolidate": 600.0,
    }
    assert minimum_runtimes(snapshot, CLASS["steady"])["fair-share"] == 900.0
    # A class may not lower the fair-share minimum below the plan's anti-flap margin.
    assert minimum_runtimes(snapshot, CLASS["nimble"])["fair-share"] == 60.0


@pytest.mark.parametrize(("since", "protected"), [(100.0, True), (300.0, False)])
def test_the_reclaim_minimum_protects_the_cheapest_victim(since: float, protected: bool) -> None:
    snapshot = dataclasses.replace(_reclaim_from_b(since), reclaim_min_runtime_seconds=300.0)
    # b2 lost no work since its checkpoint: the cheapest victim unless protected.
    assert preempted(run_plan(snapshot)) == ({"b1": "reclaim"} if protected else {"b2": "reclaim"})


def test_scenario_format_reads_writes_and_checks_minimums_per_reason() -> None:
    document = snapshot_to_dict(_reclaim_from_b(100.0))
    assert document["reclaim_min_runtime_seconds"] == 0.0
    assert document["priority_min_runtime_seconds"] == 0.0
    document["reclaim_min_runtime_seconds"] = 300
    steady = next(c for c in document["priority_classes"] if c["name"] == "steady")
    assert steady["min_runtime_by_reason"] == {"reclaim": 900.0}
    low = next(c for c in document["priority_classes"] if c["name"] == "low")
    low["min_runtime_by_reason"] = {"priority": 30, "reclaim": 50}
    snapshot = snapshot_from_dict(json.loads(json.dumps(document)))
    assert snapshot.reclaim_min_runtime_seconds == 300.0
    assert snapshot == snapshot_from_dict(snapshot_to_dict(snapshot))
    # The class's own reclaim minimum (50 s) replaces the plan's 300 s: b2 may go.
    assert preempted(plan(snapshot)) == {"b2": "reclaim"}

    low["min_runtime_by_reason"] = {"eviction": 30}
    with pytest.raises(
        ScenarioError, match=r"^priority_classes\[4\]\.min_runtime_by_reason: unknown reason"
    ):
        snapshot_from_dict(document)
    low["min_runtime_by_reason"] = {"reclaim": -1}
    with pytest.raises(
        ScenarioError, match=r"^priority_classes\[4\]\.min_runtime_by_reason\.reclaim: must not"
    ):
        snapshot_from_dict(document)
    low["min_runtime_by_reason"] = [30]
    with pytest.raises(ScenarioError, match=r"min_runtime_by_reason: expected an object"):
        snapshot_from_dict(document)
    low["min_runtime_by_reason"] = {}
    document["reclaim_min_runtime_seconds"] = -3
    with pytest.raises(ScenarioError, match=r"^reclaim_min_runtime_seconds: must not be negative"):
        snapshot_from_dict(document)
