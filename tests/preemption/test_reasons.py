"""A preemption's reason is worded in one place (`preemption.reasons`): the
cause the cycle stores, the job page, the dashboard, the API's `why` and the
job detail's `preempted_because` (which `qm show` prints) say the same words
with the same number."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from preemption.cycle import schedule_cycle
from preemption.models import PreemptionEvent
from preemption.services import job_submit
from tests import builders

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def test_a_reclaim_reads_the_same_everywhere_with_one_number(world: Any) -> None:
    # ops borrows: a 16-GPU gang (2 x 8) over its 8-GPU guarantee, while nlp
    # runs its own 8; the cluster's 24 h100 GPUs are full. vision then asks
    # for 8 GPUs inside its guarantee, and the cycle reclaims the whole gang.
    an_hour_ago = timezone.now() - timedelta(hours=1)
    victim = builders.running_job(
        world,
        world.ops,
        name="borrower",
        submitter=world.users["other_researcher"],
        ranks=2,
        gpus_per_rank=8,
        admitted_at=an_hour_ago,
        borrowed=8,
        attempt_fields={
            "placement": [{"node": "h100-node-0", "ranks": 1}, {"node": "h100-node-1", "ranks": 1}]
        },
    )
    builders.running_job(
        world, world.nlp, gpus_per_rank=8, node="h100-node-2", admitted_at=an_hour_ago
    )
    preemptor = job_submit(
        submitter=world.users["researcher"],
        team=world.vision,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=8,
        command="true",
        priority_class=world.batch,
        name="own-share",
    )
    schedule_cycle(act=False)

    event = PreemptionEvent.objects.get(job=victim)
    assert (event.reason, event.preemptor_id) == ("reclaim", preemptor.pk)
    words = "reclaimed by vision, 8 GPUs under its guarantee"
    assert event.cause == words

    browser = Client()
    browser.force_login(world.users["other_researcher"])
    page = browser.get(reverse("job-detail", args=[victim.pk])).content.decode()
    assert "Reclaimed by vision, 8 GPUs under its guarantee." in page
    # The reason line and the timeline's first step: the same words, one number.
    said = re.findall(r"(\w[\w ]*, \d+ GPUs) under its guarantee", page)
    assert {phrase.lower() for phrase in said} == {"reclaimed by vision, 8 gpus"}, said

    browser.force_login(world.users["admin"])
    dashboard = browser.get(reverse("dashboard")).content.decode()
    said = re.findall(r"(\w[\w ]*, \d+ GPUs) under its guarantee", dashboard)
    assert said == ["reclaimed by vision, 8 GPUs"], said

    api = world.client("other_researcher")
    assert api.get(f"/api/v1/preemption-events/{event.pk}/").json()["why"] == words
    detail = api.get(f"/api/v1/jobs/{victim.pk}/").json()
    assert [attempt["preempted_because"] for attempt in detail["attempts"]] == [words]
