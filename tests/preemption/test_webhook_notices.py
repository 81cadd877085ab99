"""Queueing webhook notices for jobs that changed: only the teams with an active
webhook that wants the event get a delivery, and jobs of teams without one cost a
single query (the exits listener queues a notice for every job that ends)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from preemption.models import JobState, Webhook, WebhookDelivery
from preemption.webhooks import Notice, notify_each
from tests import builders

pytestmark = pytest.mark.django_db


def _notices(jobs: list[Any], event: str = "finished") -> list[Notice]:
    return [Notice(job_id=job.pk, event=event, payload={"exit_codes": [0]}) for job in jobs]


def test_jobs_of_teams_without_webhooks_cost_one_query_and_queue_nothing(world: Any) -> None:
    jobs = [builders.job(world, world.vision, state=JobState.SUCCEEDED) for _ in range(5)]
    Webhook.objects.create(team=world.nlp, url="https://hooks.example.org/nlp")
    Webhook.objects.create(team=world.vision, url="https://hooks.example.org/off", active=False)

    with CaptureQueriesContext(connection) as captured:
        queued = notify_each(_notices(jobs))

    assert (queued, len(captured)) == (0, 1)
    assert not WebhookDelivery.objects.exists()


def test_only_the_teams_webhooks_that_want_the_event_get_a_delivery(world: Any) -> None:
    vision = builders.job(world, world.vision, state=JobState.SUCCEEDED)
    nlp = builders.job(world, world.nlp, state=JobState.SUCCEEDED)
    every = Webhook.objects.create(team=world.vision, url="https://hooks.example.org/all")
    Webhook.objects.create(
        team=world.vision, url="https://hooks.example.org/preempted", events=["preempted"]
    )

    assert notify_each(_notices([vision, nlp])) == 1

    (delivery,) = WebhookDelivery.objects.all()
    assert delivery.webhook == every and delivery.event == "finished"
    assert delivery.payload["job"] == {
        "id": vision.pk,
        "name": vision.name,
        "team": world.vision.slug,
        "state": "succeeded",
    }
    assert delivery.payload["exit_codes"] == [0]
