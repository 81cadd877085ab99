"""The priority classes page names, from each persona, the teams of theirs that
may use each class, each class's notice window, and whether its elastic jobs shrink
before they are evicted."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.urls import reverse

from quotas.models import PriorityClass
from quotas.services import team_priority_classes_set
from tests.portal.pages.conftest import page_client

pytestmark = pytest.mark.django_db


def _cell(body: str, class_name: str, field: str) -> str:
    """The text of one cell of a class's row, tags and surrounding space removed."""
    row = body[body.index(f'data-class="{class_name}"') :]
    row = row[: row.index("</tr>")]
    cell = re.search(rf'<td[^>]*data-field="{field}">(.*?)</td>', row, re.S)
    assert cell, (class_name, field)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", cell.group(1))).strip()


# Both top-level teams (org, other) allow both classes in the world fixture.
@pytest.mark.parametrize(
    ("persona", "teams"),
    [
        ("admin", "org, other"),
        ("manager", "ml"),
        ("other_manager", "other"),
        ("researcher", "vision"),
        ("other_researcher", "ops"),
    ],
)
def test_each_class_names_the_readers_teams_that_may_use_it(
    world: Any, persona: str, teams: str
) -> None:
    body = page_client(world, persona).get(reverse("priority-classes")).content.decode()
    assert "<th>Teams</th>" in body
    assert _cell(body, "ai-prod-critical", "teams") == teams
    assert _cell(body, "ai-batch-preemptible", "teams") == teams


@pytest.mark.parametrize(
    ("persona", "critical", "batch"),
    [
        ("admin", "org (not ml), other", "org, other"),
        ("manager", "none of your teams", "ml"),
        ("researcher", "none of your teams", "vision"),
        ("other_researcher", "ops", "ops"),
    ],
)
def test_a_narrowed_branch_is_named_as_the_exception(
    world: Any, persona: str, critical: str, batch: str
) -> None:
    # ml (and so vision and nlp below it) may use only the batch class.
    team_priority_classes_set(
        actor=world.users["admin"], team=world.ml, priority_classes=[world.batch], may_widen=True
    )
    body = page_client(world, persona).get(reverse("priority-classes")).content.decode()
    assert _cell(body, "ai-prod-critical", "teams") == critical
    assert _cell(body, "ai-batch-preemptible", "teams") == batch


def test_a_class_no_team_may_use_says_so(world: Any) -> None:
    PriorityClass.objects.create(name="research-spot", value=1, grace_seconds=30)
    body = page_client(world, "admin").get(reverse("priority-classes")).content.decode()
    assert _cell(body, "research-spot", "teams") == "none of your teams"


def test_each_class_shows_its_notice_window(world: Any) -> None:
    PriorityClass.objects.filter(pk=world.critical.pk).update(notice_seconds=45)
    PriorityClass.objects.filter(pk=world.batch.pk).update(notice_seconds=0)
    body = page_client(world, "researcher").get(reverse("priority-classes")).content.decode()
    assert '<th class="num">Notice</th>' in body
    assert _cell(body, "ai-prod-critical", "notice") == "45 s"
    assert _cell(body, "ai-batch-preemptible", "notice") == "none"
    assert _cell(body, "ai-prod-critical", "grace") == "90 s"
    assert "the notice window" in body


def test_a_class_whose_elastic_jobs_shrink_first_says_so(world: Any) -> None:
    PriorityClass.objects.filter(pk=world.batch.pk).update(shrink_elastic=True)
    body = page_client(world, "researcher").get(reverse("priority-classes")).content.decode()
    assert _cell(body, "ai-batch-preemptible", "preemptible") == (
        "preemptible elastic jobs shrink first"
    )
    assert _cell(body, "ai-prod-critical", "preemptible") == "protected"
