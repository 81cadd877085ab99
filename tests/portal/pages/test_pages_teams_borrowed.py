"""The Teams list has a Borrowed column that shows, per team and flavor, the
figure the dashboard shows: what the team holds now beyond its own guarantee,
read from the one selector behind every borrowed figure (`UsageNow`).

The world: org 16 > ml 16 > vision 8 and nlp 8; other 8 > ops 8; 24 h100 GPUs.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.urls import reverse

from tests import builders
from tests.portal.pages.conftest import page_client

pytestmark = pytest.mark.django_db

FLAVOR = "h100-80gb"


def _team_list_borrowed(body: str) -> dict[str, int]:
    rows = re.findall(r'<tr data-team="([\w-]+)">(.*?)</tr>', body, re.S)
    borrowed = {}
    for slug, row in rows:
        figure = re.search(rf'data-flavor="{FLAVOR}" data-field="borrowed">(\d+)<', row)
        assert figure is not None, (slug, row)
        borrowed[slug] = int(figure.group(1))
    return borrowed


def _dashboard_borrowed(body: str) -> dict[str, int]:
    teams = {}
    for slug, row in re.findall(
        rf'<tr data-team="([\w-]+)" data-flavor="{FLAVOR}">(.*?)</tr>', body, re.S
    ):
        figure = re.search(r'data-field="borrowed">(?:<strong class="borrow">)?(\d+)', row)
        assert figure is not None
        teams[slug] = int(figure.group(1))
    return teams


def test_team_list_shows_the_dashboards_borrowed_figure(world: Any) -> None:
    # vision runs 12 (4 beyond its 8, inside ml); ops runs 12 (4 beyond other's 8).
    builders.running_job(world, world.vision, ranks=1, gpus_per_rank=12)
    builders.running_job(world, world.ops, ranks=1, gpus_per_rank=12)
    client = page_client(world, "admin")
    body = client.get(reverse("team-list")).content.decode()
    assert '<th class="num" title="GPUs held now beyond the guarantee">Borrowed</th>' in body
    listed = _team_list_borrowed(body)
    # By hand: borrowed = max(0, used - guarantee) of each team's subtree.
    assert listed == {"org": 0, "ml": 0, "vision": 4, "nlp": 0, "other": 4, "ops": 4}
    assert listed == _dashboard_borrowed(client.get(reverse("dashboard")).content.decode())


def test_team_list_borrowed_column_shows_only_readable_teams(world: Any) -> None:
    builders.running_job(world, world.vision, ranks=1, gpus_per_rank=12)
    body = page_client(world, "other_researcher").get(reverse("team-list")).content.decode()
    assert _team_list_borrowed(body) == {"ops": 0}
