"""Layout and wording shared by every page: one way to write an empty limit,
plurals that agree with their number, the folding navigation and the dark and
focus styles, and an unknown flavor answered with the valid ones. How the
layout looks at 390 px and in dark mode is checked in a browser in tests/e2e."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.contrib.staticfiles import finders
from django.urls import reverse

from preemption.models import Job, JobState
from quotas.models import Quota
from quotas.wording import LEND_ALL, NO_LIMIT
from tests.portal.api.test_api_validation import refused
from tests.portal.pages.conftest import page_client

pytestmark = pytest.mark.django_db


def test_empty_limits_read_the_same_on_every_page(world: Any) -> None:
    quota = Quota.objects.get(team=world.vision, flavor=world.h100)
    assert (quota.borrow_limit, quota.lend_limit) == (None, None)
    client = page_client(world, "manager")
    pages = {
        "team list": client.get(reverse("team-list")).content.decode(),
        "team page": client.get(reverse("team-detail", args=["vision"])).content.decode(),
        "quota editor": client.get(reverse("quota-edit", args=[quota.pk])).content.decode(),
    }
    for name, body in pages.items():
        assert NO_LIMIT in body and LEND_ALL in body, name
        for other in ("all idle", "∞", ">all<"):
            assert other not in body, (name, other)
    editor = pages["quota editor"]
    assert f'placeholder="{NO_LIMIT}"' in editor
    assert f'placeholder="{LEND_ALL}"' in editor
    # A set limit is written as its number.
    quota.borrow_limit, quota.lend_limit = 4, 2
    quota.save(update_fields=["borrow_limit", "lend_limit"])
    body = client.get(reverse("team-detail", args=["vision"])).content.decode()
    assert re.search(r'data-field="borrow_limit">4<', body)
    assert re.search(r'data-field="lend_limit">2<', body)


@pytest.mark.parametrize(
    ("ranks", "gpus_per_rank", "words"),
    [
        (1, 1, "1 rank × 1 h100-80gb = 1 GPU<"),
        (2, 1, "2 ranks × 1 h100-80gb = 2 GPUs<"),
        (1, 4, "1 rank × 4 h100-80gb = 4 GPUs<"),
    ],
)
def test_job_page_plurals_agree(world: Any, ranks: int, gpus_per_rank: int, words: str) -> None:
    job = Job.objects.create(
        name="plural",
        team=world.vision,
        submitter=world.users["researcher"],
        priority_class=world.batch,
        flavor=world.h100,
        ranks=ranks,
        gpus_per_rank=gpus_per_rank,
        command="true",
        state=JobState.PENDING,
    )
    body = (
        page_client(world, "researcher").get(reverse("job-detail", args=[job.pk])).content.decode()
    )
    assert words in body


def test_navigation_folds_behind_a_menu_button_and_styles_cover_dark_and_focus(
    world: Any,
) -> None:
    body = page_client(world, "researcher").get(reverse("dashboard")).content.decode()
    assert (
        '<button type="button" class="navtoggle" aria-expanded="false" aria-controls="mainnav">'
        in body
    )
    assert '<nav class="mainnav" id="mainnav"' in body
    css = Path(finders.find("portal/portal.css")).read_text(encoding="utf-8")
    assert "@media (prefers-color-scheme: dark)" in css
    assert ":focus-visible" in css
    assert "@media (max-width: 760px)" in css


def test_unknown_flavor_is_answered_with_the_valid_ones(world: Any) -> None:
    body = refused(
        world.client("admin"),
        "post",
        "/api/v1/quotas/",
        {"team": "org", "flavor": "h200", "guarantee": 1},
    )
    assert body == {"flavor": ["There is no 'h200'; the valid choices are: a100-40gb, h100-80gb."]}


def test_unknown_team_is_never_answered_with_a_list_of_teams(world: Any) -> None:
    body = refused(
        world.client("researcher"),
        "post",
        "/api/v1/jobs/",
        {"team": "nope", "flavor": "h100-80gb", "ranks": 1, "gpus_per_rank": 1, "command": "true"},
        status=403,
    )
    # Refused as a hidden team is, so the answer says nothing of which teams exist.
    assert body == {"detail": "You may not submit jobs to team nope."}
