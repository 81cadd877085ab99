"""Every page runs the same number of queries with 10 jobs as with 1,000:
nothing is loaded row by row as history grows."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from tests.portal.pages.conftest import page_client, seed_jobs

pytestmark = pytest.mark.django_db


def _pages(world: Any, history: Any, persona: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(method, url, form data) of every page the persona may open."""
    pages = [
        ("get", reverse("dashboard"), {}),
        ("get", reverse("team-list"), {}),
        ("get", reverse("team-detail", args=["vision"]), {}),
        ("get", reverse("job-list"), {}),
        ("get", reverse("job-list"), {"state": "pending", "team": "vision"}),
        ("get", reverse("job-detail", args=[history.preemptor.pk]), {}),
        ("get", reverse("telemetry"), {}),
        ("get", reverse("gpu-hours-csv"), {"period": "7d"}),
        ("get", reverse("priority-classes"), {}),
        ("get", reverse("tokens"), {}),
        ("get", reverse("metrics"), {}),
    ]
    if persona == "admin":
        pages.append(("get", reverse("job-detail", args=[history.victim.pk]), {}))
    if persona in ("admin", "manager"):
        quota = world.quota(world.vision)
        pages += [
            ("get", reverse("quota-edit", args=[quota.pk]), {}),
            (
                "post",
                reverse("quota-preview", args=[quota.pk]),
                {"guarantee": 8, "borrow_limit": 4},
            ),
            (
                "post",
                reverse("quota-edit", args=[quota.pk]),
                {"guarantee": 8, "borrow_limit": 4, "action": "preview"},
            ),
        ]
    return pages


def _count(client: Client, method: str, url: str, data: dict[str, Any]) -> int:
    with CaptureQueriesContext(connection) as queries:
        response = getattr(client, method)(url, data)
    assert response.status_code == 200, (url, response.status_code)
    return len(queries)


@pytest.mark.parametrize("persona", ["admin", "manager", "researcher"])
def test_query_counts_are_the_same_at_10_and_1000_jobs(
    world: Any, history: Any, persona: str
) -> None:
    client = page_client(world, persona)
    pages = _pages(world, history, persona)
    # The first request of a session warms caches (e.g. content types); count from the second.
    for method, url, data in pages:
        _count(client, method, url, data)
    small = {
        (method, url, str(data)): _count(client, method, url, data) for method, url, data in pages
    }
    seed_jobs(world, 990)
    large = {
        (method, url, str(data)): _count(client, method, url, data) for method, url, data in pages
    }
    assert large == small
