"""The dashboard's panels that depend on how the cluster is set up: the
largest free block appears only where the nodes carry a topology."""

from __future__ import annotations

from typing import Any

import pytest
from django.urls import reverse

from quotas.models import Node
from tests.portal.pages.conftest import page_client

pytestmark = pytest.mark.django_db

RACK_KEY = "topology.quartermaster.io/rack"


@pytest.mark.parametrize(
    "levels",
    [
        pytest.param({"block": "topology.quartermaster.io/block", "rack": RACK_KEY}, id="levels"),
        pytest.param({}, id="no-levels"),
    ],
)
@pytest.mark.parametrize("persona", ["admin", "manager", "researcher"])
def test_no_free_block_panel_without_a_topology(
    world: Any, settings: Any, levels: dict[str, str], persona: str
) -> None:
    # The world's nodes carry no topology label: every level but the node's has no
    # domain, and the panel would be rows of zeros.
    settings.QM_TOPOLOGY_LABELS = levels
    body = page_client(world, persona).get(reverse("dashboard")).content.decode()
    assert 'id="fragmentation"' not in body
    assert "Largest free block" not in body


def test_the_free_block_panel_appears_once_a_node_names_its_rack(world: Any, settings: Any) -> None:
    settings.QM_TOPOLOGY_LABELS = {"rack": RACK_KEY}
    Node.objects.filter(name__in=["h100-node-0", "h100-node-1"]).update(labels={RACK_KEY: "r0"})
    body = page_client(world, "researcher").get(reverse("dashboard")).content.decode()
    section = body[body.index('id="fragmentation"') :]
    section = section[: section.index("</section>")]
    rack = section[section.index('data-flavor="h100-80gb" data-level="rack"') :]
    rack = rack[: rack.index("</tr>")]
    # Both labelled nodes are free: 16 GPUs in rack r0, the only rack.
    assert '<td class="num" data-figure="largest">16</td><td>r0</td>' in rack
