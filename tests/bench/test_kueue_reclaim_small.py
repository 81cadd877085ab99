"""The reclaim comparison's Quartermaster side, small, through the whole control plane
(the REST API, gunicorn, Celery over Redis, the cycle on PostgreSQL, the mimic runtime):
owners take back the quota they lent, the borrowers they preempt are signalled, save
where they are and resume there, so the work lost is nothing."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest

from bench.kueue_qm import expand, load_config, run_quartermaster

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]
CONFIG = Path(__file__).with_name("kueue_reclaim_small.yaml")
RUNTIME_S = {"borrower": 10.0, "owner": 3.0}


def test_owners_reclaim_and_their_victims_resume_where_they_saved(tmp_path: Path) -> None:
    expansion = expand(load_config(CONFIG))
    assert {w.class_name: w.checkpoints.env() for w in expansion.workloads} == {
        "owner": {},
        "borrower": {"MIMIC_CHECKPOINT_EVERY": "2", "MIMIC_SAVE_ON_STOP": "0.5"},
    }

    figures = run_quartermaster(CONFIG, var_dir=tmp_path)

    assert figures["submission"]["errors"] == []
    assert figures["states"] == {"succeeded": 5}
    reclaim = figures["reclaim"]
    # Each owner took back 10 units from a borrower running on them.
    assert reclaim["evictions"] >= 2 and set(reclaim["by_class"]) == {"borrower"}
    assert figures["preemptions"] >= reclaim["evictions"]
    # Every victim saved inside its grace window: nothing to do again.
    assert reclaim["lost_gpu_seconds"] == 0 == reclaim["rerun_gpu_seconds"]

    # The mimic runtime's records, read directly: each later attempt of a victim began
    # where the one before it stopped, and its attempts together did the work once.
    records: dict[int, list[dict[str, float]]] = {}
    for path in (tmp_path / "runs" / "mimic").glob("*/*.json"):
        job_id, attempt = (int(part) for part in path.stem.split("-"))
        records.setdefault(job_id, []).append({"attempt": attempt, **json.loads(path.read_text())})
    victims = [sorted(r, key=lambda x: x["attempt"]) for r in records.values() if len(r) > 1]
    assert len(victims) >= 1
    for attempts in victims:
        total = attempts[0]["total"]
        assert total == RUNTIME_S["borrower"]
        assert attempts[0]["resumed_from"] == 0
        for before, after in pairwise(attempts):
            assert before["signal_sent_at"] is not None and "killed_at" not in before
            stopped_at = before["resumed_from"] + before["signal_sent_at"] - before["launched_at"]
            assert after["resumed_from"] == pytest.approx(stopped_at)
            assert after["seconds"] == pytest.approx(total - stopped_at)
        worked = sum(a["signal_sent_at"] - a["launched_at"] for a in attempts[:-1])
        assert worked + attempts[-1]["seconds"] == pytest.approx(total)
