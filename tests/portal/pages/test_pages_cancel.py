"""A cancel is its own event, never counted among preemptions.

A running job of vision is cancelled through the service a person uses; its
ranks get the signal, checkpoint and exit 143 (SIGTERM without the trap's
exit code), and the reconciler closes the stop as it does. The job page, the
dashboard, the preemption API, /metrics and the telemetry charts must show
no preemption, and the job page must tell the cancel as a cancel.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank
from preemption.services import job_cancel
from quotas.selectors import access_for
from telemetry.preemption_selectors import (
    checkpoints_against_grace,
    recovery_seconds,
    signal_latencies,
)
from tests.portal.pages.conftest import page_client

pytestmark = pytest.mark.django_db


def _cancelled_job(world: Any) -> Job:
    job = Job.objects.create(
        name="cancel-me",
        team=world.vision,
        submitter=world.users["researcher"],
        priority_class=world.batch,
        flavor=world.h100,
        ranks=2,
        gpus_per_rank=4,
        command="python train.py",
        state=JobState.RUNNING,
    )
    started = timezone.now() - timedelta(minutes=5)
    attempt = Attempt.objects.create(
        job=job,
        number=1,
        admitted_at=started,
        launched_at=started,
        placement=[{"node": "h100-node-0", "ranks": 2}],
    )
    for index in range(2):
        Rank.objects.create(attempt=attempt, index=index, node="h100-node-0", state="running")
    job_cancel(actor=world.users["researcher"], job=job)
    stop = PreemptionEvent.objects.get(victim_attempt=attempt)
    decided = stop.decided_at
    # What the reconciler records as the ranks stop.
    Rank.objects.filter(attempt=attempt).update(
        state="exited",
        exit_code=143,
        signal_sent_at=decided + timedelta(seconds=0.1),
        signal_received_at=decided + timedelta(seconds=0.2),
        exited_at=decided + timedelta(seconds=2),
    )
    PreemptionEvent.objects.filter(pk=stop.pk).update(
        signal_sent_at=decided + timedelta(seconds=0.1),
        all_exited_at=decided + timedelta(seconds=2),
        checkpoint_step=30,
        checkpoint_seconds=1.5,
        outcome="graceful",
        lost_gpu_seconds=0.0,
    )
    Attempt.objects.filter(pk=attempt.pk).update(
        ended_at=decided + timedelta(seconds=2), end_reason=Attempt.EndReason.CANCELLED
    )
    Job.objects.filter(pk=job.pk).update(state=JobState.CANCELLED, finished_at=timezone.now())
    return job


def test_a_cancel_is_not_a_preemption_anywhere(world: Any) -> None:
    job = _cancelled_job(world)
    client = page_client(world, "researcher")

    page = client.get(reverse("job-detail", args=[job.pk])).content.decode()
    card = re.search(r"<h3>Preemptions</h3><p class=\"big\">(\d+)</p>", page)
    assert card is not None and card.group(1) == "0"
    assert "Preemption of attempt" not in page
    assert "Cancel of attempt 1" in page
    assert "Cancelled by researcher" in page
    assert "outcome graceful" not in page
    assert "exit codes 143" in page
    cancel = page[page.index("Cancel of attempt 1") :]
    cancel = cancel[: cancel.index("</section>")]
    assert "step-bad" not in cancel

    dashboard = client.get(reverse("dashboard")).content.decode()
    recent = dashboard[dashboard.index("Recent preemptions") :]
    assert f"#{job.pk}</a>" not in recent and "No preemption yet." in recent

    api = world.client("researcher").get("/api/v1/preemption-events/", {"job": job.pk})
    assert api.status_code == 200 and api.json()["count"] == 0
    detail = world.client("researcher").get(f"/api/v1/jobs/{job.pk}/").json()
    assert detail["state"] == "cancelled" and detail["cancel_requested_at"] is not None

    metrics = client.get(reverse("metrics")).content.decode()
    assert "qm_preemptions_total{" not in metrics
    assert 'qm_cancels_total{team="vision"} 1' in metrics
    assert "qm_signal_latency_seconds_count 0" in metrics

    access = access_for(world.users["researcher"])
    assert signal_latencies(access=access) == []
    assert checkpoints_against_grace(access=access) == []
    assert recovery_seconds(access=access) == []
