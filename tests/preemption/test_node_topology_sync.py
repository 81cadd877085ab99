"""The nodes' topology as the runtime reports it reaches the engine: the local
runtime's inventory (QM_LOCAL_NODES) is written into the nodes' labels under the
levels' label keys, and the next snapshot places by it. The Kubernetes side is in
tests/k8s/test_k8s_node_topology.py."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ValidationError

from preemption import runtime
from preemption.snapshot import build_snapshot
from quotas.models import AuditEntry, Node
from quotas.services import node_topology_sync
from tests.conftest import database_state

pytestmark = pytest.mark.django_db

RACK_KEY = "topology.quartermaster.io/rack"
BLOCK_KEY = "topology.quartermaster.io/block"


@pytest.fixture(autouse=True)
def _levels(settings: Any) -> None:
    settings.QM_TOPOLOGY_LABELS = {"block": BLOCK_KEY, "rack": RACK_KEY}
    settings.QM_RUNTIME = "local"


def test_the_local_inventory_topology_reaches_the_snapshot(world: Any, settings: Any) -> None:
    Node.objects.filter(name="h100-node-2").update(labels={RACK_KEY: "old", "team": "keep"})
    settings.QM_LOCAL_NODES = (
        "h100-node-0:h100-80gb:8:block=b0/rack=r0,"
        "h100-node-1:h100-80gb:8:block=b0/rack=r1,"
        "h100-node-2:h100-80gb:8"
    )
    assert runtime.sync_node_topology() == ["h100-node-0", "h100-node-1", "h100-node-2"]
    topology = {node.name: dict(node.topology) for node in build_snapshot().nodes}
    assert topology["h100-node-0"] == {"block": "b0", "rack": "r0"}
    assert topology["h100-node-1"] == {"block": "b0", "rack": "r1"}
    # A level the inventory no longer gives is gone; other labels stay.
    assert topology["h100-node-2"] == {}
    assert Node.objects.get(name="h100-node-2").labels == {"team": "keep"}
    assert AuditEntry.objects.filter(action="node.topology").count() == 3
    # Nothing changed since: nothing is written again.
    assert runtime.sync_node_topology() == []


def test_without_an_inventory_the_database_is_the_inventory(world: Any, settings: Any) -> None:
    settings.QM_LOCAL_NODES = ""
    Node.objects.filter(name="h100-node-0").update(labels={RACK_KEY: "r7"})
    assert runtime.sync_node_topology() == []
    assert Node.objects.get(name="h100-node-0").labels == {RACK_KEY: "r7"}


def test_an_unknown_level_or_a_bad_domain_refuses_the_whole_sync(world: Any) -> None:
    before = database_state()
    with pytest.raises(ValidationError) as refused:
        node_topology_sync(
            topology_by_node={"h100-node-0": {"rack": "r1"}, "h100-node-1": {"row": "x"}}
        )
    assert refused.value.message_dict == {
        "topology": ["node h100-node-1: Unknown topology level 'row'; the levels are: block, rack."]
    }
    with pytest.raises(ValidationError, match="is not a label value"):
        node_topology_sync(topology_by_node={"h100-node-0": {"rack": "r 1"}})
    assert database_state() == before
