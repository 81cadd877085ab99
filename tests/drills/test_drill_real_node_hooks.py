"""The drill's hooks for a test cluster of real kubelets on one machine
(tests/k8s/realnodes/test_real_drill.py): nodes of fewer GPUs, so that eight ranks
span two nodes, and a web server on an address the pods reach."""

from __future__ import annotations

import pytest

from drills.base import BIND_ADDRESS_ENV, GPUS_PER_NODE_ENV, DrillError
from drills.harness import Drill
from quotas.models import Node, Quota
from tests.conftest import mission_class

# As in test_drill_setup: the drill's waits close connections, so commit for real.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _classes() -> None:
    mission_class("ai-prod-critical")
    mission_class("ai-batch-preemptible")


def _drill(ranks: int) -> Drill:
    return Drill(ranks=ranks, grace=None, runtime="kubernetes", say=lambda line: None)


def test_by_default_nodes_have_8_gpus_and_the_web_server_listens_on_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(GPUS_PER_NODE_ENV, raising=False)
    monkeypatch.delenv(BIND_ADDRESS_ENV, raising=False)
    drill = _drill(8)
    assert (drill.nodes, drill.capacity, drill.bind_address) == (1, 8, "127.0.0.1")


def test_nodes_of_4_gpus_spread_8_ranks_over_two_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GPUS_PER_NODE_ENV, "4")
    monkeypatch.setenv(BIND_ADDRESS_ENV, "10.213.0.1")
    drill = _drill(8)
    drill.setup()
    assert (drill.nodes, drill.capacity, drill.bind_address) == (2, 8, "10.213.0.1")
    assert sorted(
        Node.objects.filter(flavor__name="drill-gpu", schedulable=True).values_list("name", "gpus")
    ) == [("drill-node-0", 4), ("drill-node-1", 4)]
    assert Quota.objects.get(team__slug="drill-owner", flavor__name="drill-gpu").guarantee == 8


@pytest.mark.parametrize("value", ["0", "65", "four"])
def test_a_gpu_count_out_of_range_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(GPUS_PER_NODE_ENV, value)
    with pytest.raises(DrillError, match=GPUS_PER_NODE_ENV):
        _drill(8)
