"""A running job's checkpoint cadence in the job API and on the job page: the control
plane's risk estimate with its reasons (from the risk refresh over real rows) and the
interval the trap reports choosing (through the trap's events endpoint)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from preemption import risk
from preemption.cadence import preemption_risk_refresh
from preemption.event_tokens import attempt_events_token
from preemption.models import Attempt, Job, JobState, TrapEvent
from tests import builders


@pytest.fixture
def borrower(world: Any, settings: Any) -> Job:
    """vision runs 16 GPUs, 8 beyond its guarantee, while nlp (guarantee 8, idle) waits
    with a job of 8: the reclaim spares the borrower for its first hour."""
    settings.QM_RECLAIM_MIN_RUNTIME_SECONDS = 3600
    job = builders.running_job(
        world,
        world.vision,
        ranks=2,
        gpus_per_rank=8,
        borrowed=8,
        admitted_at=timezone.now() - timedelta(minutes=5),
        rank_fields={},
    )
    Attempt.objects.filter(job=job).update(
        placement=[{"node": "h100-node-0", "ranks": 1}, {"node": "h100-node-1", "ranks": 1}]
    )
    builders.running_job(world, world.ops, gpus_per_rank=4, node="h100-node-2")
    builders.job(world, world.nlp, state=JobState.PENDING, gpus_per_rank=8)
    return job


def browser(world: Any, persona: str) -> Client:
    client = Client()
    client.force_login(world.users[persona])
    return client


def cadence_event(job: Job, **fields: Any) -> dict[str, Any]:
    return {
        "event": "cadence",
        "job_id": job.pk,
        "attempt": 1,
        "rank": 0,
        "at": time.time(),
        **fields,
    }


def post_event(client: Any, job: Job, event: Any) -> Any:
    token = attempt_events_token(job.attempts.get(ended_at__isnull=True))
    return client.post(
        f"/api/v1/jobs/{job.pk}/events/", event, format="json", HTTP_AUTHORIZATION=f"Bearer {token}"
    )


def test_the_job_api_and_page_show_the_risk_its_reasons_and_the_traps_interval(
    world: Any, borrower: Job
) -> None:
    before = world.client("researcher").get(f"/api/v1/jobs/{borrower.pk}/").json()["cadence"]
    assert before["mtbp_seconds"] is None and before["interval_seconds"] is None

    refreshed = preemption_risk_refresh()
    assert (refreshed.estimated, refreshed.changed, refreshed.published) == (2, 2, 0)
    # 600 s between preemptions and a measured save cost of 0.3 s: sqrt(2 x 0.3 x 600) = 19 s.
    reported = cadence_event(
        borrower, step=120, mtbp_seconds=600.0, save_cost=0.3, interval_seconds=18.97
    )
    assert post_event(world.client("anonymous"), borrower, reported).status_code == 202

    cadence = world.client("researcher").get(f"/api/v1/jobs/{borrower.pk}/").json()["cadence"]
    assert cadence["attempt"] == 1
    assert cadence["mtbp_seconds"] == risk.RECLAIM_IMMINENT
    assert cadence["reasons"][0] == (
        "team vision holds 16 h100-80gb GPUs, 8 beyond its guarantee of 8, and teams "
        "under their guarantee wait for it: nlp (1 job waiting)"
    )
    assert cadence["estimated_at"] is not None
    assert (cadence["interval_seconds"], cadence["save_cost"], cadence["trap_mtbp_seconds"]) == (
        18.97,
        0.3,
        600.0,
    )
    attempt = world.client("researcher").get(f"/api/v1/attempts/?job={borrower.pk}").json()
    assert attempt["results"][0]["preemption_mtbp_seconds"] == risk.RECLAIM_IMMINENT

    page = browser(world, "researcher").get(f"/jobs/{borrower.pk}/").content.decode()
    assert "Checkpoint cadence" in page
    assert 'data-field="mtbp">10 min 0 s<' in page
    assert "nlp (1 job waiting)" in page
    assert 'data-field="interval">19.0 s<' in page


def test_a_second_refresh_with_nothing_changed_writes_nothing(world: Any, borrower: Job) -> None:
    preemption_risk_refresh()
    stamp = Attempt.objects.get(job=borrower).preemption_risk_at
    again = preemption_risk_refresh()
    assert again.changed == 0
    assert Attempt.objects.get(job=borrower).preemption_risk_at == stamp


def test_an_outsider_sees_neither_the_job_nor_its_cadence(world: Any, borrower: Job) -> None:
    preemption_risk_refresh()
    outsider = world.client("other_researcher")
    assert outsider.get(f"/api/v1/jobs/{borrower.pk}/").status_code == 404
    assert browser(world, "other_researcher").get(f"/jobs/{borrower.pk}/").status_code == 404
    assert outsider.get(f"/api/v1/attempts/?job={borrower.pk}").json()["results"] == []


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"interval_seconds": -1.0}, "interval_seconds"),
        ({"mtbp_seconds": "soon"}, "mtbp_seconds"),
        ({"save_cost": True}, "save_cost"),
        ({"interval_seconds": 1e12}, "interval_seconds"),
    ],
)
def test_a_malformed_cadence_event_is_400_naming_the_field_and_stores_nothing(
    world: Any, borrower: Job, fields: dict[str, Any], field: str
) -> None:
    response = post_event(
        world.client("anonymous"), borrower, cadence_event(borrower, step=1, **fields)
    )
    assert response.status_code == 400, response.content
    assert list(response.json()) == [field]
    assert not TrapEvent.objects.exists()
