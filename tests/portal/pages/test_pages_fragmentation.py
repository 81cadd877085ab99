"""Fragmentation: the largest block of free GPUs per flavor and level, from the nodes'
topology labels and the running attempts, checked against figures worked out by hand,
and the same figures on the dashboard and through the API.

The cluster here (h100, 8 GPUs a node; QM_TOPOLOGY_LABELS block and rack):

    block b0: rack r0: node-0 (8 held, 0 free), node-1 (3 held, 5 free)
              rack r1: node-2 (8 free; a finished attempt once ran there)
    block b1: rack r2: node-3 (2 held, 6 free), node-4 cordoned (not counted)
    a100-node-0: no labels, 8 free

By hand: per node the largest is node-2's 8; per rack r0 has 0 + 5 = 5, r1 8 and
r2 6, so 8 in r1; per block b0 has 0 + 5 + 8 = 13 and b1 6, so 13 in b0. Free in all:
19 h100 GPUs. The a100 node is in no rack or block: 0 there, 8 on the node.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from preemption.models import JobState
from quotas.models import Node
from telemetry.selectors import FreeBlock, free_blocks
from tests import builders
from tests.portal.pages.conftest import page_client

pytestmark = pytest.mark.django_db

RACK_KEY = "topology.quartermaster.io/rack"
BLOCK_KEY = "topology.quartermaster.io/block"


@pytest.fixture
def racks(world: Any, settings: Any) -> Any:
    settings.QM_TOPOLOGY_LABELS = {"block": BLOCK_KEY, "rack": RACK_KEY}
    Node.objects.create(name="h100-node-3", flavor=world.h100, gpus=8)
    Node.objects.create(
        name="h100-node-4",
        flavor=world.h100,
        gpus=8,
        schedulable=False,
        labels={BLOCK_KEY: "b1", RACK_KEY: "r2"},
    )
    for name, block, rack in (
        ("h100-node-0", "b0", "r0"),
        ("h100-node-1", "b0", "r0"),
        ("h100-node-2", "b0", "r1"),
        ("h100-node-3", "b1", "r2"),
    ):
        Node.objects.filter(name=name).update(labels={BLOCK_KEY: block, RACK_KEY: rack})
    builders.running_job(world, world.vision, node="h100-node-0", ranks=2, gpus_per_rank=4)
    builders.running_job(world, world.nlp, node="h100-node-1", ranks=1, gpus_per_rank=3)
    builders.running_job(world, world.ops, node="h100-node-3", ranks=1, gpus_per_rank=2)
    done = builders.job(world, world.vision, state=JobState.SUCCEEDED, ranks=1, gpus_per_rank=8)
    builders.attempt(done, node="h100-node-2", ended_at=timezone.now())
    return world


def test_the_largest_free_block_per_level_is_what_was_worked_out_by_hand(racks: Any) -> None:
    assert free_blocks() == [
        FreeBlock("a100-40gb", "node", 8, "a100-node-0", 1, 8),
        FreeBlock("a100-40gb", "rack", 0, "", 0, 8),
        FreeBlock("a100-40gb", "block", 0, "", 0, 8),
        FreeBlock("h100-80gb", "node", 8, "h100-node-2", 4, 19),
        FreeBlock("h100-80gb", "rack", 8, "r1", 3, 19),
        FreeBlock("h100-80gb", "block", 13, "b0", 2, 19),
    ]


def test_the_dashboard_shows_the_largest_free_block_per_level(racks: Any) -> None:
    body = page_client(racks, "other_researcher").get(reverse("dashboard")).content.decode()
    section = body[body.index('id="fragmentation"') :]
    section = section[: section.index("</section>")]
    for flavor, level, largest, where in (
        ("h100-80gb", "node", 8, "h100-node-2"),
        ("h100-80gb", "rack", 8, "r1"),
        ("h100-80gb", "block", 13, "b0"),
        ("a100-40gb", "rack", 0, "—"),
    ):
        row = section[section.index(f'data-flavor="{flavor}" data-level="{level}"') :]
        row = row[: row.index("</tr>")]
        assert f'<td class="num" data-figure="largest">{largest}</td><td>{where}</td>' in row


def test_the_api_gives_the_same_figures(racks: Any) -> None:
    response = racks.client("researcher").get("/api/v1/fragmentation/")
    assert response.status_code == 200
    rows = {(row["flavor"], row["level"]): row for row in response.json()}
    assert rows[("h100-80gb", "block")] == {
        "flavor": "h100-80gb",
        "level": "block",
        "largest": 13,
        "domain": "b0",
        "domains": 2,
        "free": 19,
    }
    assert rows[("h100-80gb", "rack")]["largest"] == 8
    assert racks.client("anonymous").get("/api/v1/fragmentation/").status_code == 401
