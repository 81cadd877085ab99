"""Topology through the portal's cycle, on the test database: racks read from the nodes'
labels under the configured keys, and a gang that requires one rack placed inside one."""

from __future__ import annotations

from typing import Any

import pytest

from preemption.cycle import schedule_cycle
from preemption.models import Attempt, Job, JobState
from preemption.services import job_submit
from preemption.snapshot import build_snapshot
from quotas.models import Node

pytestmark = pytest.mark.django_db

RACK_KEY = "topology.quartermaster.io/rack"


def _gang(world: Any, ranks: int, *, level: str = "rack") -> Job:
    job = job_submit(
        submitter=world.users["researcher"],
        team=world.vision,
        flavor=world.h100,
        ranks=ranks,
        gpus_per_rank=4,
        command="true",
        priority_class=world.batch,
        name="gang",
    )
    Job.objects.filter(pk=job.pk).update(topology_level=level)
    return job


def test_the_snapshot_reads_racks_from_the_configured_label_keys(world: Any, settings: Any) -> None:
    Node.objects.filter(name="h100-node-0").update(labels={RACK_KEY: "r0", "other": "x"})
    Node.objects.filter(name="h100-node-1").update(labels={"my/rack": "r9"})
    _gang(world, 2)
    snapshot = build_snapshot()
    topology = {node.name: dict(node.topology) for node in snapshot.nodes}
    assert topology["h100-node-0"] == {"rack": "r0"}
    assert topology["h100-node-1"] == {}
    (gang,) = snapshot.workloads
    assert gang.topology_level == "rack" and gang.topology_required

    settings.QM_TOPOLOGY_LABELS = {"rack": "my/rack"}
    topology = {node.name: dict(node.topology) for node in build_snapshot().nodes}
    assert topology["h100-node-0"] == {}
    assert topology["h100-node-1"] == {"rack": "r9"}


def test_a_gang_that_requires_one_rack_is_placed_inside_one(world: Any) -> None:
    # Nodes 0 and 1 in rack r0, node 2 alone in rack r1: 3 ranks of 4 GPUs fit r0 only.
    for name, rack in (("h100-node-0", "r0"), ("h100-node-1", "r0"), ("h100-node-2", "r1")):
        Node.objects.filter(name=name).update(labels={RACK_KEY: rack})
    gang = _gang(world, 3)
    schedule_cycle(act=False)
    gang.refresh_from_db()
    assert gang.state == JobState.ADMITTED
    nodes = {entry["node"] for entry in Attempt.objects.get(job=gang).placement}
    assert nodes <= {"h100-node-0", "h100-node-1"}


def test_a_gang_whose_level_no_node_has_waits_and_says_so(world: Any) -> None:
    gang = _gang(world, 1, level="block")
    schedule_cycle(act=False)
    gang.refresh_from_db()
    assert gang.state == JobState.PENDING
    assert gang.waiting_reason == "no node of flavor h100-80gb has a block in its topology"
