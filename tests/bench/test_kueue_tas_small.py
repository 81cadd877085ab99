"""Kueue's topology-aware config through the comparison's mapping (bench/kueue_qm.py),
small: the topology's levels become Quartermaster's (QM_TOPOLOGY_LABELS), its nodes
are created with Kueue's names and labels, each workload is a gang submitted through
the REST API with its level, required or only preferred, and one scheduling cycle
places them. Every admitted gang that requires a rack sits inside one, and the check
the benchmark prints (`placement_check`) counts what the placements show."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.test import Client, override_settings

from bench.kueue_qm import (
    _job_body,
    _setup_world,
    expand,
    load_config,
    placement_check,
    topology_env,
    topology_labels_setting,
    topology_nodes,
)
from bench.kueue_side import KueueRunError, is_topology_aware, parse_results
from bench.kueue_table import comparison_rows, format_table
from preemption.cycle import schedule_cycle
from preemption.models import Attempt, Job
from preemption.runtime import sync_node_topology
from preemption.runtimes import parse_inventory
from quotas.models import Node

pytestmark = pytest.mark.django_db
CONFIG = Path(__file__).with_name("kueue_tas_small.yaml")
RACK = "cloud.provider.com/topology-rack"


def test_the_config_maps_to_gangs_on_kueues_nodes() -> None:
    config = load_config(CONFIG)
    expansion = expand(config)

    # 500m requests on 1-CPU nodes: Quartermaster counts units of 500m.
    assert config.unit_millis == 500
    assert config.topology is not None and config.topology.node_capacity == 2
    assert topology_labels_setting(config.topology) == {
        "block": "cloud.provider.com/topology-block",
        "rack": RACK,
        "node": "kubernetes.io/hostname",
    }
    nodes = topology_nodes(config.topology)
    assert sorted(nodes) == ["node-b0-r0-n0", "node-b0-r0-n1", "node-b0-r1-n0", "node-b0-r1-n1"]
    # A domain's label carries its path, so the two racks' first nodes differ.
    assert nodes["node-b0-r1-n0"][RACK] == "block-0.rack-1"
    assert nodes["node-b0-r1-n0"]["kubernetes.io/hostname"] == "block-0.rack-1.node-0"
    assert nodes["node-b0-r0-n0"]["tas-node-group"] == "tas"
    gangs = {
        w.class_name: (w.pods, w.request, w.topology_level, w.topology_required)
        for w in expansion.workloads
    }
    assert gangs == {
        "large-required-rack": (3, 1, "rack", True),
        "small-preferred-rack": (2, 1, "rack", False),
        # Kueue's slice-required request, held here by the whole gang in one rack.
        "small-balanced-rack": (2, 1, "rack", True),
    }


def test_every_admitted_gang_sits_inside_the_rack_it_requires() -> None:
    expansion = expand(load_config(CONFIG))
    labels = topology_labels_setting(expansion.topology)
    with override_settings(QM_TOPOLOGY_LABELS=labels):
        token, limits = _setup_world(expansion)
        response = Client().post(
            "/api/v1/jobs/batch/",
            {"jobs": [_job_body(w, expansion.flavor) for w in expansion.workloads]},
            content_type="application/json",
            headers={"Authorization": f"Bearer {token}"},
        )
        assert response.status_code == 201, response.content
        schedule_cycle(act=False)

    node_labels = {n.name: n.labels for n in Node.objects.all()}
    classes = {(w.queue, w.name): w for w in expansion.workloads}
    rows: list[dict[str, Any]] = []
    racks_of: dict[str, list[set[str]]] = {}
    for job in Job.objects.filter(team__slug__in=limits):
        workload = classes[(job.team.slug, job.name)]
        assert (job.ranks, job.gpus_per_rank) == (workload.pods, workload.request)
        assert (job.topology_level, job.topology_required) == ("rack", workload.topology_required)
        placements = [a.placement for a in Attempt.objects.filter(job=job)]
        rows.append(
            {
                "queue": job.team.slug,
                "name": job.name,
                "topology_level": workload.topology_level,
                "topology_required": workload.topology_required,
                "placements": placements,
            }
        )
        racks_of.setdefault(workload.class_name, []).extend(
            {node_labels[entry["node"]][RACK] for entry in placement} for placement in placements
        )

    # The two gangs of three fill three quarters of a rack each, one in each rack.
    required = racks_of["large-required-rack"]
    assert [len(racks) for racks in required] == [1, 1]
    assert required[0] != required[1]
    # What is left is one unit in each rack: the preferred gang of two spans them, and
    # the balanced one, which needs one rack, is not placed.
    assert racks_of["small-preferred-rack"] == [{"block-0.rack-0", "block-0.rack-1"}]
    assert racks_of["small-balanced-rack"] == []
    assert placement_check(rows, node_labels, expansion.topology) == {
        "attempts_checked": 3,
        "across_required": 0,
        "across_preferred": 1,
        "unknown_nodes": 0,
        "offenders": [],
    }


def test_the_runtime_reports_the_nodes_topology_so_the_periodic_sync_keeps_it(
    tmp_path: Path,
) -> None:
    expansion = expand(load_config(CONFIG))
    env = topology_env(expansion)
    assert env["QM_TOPOLOGY_LABELS"] == (
        "block=cloud.provider.com/topology-block,rack=cloud.provider.com/topology-rack,"
        "node=kubernetes.io/hostname"
    )
    inventory = {node.name: node for node in parse_inventory(env["QM_LOCAL_NODES"])}
    assert inventory["node-b0-r1-n0"].flavor == "tas-flavor"
    assert inventory["node-b0-r1-n0"].gpus == 2
    assert dict(inventory["node-b0-r1-n0"].topology) == {
        "block": "block-0",
        "rack": "block-0.rack-1",
        "node": "block-0.rack-1.node-0",
    }
    # The processes' settings: the mimic runtime reports this inventory, and the sync
    # task that writes it over the nodes' labels every minute changes nothing (without
    # it the runtime reported the nodes without their topology, and the sync wiped it).
    with override_settings(
        QM_TOPOLOGY_LABELS=topology_labels_setting(expansion.topology),
        QM_RUNTIME="mimic",
        QM_RUNS_DIR=str(tmp_path),
        QM_LOCAL_NODES=env["QM_LOCAL_NODES"],
    ):
        _setup_world(expansion)
        before = {n.name: n.labels for n in Node.objects.all()}
        assert sync_node_topology() == []
    assert {n.name: n.labels for n in Node.objects.all()} == before
    assert before["node-b0-r1-n0"][RACK] == "block-0.rack-1"


def test_the_check_counts_a_gang_placed_across_a_rack_it_requires() -> None:
    topology = load_config(CONFIG).topology
    assert topology is not None
    nodes = topology_nodes(topology)
    spread = [{"node": "node-b0-r0-n0", "ranks": 1}, {"node": "node-b0-r1-n0", "ranks": 1}]
    inside = [{"node": "node-b0-r0-n0", "ranks": 1}, {"node": "node-b0-r0-n1", "ranks": 1}]
    rows = [
        {
            "queue": "q",
            "name": "spread",
            "topology_level": "rack",
            "topology_required": True,
            "placements": [inside, spread],
        },
        {
            "queue": "q",
            "name": "elsewhere",
            "topology_level": "rack",
            "topology_required": True,
            "placements": [[{"node": "gone", "ranks": 2}]],
        },
        {
            "queue": "q",
            "name": "anywhere",
            "topology_level": None,
            "topology_required": True,
            "placements": [spread],
        },
    ]

    check = placement_check(rows, nodes, topology)

    assert check == {
        "attempts_checked": 3,
        "across_required": 1,
        "across_preferred": 0,
        "unknown_nodes": 1,
        "offenders": ["q/spread"],
    }


def test_the_table_shows_the_placement_check_with_its_goal() -> None:
    kueue = {"total_s": 400.0, "admission": {"small-required-rack": {"mean_s": 240.0}}}
    quartermaster: dict[str, Any] = {
        "total_s": 150.0,
        "admission": {"small-required-rack": {"mean_s": 60.0}},
        "placement": {"attempts_checked": 15000, "across_required": 0, "across_preferred": 7},
    }
    rows = {row.label: row for row in comparison_rows(kueue, quartermaster)}

    assert rows["placed across a required domain"].verdict == "met"
    assert rows["placed across a required domain"].kueue is None
    assert rows["placed across a preferred domain"].quartermaster == 7
    assert rows["placed across a preferred domain"].verdict == ""
    table = format_table(kueue, quartermaster)
    assert "placed across a required domain" in table and "QM <= 0: met" in table
    # Quartermaster's side always counts its reclaim; Kueue's scalability test has none
    # to compare, so the table shows no reclaim rows.
    quartermaster["reclaim"] = {"evictions": 0, "lost_gpu_seconds": 0.0}
    assert "work lost" not in format_table(kueue, quartermaster)

    quartermaster["placement"]["across_required"] = 2
    rows = {row.label: row for row in comparison_rows(kueue, quartermaster)}
    assert rows["placed across a required domain"].verdict == "missed"
    # A config without topology checks no placement and shows no such row.
    del quartermaster["placement"]
    assert not any("placed across" in row.label for row in comparison_rows(kueue, quartermaster))


def test_kueues_runner_gets_tas_on_a_topology_config_and_a_run_admitting_nothing_is_refused(
    tmp_path: Path,
) -> None:
    assert is_topology_aware(CONFIG)
    assert not is_topology_aware(CONFIG.with_name("kueue_small.yaml"))

    # What Kueue's runner left when minimalkueue ran without TAS: every workload
    # recorded, none admitted, no CPU used.
    (tmp_path / "summary.yaml").write_text(
        "clusterQueueClasses:\n  cq:\n    cpuAverageUsage: 0\n    cpuUsed: 0\n"
        '    firstEventTime: "2026-12-06T11:10:29.848126756Z"\n'
        '    lastEventTime: "2026-12-06T11:12:22.098112094Z"\n    nominalQuota: 600000\n'
        "droppedWorkloadEvents: 0\nworkloadClasses:\n  small-required-rack:\n"
        "    averageTimeToAdmissionMs: 0\n    averageTimeToFinishMs: 0\n    count: 2\n"
        "    totalEvictions: 0\n"
    )
    (tmp_path / "wlStates.csv").write_text(
        "id,class name,namespace,name,ms to admitted,ms to finish,num evictions\n"
        "0,small-required-rack,cq-0-0-cohort-0,small-required-rack-0-0-0,0,0,0\n"
        "1,small-required-rack,cq-0-0-cohort-0,small-required-rack-0-1-0,0,0,0\n"
    )
    (tmp_path / "minimalkueue.stats.yaml").write_text(
        "maxrss: 267928\nsysMs: 1446\nuserMs: 12006\nwallMs: 121129\n"
    )
    with pytest.raises(KueueRunError, match="admitted none of the 2 workloads"):
        parse_results(tmp_path)
