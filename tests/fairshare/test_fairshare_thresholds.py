"""The plan's two thresholds, parameters of the snapshot: the fair-share anti-flap margin and
the minimum runtime before consolidation moves a job."""

from __future__ import annotations

import dataclasses
import json

import pytest
from fairshare_builders import cluster, nodes, preempted, reasons, run_plan, team
from fairshare_builders import workload as w

from fairshare import ScenarioError, Snapshot, plan, snapshot_from_dict, snapshot_to_dict

N2 = nodes("n", 2, 8)


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
