"""A manager's quota preview shows the manager's own teams by name and everyone else
only in sums: no other tenant's job, fair share or usage can be read through it.

The scene: vision (under the manager's ml) is guaranteed nothing and waits with 8 GPUs
while ops, a team of another root, borrows 8; raising vision's guarantee to 8 reclaims
ops's borrower and moves ops's fair share. An admin's preview names all of it, which
is what proves the manager's is scoped rather than empty."""

from __future__ import annotations

from typing import Any

import pytest
from django.urls import reverse

from quotas.models import Quota
from tests import builders
from tests.conftest import database_state
from tests.portal.pages.conftest import page_client

pytestmark = pytest.mark.django_db


def _scene(world: Any) -> None:
    for team, guarantee in ((world.vision, 0), (world.nlp, 8)):
        Quota.objects.filter(team=team, flavor=world.h100).update(guarantee=guarantee)
    for team, name, node in (
        (world.nlp, "nlp-job", "h100-node-0"),
        (world.ops, "ops-own", "h100-node-1"),
        (world.ops, "ops-secret-borrower", "h100-node-2"),
    ):
        builders.running_job(
            world,
            team,
            name=name,
            ranks=1,
            gpus_per_rank=8,
            priority_class=world.batch,
            attempt_fields={"placement": [{"node": node, "ranks": 1}]},
        )
    builders.job(world, world.ops, state="pending", gpus_per_rank=8, name="ops-secret-waiting")
    builders.job(world, world.vision, state="pending", gpus_per_rank=8, name="wants")


def _api_preview(world: Any, persona: str) -> dict[str, Any]:
    before = database_state()
    response = world.client(persona).post(
        f"/api/v1/quotas/{world.quota(world.vision).pk}/preview/", {"guarantee": 8}, format="json"
    )
    assert response.status_code == 200, response.content
    assert database_state() == before
    body: dict[str, Any] = response.json()
    return body


def test_the_admin_preview_names_the_other_tenant(world: Any) -> None:
    _scene(world)
    body = _api_preview(world, "admin")
    assert "ops" in body["fair_share"]
    assert [item["job_name"] for item in body["reclaimed"]] == ["ops-secret-borrower"]
    assert body["fair_share_elsewhere"] == {} and body["reclaimed_elsewhere"]["jobs"] == 0


def test_a_managers_api_preview_sums_up_every_team_outside_theirs(world: Any) -> None:
    _scene(world)
    admin = _api_preview(world, "admin")
    body = _api_preview(world, "manager")
    readable = {"ml", "vision", "nlp"}
    assert set(body["fair_share"]) <= readable
    assert {item["team"] for item in body["decayed_usage"]} <= readable
    assert body["reclaimed"] == [] and body["reclaimed_elsewhere"] == {"jobs": 1, "gpus": 8}
    # Every team the manager may not read is in the sums, and only there.
    hidden = {
        queue: flavors for queue, flavors in admin["fair_share"].items() if queue not in readable
    }
    assert hidden, admin["fair_share"]
    for flavor, total in body["fair_share_elsewhere"].items():
        teams = [flavors[flavor] for flavors in hidden.values() if flavor in flavors]
        assert total["teams"] == len(teams)
        assert total["after"] == pytest.approx(sum(move["after"] or 0 for move in teams))
    text = str(body)
    for secret in ("ops-secret-borrower", "ops-secret-waiting", "'ops'", '"ops"', "other"):
        assert secret not in text, secret


def test_a_managers_preview_page_names_no_other_tenant(world: Any) -> None:
    _scene(world)
    client = page_client(world, "manager")
    before = database_state()
    response = client.post(
        reverse("quota-preview", args=[world.quota(world.vision).pk]), {"guarantee": 8}
    )
    assert response.status_code == 200
    assert database_state() == before
    page = response.content.decode()
    assert "ops-secret-borrower" not in page and "ops-secret-waiting" not in page
    assert "<td>ops</td>" not in page
    assert 'id="reclaimed-elsewhere"' in page
    # Nothing moves here; the count of unchanged fair shares is of the manager's teams only.
    readable_pairs = sum(
        len(flavors) for flavors in _api_preview(world, "manager")["fair_share"].values()
    )
    assert f"No fair share moves ({readable_pairs} unchanged)" in page
    assert readable_pairs < sum(
        len(flavors) for flavors in _api_preview(world, "admin")["fair_share"].values()
    )


def test_other_teams_fair_shares_that_move_show_as_one_row_per_flavor() -> None:
    from django.template.loader import render_to_string

    from portal.web.quotas.views import preview_context

    consequences = {
        "change": {},
        "fair_share": {"vision": {"h100-80gb": {"before": 8.0, "after": 6.0}}},
        "fair_share_elsewhere": {
            "h100-80gb": {"teams": 2, "before": 4.0, "after": 6.0},
            "a100-40gb": {"teams": 2, "before": 3.0, "after": 3.0},
        },
    }
    page = render_to_string("quotas/_preview.html", preview_context(consequences))
    assert "2 teams outside yours, together" in page
    assert page.count('class="elsewhere"') == 1  # the a100 shares of others did not move
    assert "+2" in page and "-2" in page
