"""The Nodes page and the over-commitment warning.

A drained node (`schedulable` false) leaves the capacity top-level guarantees
are counted against. The Nodes page lists every node with its flavor, GPUs,
GPUs in use, state and topology; where a flavor's top-level guarantees exceed
its schedulable GPUs, the dashboard's flavor card, the team pages and the Nodes
page say so, naming the drained nodes.

The world: 3 h100 nodes of 8 GPUs (24), one a100 node of 8; org is guaranteed
16 h100 GPUs and other 8, so the cluster's h100 guarantees are exactly full.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.urls import reverse

from quotas.models import Node
from tests import builders
from tests.conftest import PERSONAS
from tests.portal.pages.conftest import page_client

pytestmark = pytest.mark.django_db

WARNING = "24 GPUs of h100-80gb guaranteed, 16 schedulable: 8 drained on h100-node-2"


def _drain(world: Any, name: str) -> None:
    """Drain a node as an admin does, through the API."""
    node = Node.objects.get(name=name)
    response = world.client("admin").patch(
        f"/api/v1/nodes/{node.pk}/", {"schedulable": False}, format="json"
    )
    assert response.status_code == 200, response.content


def _warnings(body: str) -> list[tuple[str, str]]:
    """(flavor, text) of each over-commitment warning on a page."""
    return [
        (flavor, re.sub(r"<[^>]+>", "", text))
        for flavor, text in re.findall(
            r'<p class="errors capacity-warning" role="alert" data-flavor="([\w-]+)">(.*?)</p>',
            body,
            re.S,
        )
    ]


# persona -> (status, nav link to Nodes, links to change a node)
ACCESS = {
    "admin": (200, True, True),
    "manager": (200, True, False),
    "other_manager": (200, True, False),
    "researcher": (200, False, False),
    "other_researcher": (200, False, False),
    "anonymous": (302, False, False),
}


@pytest.mark.parametrize("persona", PERSONAS)
def test_nodes_page_access_by_persona(world: Any, persona: str) -> None:
    status, nav_link, change_links = ACCESS[persona]
    client = page_client(world, persona)
    response = client.get(reverse("node-list"))
    assert response.status_code == status
    if status == 302:
        assert response["Location"].startswith(reverse("login"))
        return
    body = response.content.decode()
    assert re.findall(r'<tr data-node="([\w-]+)"', body) == [
        "a100-node-0",
        "h100-node-0",
        "h100-node-1",
        "h100-node-2",
    ]
    assert ('href="/admin/quotas/node/' in body) is change_links
    dashboard = client.get(reverse("dashboard")).content.decode()
    assert (f'<a href="{reverse("node-list")}" ' in dashboard) is nav_link


def test_nodes_page_shows_state_usage_and_topology_and_no_tenant(world: Any, settings: Any) -> None:
    settings.QM_TOPOLOGY_LABELS = {"rack": "example.org/rack"}
    Node.objects.filter(name="h100-node-1").update(labels={"example.org/rack": "r7"})
    # ops runs a 6-GPU job on node 0: the figures show, its name and team do not.
    builders.running_job(
        world, world.ops, name="secret-train", ranks=2, gpus_per_rank=3, node="h100-node-0"
    )
    _drain(world, "h100-node-2")
    body = page_client(world, "researcher").get(reverse("node-list")).content.decode()
    rows = dict(re.findall(r'<tr data-node="([\w-]+)" (.*?)</tr>', body, re.S))
    node0, node1, node2 = rows["h100-node-0"], rows["h100-node-1"], rows["h100-node-2"]
    assert 'data-field="used">6<' in node0 and 'data-field="free">2<' in node0
    assert '<span class="pill ok">schedulable</span>' in node0
    assert 'data-level="rack">r7<' in node1 and 'data-level="rack"><' in node0
    assert 'data-schedulable="false"' in node2
    assert '<span class="pill warn">drained</span>' in node2
    assert 'data-field="free">0<' in node2
    flavor = re.search(r'<tr data-flavor="h100-80gb">(.*?)</tr>', body, re.S)
    assert flavor is not None
    assert 'data-figure="schedulable">16<' in flavor.group(1)
    assert 'data-figure="drained">8<' in flavor.group(1)
    assert 'data-figure="used">6<' in flavor.group(1)
    assert "secret-train" not in body and "/teams/ops/" not in body and "data-team" not in body


def test_no_warning_while_the_guarantees_fit(world: Any) -> None:
    client = page_client(world, "admin")
    for name in ("dashboard", "team-list", "node-list"):
        assert _warnings(client.get(reverse(name)).content.decode()) == [], name


@pytest.mark.parametrize(
    ("persona", "page"),
    [
        ("admin", ("dashboard", ())),
        ("admin", ("node-list", ())),
        ("manager", ("team-list", ())),
        ("manager", ("team-detail", ("vision",))),
        ("researcher", ("dashboard", ())),
        ("other_researcher", ("team-detail", ("ops",))),
    ],
)
def test_a_drained_node_that_leaves_guarantees_uncovered_is_flagged(
    world: Any, persona: str, page: tuple[str, tuple[str, ...]]
) -> None:
    _drain(world, "h100-node-2")
    name, args = page
    body = page_client(world, persona).get(reverse(name, args=args)).content.decode()
    warnings = _warnings(body)
    assert [flavor for flavor, _ in warnings] == ["h100-80gb"]
    text = warnings[0][1]
    assert f"Over-committed: {WARNING}." in text
    # The dashboard's narrow flavor card leaves the explanation to the other pages.
    assert ("until 8 more GPUs are schedulable" in text) is (name != "dashboard")
    if name == "dashboard":
        # On the h100 card, not on the a100 one.
        card = re.search(r'data-flavor="h100-80gb">(.*?)</article>', body, re.S)
        assert card is not None and WARNING in card.group(1)


def test_a_team_page_warns_only_about_its_own_flavors(world: Any) -> None:
    _drain(world, "h100-node-2")
    builders.team("infer", parent=None, quotas={world.a100: 8})
    body = page_client(world, "admin").get(reverse("team-detail", args=["infer"]))
    assert _warnings(body.content.decode()) == []


def test_a_shortfall_without_drained_nodes_says_so_without_naming_nodes(world: Any) -> None:
    # Node 2 is removed from the inventory rather than drained.
    Node.objects.filter(name="h100-node-2").update(gpus=0)
    body = page_client(world, "admin").get(reverse("node-list")).content.decode()
    assert _warnings(body) == [
        (
            "h100-80gb",
            "Over-committed: 24 GPUs of h100-80gb guaranteed, 16 schedulable. The guarantees "
            "of h100-80gb cannot all be honoured until 8 more GPUs are schedulable, so a team "
            "that reclaims its guarantee may wait. See the nodes.",
        )
    ]
