"""Schemathesis against the live OpenAPI schema: as an admin with a token,
generated valid and invalid requests for every operation must never get a 5xx,
and every answer must be JSON (bad input names the field)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import hypothesis
import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from django.utils import timezone
from hypothesis import HealthCheck
from schemathesis.generation.modes import GenerationMode

from portal.models import ApiToken
from portal.services import api_token_create

# Modest, so the whole walk takes about a minute on two cores.
EXAMPLES_PER_OPERATION = {GenerationMode.POSITIVE: 6, GenerationMode.NEGATIVE: 4}


def fuzz(operation: Any, mode: GenerationMode, examples: int, token: str) -> tuple[int, list[str]]:
    """Call one operation with `examples` generated requests; the problems found."""
    problems: list[str] = []
    calls = 0

    @hypothesis.settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        phases=[hypothesis.Phase.generate],
    )
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def call(case: Any) -> None:
        nonlocal calls
        calls += 1
        response = case.call(headers={"Authorization": f"Bearer {token}"})
        where = f"{mode.value} {case.method} {case.formatted_path} query={case.query} body={case.body!r}"
        content_type = (response.headers.get("content-type") or [""])[0]
        if response.status_code >= 500:
            problems.append(f"{response.status_code} for {where[:400]}: {response.text[:300]}")
        elif response.status_code != 204 and not content_type.startswith("application/json"):
            problems.append(f"non-JSON {response.status_code} for {where[:400]}")

    call()
    return calls, problems


@pytest.fixture
def wsgi_app() -> Iterator[Any]:
    """Django's WSGI application, called in this thread inside the test's transaction.

    Like Django's own test client, keep the end of each request from closing the
    database connection, which would end the test's transaction.
    """
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield get_wsgi_application()
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


def test_generated_requests_never_get_a_server_error(
    world: Any, wsgi_app: Any, settings: Any
) -> None:
    # Hundreds of calls as one user in a minute: the walk is not a test of the rate.
    settings.QM_API_RATE_USER = "100000/minute"
    # The schema is read as a signed-in user reads it (QM_API_SCHEMA_REQUIRES_SIGN_IN).
    _, reader = api_token_create(user=world.users["admin"], name="schema")
    schema = schemathesis.openapi.from_wsgi(
        "/api/schema/", wsgi_app, headers={"Authorization": f"Bearer {reader}"}
    )
    failures: list[str] = []
    checked = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode, examples in EXAMPLES_PER_OPERATION.items():
            # A fresh token per run: a generated DELETE may revoke the one before.
            ApiToken.objects.filter(user=world.users["admin"]).update(revoked_at=timezone.now())
            _, token = api_token_create(
                user=world.users["admin"], name=f"fuzz {operation.label}"[:100]
            )
            calls, problems = fuzz(operation, mode, examples, token)
            checked += calls
            failures.extend(problems)
    assert checked > 250
    assert not failures, "\n".join(failures[:20])
