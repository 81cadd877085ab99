"""What a researcher can learn without being let in: whether a team or a job
exists (a 403 for a hidden one beside a 400 or 404 for a missing one would
tell), the API's whole schema, and whether a token outlives the password that
minted it. Each refusal is asserted with its reason and an unchanged database.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from rest_framework.test import APIClient

from portal.services import api_token_create
from preemption.models import Job
from tests import builders
from tests.conftest import database_state


def _job_body(team: str) -> dict[str, Any]:
    return {"team": team, "flavor": "h100-80gb", "ranks": 1, "gpus_per_rank": 1, "command": "true"}


def _answer(response: Any, name: str) -> tuple[int, Any]:
    """The status and body, with the name asked about taken out."""
    return response.status_code, response.content.decode().replace(name, "<team>")


# --- teams: a hidden one and a missing one are refused alike --------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/v1/jobs/", _job_body),
        ("/api/v1/jobs/batch/", lambda team: {"jobs": [_job_body(team)]}),
    ],
    ids=["single", "batch"],
)
def test_a_hidden_team_and_a_missing_team_get_the_same_answer(
    world: Any, path: str, body: Any
) -> None:
    client = world.client("researcher")
    before = database_state()
    hidden = client.post(path, body("ops"), format="json")  # the other tenant's team
    missing = client.post(path, body("opz"), format="json")  # no team has this name
    assert hidden.status_code == 403, hidden.content
    assert hidden.json() == {"detail": "You may not submit jobs to team ops."}
    assert _answer(hidden, "ops") == _answer(missing, "opz")
    assert database_state() == before


def test_the_portal_form_refuses_a_missing_team_as_a_hidden_one(world: Any) -> None:
    client = Client()
    client.force_login(world.users["researcher"])
    before = database_state()
    # The form lists only the user's teams; a hand-made POST names others.
    answers = []
    for team in ("ops", "opz"):
        response = client.post(
            "/jobs/new/",
            {
                "team": team,
                "flavor": "h100-80gb",
                "ranks": "1",
                "gpus_per_rank": "1",
                "command": "true",
                "retries": "0",
                "topology_required": "required",
            },
        )
        answers.append((response.status_code, team in response.content.decode()))
    assert answers[0] == answers[1], answers
    assert answers[0][0] in (400, 403)
    assert database_state() == before


# --- jobs: the trap's events endpoint says nothing of a job without its token ---------------


@pytest.mark.parametrize("method", ["get", "post"])
def test_the_events_endpoint_answers_an_existing_and_a_missing_job_alike(
    world: Any, method: str
) -> None:
    job = builders.job(world, world.ops, submitter=world.users["other_researcher"])
    missing = Job.objects.order_by("-pk").first().pk + 1000  # type: ignore[union-attr]
    client = APIClient()
    before = database_state()
    answers = []
    for pk in (job.pk, missing):
        response = getattr(client, method)(
            f"/api/v1/jobs/{pk}/events/",
            {"event": "checkpoint_committed", "step": 1} if method == "post" else None,
            format="json",
            HTTP_AUTHORIZATION="Bearer guessed-token",
        )
        answers.append((response.status_code, response.content.decode().replace(str(pk), "<id>")))
    assert answers[0] == answers[1], answers
    assert answers[0][0] == 403
    assert "open attempt's events token" in answers[0][1]
    assert database_state() == before


# --- the schema and its docs need a signed-in user ------------------------------------------


def test_the_schema_and_docs_need_a_signed_in_user(world: Any) -> None:
    anonymous = APIClient()
    schema = anonymous.get("/api/schema/")
    assert schema.status_code in (401, 403), schema.status_code
    assert "Sign in (or send an API token)" in schema.content.decode()
    assert b"/api/v1/jobs/" not in schema.content
    docs = Client().get("/api/docs/")
    assert docs.status_code == 302 and docs["Location"].startswith("/login/?next=/api/docs/")
    signed_in = Client()
    signed_in.force_login(world.users["researcher"])
    assert signed_in.get("/api/docs/").status_code == 200
    assert b"/api/v1/jobs/" in signed_in.get("/api/schema/").content


def test_an_installation_may_publish_its_schema(world: Any, settings: Any) -> None:
    settings.QM_API_SCHEMA_REQUIRES_SIGN_IN = False
    assert b"/api/v1/jobs/" in APIClient().get("/api/schema/").content
    assert Client().get("/api/docs/").status_code == 200


# --- a changed password ends the tokens it minted ----------------------------------------


def _token_for(user: Any) -> str:
    return api_token_create(user=user, name="laptop")[1]


def test_a_password_change_revokes_the_users_tokens(world: Any) -> None:
    token = _token_for(world.users["researcher"])
    neighbours = _token_for(world.users["manager"])
    bearer = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    assert APIClient().get("/api/v1/jobs/", **bearer).status_code == 200
    # An admin sets a new password on the admin site's password form.
    admin = Client()
    admin.force_login(world.users["admin"])
    researcher = world.users["researcher"]
    changed = admin.post(
        f"/admin/auth/user/{researcher.pk}/password/",
        {"password1": "a-new-long-passphrase", "password2": "a-new-long-passphrase"},
    )
    assert changed.status_code == 302, changed.content[:500]
    refused = APIClient().get("/api/v1/jobs/", **bearer)
    assert refused.status_code == 401
    assert refused.json() == {"detail": "Invalid or revoked token."}
    # Only that user's tokens end.
    other = APIClient().get("/api/v1/jobs/", HTTP_AUTHORIZATION=f"Bearer {neighbours}")
    assert other.status_code == 200


def test_set_password_anywhere_revokes_the_tokens(world: Any) -> None:
    token = _token_for(world.users["researcher"])
    user = world.users["researcher"]
    user.set_password("another-long-passphrase")
    user.save()
    response = APIClient().get("/api/v1/jobs/", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 401
