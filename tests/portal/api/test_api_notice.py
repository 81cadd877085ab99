"""The checkpoint notice in the API: the trap's poll (GET on the events URL with the
attempt's token) and the notice window of a priority class."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from preemption.event_tokens import attempt_events_token
from preemption.models import Attempt, Job, PreemptionEvent
from quotas.models import AuditEntry, PriorityClass
from tests import builders
from tests.conftest import database_state

pytestmark = pytest.mark.django_db

REFUSED = {
    "detail": "This endpoint needs the open attempt's events token "
    "(Authorization: Bearer <QM_EVENTS_TOKEN>)."
}


def poll(job: Job, token: str | None) -> Any:
    client = APIClient()
    if token is not None:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client.get(f"/api/v1/jobs/{job.pk}/events/")


def victim(world: Any, team: Any) -> tuple[Job, Attempt]:
    job = builders.running_job(world, team, rank_fields={})
    return job, Attempt.objects.get(job=job)


def send_notice(attempt: Attempt) -> PreemptionEvent:
    now = timezone.now()
    return PreemptionEvent.objects.create(
        victim_attempt=attempt,
        job=attempt.job,
        reason="reclaim",
        decided_at=now,
        grace_seconds=60,
        deadline=now + timedelta(seconds=60),
        notice_deadline=now + timedelta(seconds=20),
        notice_sent_at=now,
    )


def test_the_poll_says_whether_a_notice_was_sent_to_the_tokens_attempt(world: Any) -> None:
    job, attempt = victim(world, world.ops)
    token = attempt_events_token(attempt)
    answer = poll(job, token)
    assert answer.status_code == 200
    assert answer.json() == {"attempt": 1, "notice": False, "sent_at": None, "deadline": None}
    event = send_notice(attempt)
    answer = poll(job, token).json()
    assert answer["notice"] is True and answer["attempt"] == 1
    assert answer["sent_at"] is not None and answer["deadline"] is not None
    assert event.notice_deadline.isoformat().startswith(answer["deadline"][:19])


def test_the_poll_reads_the_token_once_then_one_row_by_primary_key(world: Any) -> None:
    job, attempt = victim(world, world.ops)
    token = attempt_events_token(attempt)
    assert poll(job, token).status_code == 200
    with CaptureQueriesContext(connection) as queries:
        for _ in range(5):
            assert poll(job, token).status_code == 200
    # One query per poll: the notice of the attempt, by its id.
    assert len(queries) == 5
    assert all('"preemption_attempt"."id" =' in q["sql"] for q in queries.captured_queries)


@pytest.mark.parametrize(
    "whose",
    ["none", "garbage", "other attempt of the job", "other job", "other team", "ended attempt"],
)
def test_a_poll_with_any_other_token_is_refused_and_learns_nothing(world: Any, whose: str) -> None:
    job, attempt = victim(world, world.ops)
    send_notice(attempt)
    sibling, sibling_attempt = victim(world, world.ops)
    stranger, stranger_attempt = victim(world, world.vision)
    tokens = {
        "none": None,
        "garbage": "0" * 64,
        "other job": attempt_events_token(sibling_attempt),
        "other team": attempt_events_token(stranger_attempt),
    }
    if whose == "other attempt of the job":
        # An earlier, ended attempt of the same job: its token expired with it.
        Attempt.objects.filter(pk=attempt.pk).update(
            ended_at=timezone.now(), end_reason="preempted"
        )
        later = builders.attempt(job)
        send_notice(later)
        tokens[whose] = attempt_events_token(attempt)
    if whose == "ended attempt":
        tokens[whose] = attempt_events_token(attempt)
        Attempt.objects.filter(pk=attempt.pk).update(
            ended_at=timezone.now(), end_reason="preempted"
        )
    before = database_state()
    answer = poll(job, tokens[whose])
    assert answer.status_code == 403
    assert answer.json() == REFUSED
    assert database_state() == before
    # A valid token of another job asks about that job only, never this one's notice.
    if whose in ("other job", "other team"):
        owner = sibling if whose == "other job" else stranger
        assert poll(owner, tokens[whose]).json()["notice"] is False


def test_a_poll_of_a_job_that_does_not_exist_is_refused_alike(world: Any) -> None:
    _job, attempt = victim(world, world.ops)
    token = attempt_events_token(attempt)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    for path in ("/api/v1/jobs/999999/events/", f"/api/v1/jobs/{10**30}/events/"):
        answer = client.get(path)
        assert answer.status_code in (403, 404)
        assert "notice" not in answer.json()


# --- the notice window of a priority class ----------------------------------------


def refused(client: APIClient, method: str, path: str, body: Any) -> dict[str, Any]:
    before = database_state()
    response = getattr(client, method)(path, body, format="json")
    assert response.status_code == 400, (response.status_code, response.content[:500])
    assert database_state() == before, "a refused call changed the database"
    return response.json()


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"grace_seconds": 30, "notice_seconds": 30}, "notice_seconds", "shorter than the grace"),
        ({"grace_seconds": 30, "notice_seconds": 45}, "notice_seconds", "shorter than the grace"),
        ({"grace_seconds": 0, "notice_seconds": 1}, "notice_seconds", "shorter than the grace"),
        ({"notice_seconds": -1}, "notice_seconds", "greater than or equal to 0"),
        ({"notice_seconds": "soon"}, "notice_seconds", "valid integer"),
        ({"notice_seconds": 10**7}, "notice_seconds", "less than or equal to 604800"),
    ],
)
def test_a_notice_window_outside_the_grace_budget_is_refused(
    world: Any, body: dict[str, Any], field: str, words: str
) -> None:
    admin = world.client("admin")
    answer = refused(
        admin, "post", "/api/v1/priority-classes/", {"name": "new", "value": 5, **body}
    )
    assert words in " ".join(answer[field])


def test_lowering_the_grace_under_the_notice_window_is_refused(world: Any) -> None:
    admin = world.client("admin")
    world.batch.refresh_from_db()
    answer = refused(
        admin,
        "patch",
        f"/api/v1/priority-classes/{world.batch.pk}/",
        {"grace_seconds": world.batch.notice_seconds},
    )
    assert "shorter than the grace period" in answer["notice_seconds"][0]


def test_a_notice_window_is_set_audited_and_shown(world: Any) -> None:
    admin = world.client("admin")
    created = admin.post(
        "/api/v1/priority-classes/",
        {"name": "short", "value": 5, "grace_seconds": 10},
        format="json",
    )
    assert created.status_code == 201
    # No window named: the default, or half the grace period where that is shorter.
    assert created.json()["notice_seconds"] == 5
    assert (
        admin.post("/api/v1/priority-classes/", {"name": "long", "value": 6}, format="json").json()[
            "notice_seconds"
        ]
        == 30
    )
    pk = created.json()["id"]
    changed = admin.patch(f"/api/v1/priority-classes/{pk}/", {"notice_seconds": 0}, format="json")
    assert changed.status_code == 200 and changed.json()["notice_seconds"] == 0
    assert PriorityClass.objects.get(pk=pk).notice_seconds == 0
    entry = (
        AuditEntry.objects.filter(action="priority_class.save", object_id=str(pk))
        .order_by("id")
        .last()
    )
    assert entry is not None
    assert (entry.before["notice_seconds"], entry.after["notice_seconds"]) == (5, 0)


def test_only_admins_change_the_notice_window(world: Any) -> None:
    before = database_state()
    answer = world.client("manager").patch(
        f"/api/v1/priority-classes/{world.batch.pk}/", {"notice_seconds": 1}, format="json"
    )
    assert answer.status_code == 403
    assert database_state() == before


def test_the_admin_refuses_a_notice_window_outside_the_grace_budget(
    world: Any, client: Any
) -> None:
    client.force_login(world.users["admin"])
    world.batch.refresh_from_db()
    url = f"/admin/quotas/priorityclass/{world.batch.pk}/change/"
    form = {
        "name": world.batch.name,
        "value": world.batch.value,
        "preemption_policy": world.batch.preemption_policy,
        "preemptible": "on",
        "grace_seconds": 20,
        "notice_seconds": 20,
        "min_runtime_seconds": 0,
        "description": "",
    }
    before = database_state()
    refused = client.post(url, form)
    assert refused.status_code == 200
    assert "shorter than the grace period" in refused.content.decode()
    assert database_state() == before
    form["notice_seconds"] = 5
    assert client.post(url, form).status_code == 302
    assert PriorityClass.objects.values_list("grace_seconds", "notice_seconds").get(
        pk=world.batch.pk
    ) == (20, 5)
