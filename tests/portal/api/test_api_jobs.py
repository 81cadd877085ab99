"""Jobs through the API: submit, filters, detail, cancel; the trap's events
endpoint; quota preview; API tokens; webhooks; the self-contained docs."""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from portal.auth import hash_token
from portal.models import ApiToken
from portal.services import api_token_create
from preemption.event_tokens import attempt_events_token
from preemption.models import Checkpoint, Job, JobState, Rank, TrapEvent, Webhook
from quotas.models import AuditEntry, Quota
from tests import builders


@pytest.fixture(autouse=True)
def _fast_passwords(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def submit(client: Any, **values: Any) -> Any:
    body = {
        "team": "vision",
        "flavor": "h100-80gb",
        "ranks": 2,
        "gpus_per_rank": 4,
        "command": "python train.py",
    }
    return client.post("/api/v1/jobs/", {**body, **values}, format="json")


def ids(response: Any) -> list[int]:
    assert response.status_code == 200, response.content[:300]
    return [row["id"] for row in response.json()["results"]]


def test_submit_records_the_job_with_the_default_class_and_no_events_token(
    world: Any,
) -> None:
    response = submit(world.client("researcher"), name="resnet", env={"SEED": "1"})
    assert response.status_code == 201, response.json()
    body = response.json()
    job = Job.objects.get(pk=body["id"])
    assert (job.team, job.submitter, job.priority_class) == (
        world.vision,
        world.users["researcher"],
        world.batch,
    )
    assert body["state"] == "pending" and body["gpus"] == 8 and body["env"] == {"SEED": "1"}
    # Tokens belong to attempts, drawn at admission; a job holds none.
    assert "events_token" not in body and not hasattr(job, "events_token")
    critical = submit(world.client("researcher"), priority_class="ai-prod-critical")
    assert critical.json()["priority_class"] == "ai-prod-critical"


def test_a_submission_takes_a_fixed_budget_of_queries(
    world: Any, django_assert_max_num_queries: Any
) -> None:
    # In a burst every query of a submission is paid thousands of times over:
    # the token, the three names, the caller's roles, the team tree once for
    # the service's checks, the nodes, the teams on the way up with their own
    # classes (one query), every class, the queued-job limits (the team's and
    # the submitter's rows locked, the limits on the way up, the two counts),
    # and the transaction that inserts the job and names its checkpoint folder.
    _, token = api_token_create(user=world.users["researcher"], name="burst")
    client = world.client("anonymous")
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert submit(client).status_code == 201
    with django_assert_max_num_queries(17):
        response = submit(client, ranks=1, gpus_per_rank=1)
    assert response.status_code == 201, response.json()


@pytest.mark.parametrize(
    ("retries", "accepted"),
    [(0, True), (20, True), (21, False), (-1, False), ("two", False), (True, False)],
)
def test_submit_takes_retries_within_bounds(world: Any, retries: Any, accepted: bool) -> None:
    before = Job.objects.count()
    response = submit(world.client("researcher"), retries=retries)
    if accepted:
        assert response.status_code == 201, response.json()
        assert response.json()["retries"] == retries and response.json()["retries_used"] == 0
        assert Job.objects.get(pk=response.json()["id"]).retries == retries
    else:
        assert response.status_code == 400, response.content
        assert list(response.json()) == ["retries"]
        assert Job.objects.count() == before


def test_submit_without_retries_asks_for_none(world: Any) -> None:
    response = submit(world.client("researcher"))
    assert response.status_code == 201 and response.json()["retries"] == 0


def test_retries_beyond_the_default_attempts_raise_them(world: Any, settings: Any) -> None:
    settings.QM_MAX_ATTEMPTS = 5
    many = submit(world.client("researcher"), retries=12)
    assert many.status_code == 201 and many.json()["max_attempts"] == 13
    few = submit(world.client("researcher"), retries=2)
    assert few.json()["max_attempts"] == 5
    capped = submit(world.client("researcher"), retries=12, max_attempts=3)
    assert capped.json()["max_attempts"] == 3


def test_job_list_filters(world: Any) -> None:
    researcher, admin = world.client("researcher"), world.client("admin")
    first = submit(researcher, name="first").json()["id"]
    second = submit(world.client("manager"), name="second").json()["id"]
    third = submit(world.client("other_researcher"), team="ops").json()["id"]
    Job.objects.filter(pk=first).update(submitted_at=timezone.now() - timedelta(days=2))
    Job.objects.filter(pk=second).update(state=JobState.RUNNING)

    assert ids(admin.get("/api/v1/jobs/")) == [third, second, first]
    assert ids(admin.get("/api/v1/jobs/?team=vision")) == [second, first]
    assert ids(admin.get("/api/v1/jobs/?state=running")) == [second]
    assert ids(admin.get("/api/v1/jobs/?submitter=researcher")) == [first]
    yesterday = (timezone.now() - timedelta(days=1)).isoformat()
    assert ids(admin.get("/api/v1/jobs/", {"since": yesterday})) == [third, second]
    assert ids(admin.get("/api/v1/jobs/", {"until": yesterday})) == [first]
    # Filters narrow what the user may see; they never widen it.
    assert ids(researcher.get("/api/v1/jobs/?team=ops")) == []
    assert ids(researcher.get("/api/v1/jobs/")) == [second, first]


def test_job_detail_holds_attempts_and_ranks(world: Any) -> None:
    job_id = submit(world.client("researcher")).json()["id"]
    now = timezone.now()
    attempt = builders.attempt(
        Job.objects.get(pk=job_id), admitted_at=now, ended_at=now, end_reason="preempted"
    )
    builders.ranks(attempt, state="exited", exit_code=0)
    detail = world.client("researcher").get(f"/api/v1/jobs/{job_id}/").json()
    assert [a["number"] for a in detail["attempts"]] == [1]
    assert [(r["index"], r["exit_code"]) for r in detail["attempts"][0]["ranks"]] == [
        (0, 0),
        (1, 0),
    ]
    assert detail["attempts"][0]["end_reason"] == "preempted"


def test_cancel_a_pending_job_and_cancel_twice(world: Any) -> None:
    client = world.client("researcher")
    job_id = submit(client).json()["id"]
    response = client.post(f"/api/v1/jobs/{job_id}/cancel/")
    assert response.status_code == 202 and response.json()["state"] == "cancelled"
    again = client.post(f"/api/v1/jobs/{job_id}/cancel/")
    assert again.status_code == 400
    assert again.json() == {"state": [f"Job {job_id} is already cancelled."]}


# --- the trap's events endpoint ---------------------------------------------------------


@pytest.fixture
def running(world: Any) -> Job:
    return builders.running_job(
        world,
        world.vision,
        ranks=2,
        command="python train.py",
        admitted_at=timezone.now() - timedelta(minutes=5),
        checkpoint_dir="/tmp/ckpt",
        rank_fields={},
    )


def post_event(client: Any, job: Job, event: Any, token: str | None = "") -> Any:
    if token == "":
        token = attempt_events_token(job.attempts.get(ended_at__isnull=True))
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    return client.post(f"/api/v1/jobs/{job.pk}/events/", event, format="json", **headers)


def test_events_are_stored_once_and_applied(world: Any, running: Job) -> None:
    from rest_framework.test import APIClient

    trap = APIClient()  # the trap has no user: only the job's token
    at = time.time()
    signal = {"event": "signal_received", "job_id": running.pk, "attempt": 1, "rank": 1, "at": at}
    first = post_event(trap, running, signal)
    assert first.status_code == 202 and first.json() == {"accepted": 1, "duplicates": 0}
    again = post_event(trap, running, signal)
    assert again.status_code == 202 and again.json() == {"accepted": 0, "duplicates": 1}
    assert TrapEvent.objects.filter(job=running, event="signal_received").count() == 1
    assert Rank.objects.get(attempt__job=running, index=1).signal_received_at is not None

    committed = [
        {
            "event": "checkpoint_committed",
            "job_id": running.pk,
            "attempt": 1,
            "rank": r,
            "at": at + 1,
            "step": 42,
            "bytes": 1024,
            "seconds": 1.5,
        }
        for r in (0, 1)
    ]
    both = post_event(trap, running, committed)
    assert both.status_code == 202 and both.json() == {"accepted": 2, "duplicates": 0}
    assert Checkpoint.objects.filter(job=running, step=42).count() == 1
    running.refresh_from_db()
    assert running.resume_step == 43


@pytest.mark.parametrize(
    ("event", "errors"),
    [
        ({"event": "exploded", "attempt": 1, "rank": 0, "at": 1.0}, "event"),
        ({"event": "exiting", "attempt": 1, "rank": 0, "at": "now"}, "at"),
        ({"event": "exiting", "attempt": -1, "rank": 0, "at": 1.0}, "attempt"),
        ({"event": "exiting", "attempt": 1, "at": 1.0}, "rank"),
        ({"event": "exiting", "attempt": 1, "rank": 0, "at": 1.0, "job_id": 999999}, "job_id"),
        ({"event": "exiting", "attempt": 1, "rank": 0, "at": 1.0, "reason": "a\x00b"}, "event"),
        ([], "event"),
        ("signal", "event"),
    ],
)
def test_malformed_events_are_400_naming_the_field(
    world: Any, running: Job, event: Any, errors: str
) -> None:
    response = post_event(world.client("anonymous"), running, event)
    assert response.status_code == 400, response.content
    assert list(response.json()) == [errors]
    assert not TrapEvent.objects.exists()


def test_events_need_the_jobs_own_token(world: Any, running: Job) -> None:
    event = {"event": "exiting", "attempt": 1, "rank": 0, "at": time.time(), "code": 0}
    _, user_token = api_token_create(user=world.users["admin"], name="admin")
    real = attempt_events_token(running.attempts.get())
    for token in (None, "wrong", real[:-1] + ("0" if real[-1] != "0" else "1"), user_token):
        response = post_event(world.client("anonymous"), running, event, token=token)
        assert response.status_code == 403, token
    assert post_event(world.client("anonymous"), running, event).status_code == 202
    assert (
        world.client("anonymous")
        .post("/api/v1/jobs/999999/events/", event, format="json")
        .status_code
        == 403  # as for a job that exists: the answer tells nothing of it
    )
    assert TrapEvent.objects.count() == 1


# --- quota preview -----------------------------------------------------------------------


def test_preview_says_what_a_change_would_do_and_saves_nothing(world: Any) -> None:
    quota = world.quota(world.vision)
    audit_rows = AuditEntry.objects.count()
    response = world.client("manager").post(
        f"/api/v1/quotas/{quota.pk}/preview/",
        {"guarantee": 4, "borrow_limit": 2, "weight": 2.0},
        format="json",
    )
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["change"]["guarantee"] == {"before": 8, "after": 4}
    assert body["change"]["borrow_limit"] == {"before": None, "after": 2}
    assert {"reclaimed", "admitted", "fair_share"} <= set(body)
    assert Quota.objects.get(pk=quota.pk).guarantee == 8
    assert AuditEntry.objects.count() == audit_rows
    bad = world.client("manager").post(
        f"/api/v1/quotas/{quota.pk}/preview/", {"weight": -1}, format="json"
    )
    assert bad.status_code == 400 and list(bad.json()) == ["weight"]


def test_a_quota_change_leaves_an_audit_row_naming_the_manager(world: Any) -> None:
    quota = world.quota(world.vision)
    response = world.client("manager").patch(
        f"/api/v1/quotas/{quota.pk}/", {"lend_limit": 4}, format="json"
    )
    assert response.status_code == 200
    entry = world.client("manager").get("/api/v1/audit-log/?team=vision").json()["results"][0]
    assert entry["actor"] == "manager" and entry["action"] == "quota.set"
    assert entry["before"]["lend_limit"] is None and entry["after"]["lend_limit"] == 4
    assert entry["reason"] == ""


def test_a_quota_change_through_the_api_keeps_its_reason(world: Any) -> None:
    quota = world.quota(world.vision)
    response = world.client("manager").patch(
        f"/api/v1/quotas/{quota.pk}/", {"guarantee": 6, "reason": "nlp needs more"}, format="json"
    )
    assert response.status_code == 200
    entry = world.client("manager").get("/api/v1/audit-log/?team=vision").json()["results"][0]
    assert (entry["reason"], entry["after"]["guarantee"]) == ("nlp needs more", 6)


# --- tokens --------------------------------------------------------------------------------


def test_a_token_is_shown_once_works_and_stops_working_when_revoked(world: Any) -> None:
    from rest_framework.test import APIClient

    created = (
        world.client("researcher").post("/api/v1/tokens/", {"name": "laptop"}, format="json").json()
    )
    value = created["token"]
    row = ApiToken.objects.get(pk=created["id"])
    assert row.key_hash == hash_token(value) and value not in str(row.__dict__)
    listed = world.client("researcher").get("/api/v1/tokens/").json()["results"]
    assert [t["name"] for t in listed] == ["laptop"] and "token" not in listed[0]

    bearer = APIClient()
    bearer.credentials(HTTP_AUTHORIZATION=f"Bearer {value}")
    assert bearer.get("/api/v1/jobs/").status_code == 200
    assert bearer.delete(f"/api/v1/tokens/{created['id']}/").status_code == 204
    refused = bearer.get("/api/v1/jobs/")
    assert refused.status_code == 401 and refused.headers["WWW-Authenticate"] == "Bearer"


def test_login_gives_a_token_for_the_right_password_only(world: Any) -> None:
    from rest_framework.test import APIClient

    anonymous = APIClient()
    good = anonymous.post(
        "/api/v1/tokens/login/", {"username": "manager", "password": "correct-horse-battery-staple"}
    )
    assert good.status_code == 201 and good.json()["token"].startswith("qm_")
    bad = anonymous.post("/api/v1/tokens/login/", {"username": "manager", "password": "nope"})
    assert bad.status_code == 403 and bad.json() == {"detail": "Wrong username or password."}
    assert ApiToken.objects.filter(user=world.users["manager"]).count() == 1


# --- webhooks ------------------------------------------------------------------------------


def test_a_manager_registers_a_team_webhook_and_the_secret_stays_hidden(
    world: Any, settings: Any
) -> None:
    # The documentation network stands in for a public receiver (see tests/security).
    settings.QM_WEBHOOK_ALLOW_NETS = ["192.0.2.0/24"]
    client = world.client("manager")
    body = {
        "team": "vision",
        "url": "https://192.0.2.10/qm",
        "events": ["preempted", "finished"],
        "secret": "k",
    }
    response = client.post("/api/v1/webhooks/", body, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["has_secret"] is True and "secret" not in response.json()
    hook = Webhook.objects.get()
    assert (hook.team, hook.events, hook.secret) == (world.vision, ["preempted", "finished"], "k")
    bad = client.post("/api/v1/webhooks/", {**body, "events": ["exploded"]}, format="json")
    assert bad.status_code == 400 and list(bad.json()) == ["events"]
    bad_url = client.post("/api/v1/webhooks/", {**body, "url": "not a url"}, format="json")
    assert bad_url.status_code == 400 and list(bad_url.json()) == ["url"]


# --- schema and docs -----------------------------------------------------------------------


def test_the_schema_and_docs_load_nothing_from_outside(world: Any) -> None:
    from rest_framework.test import APIClient

    client = APIClient()
    client.force_login(world.users["researcher"])
    schema = client.get("/api/schema/")
    assert schema.status_code == 200 and b"/api/v1/jobs/{id}/events/" in schema.content
    docs = client.get("/api/docs/")
    assert docs.status_code == 200
    html = docs.content.decode()
    sources = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert sources, "the docs page references its scripts"
    assert all(source.startswith("/") for source in sources), sources
    assert "cdn" not in html.lower()
    for source in sources:
        if source.startswith("/static/"):
            assert client.get(source).status_code == 200, source
