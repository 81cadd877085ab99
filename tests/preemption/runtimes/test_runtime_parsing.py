"""Pure parsing helpers of the runtimes: the node inventory and trap event lines."""

from __future__ import annotations

import pytest

from preemption.runtimes import (
    GangId,
    GangSpec,
    NodeInventory,
    RankPlacement,
    iter_trap_events,
    parse_inventory,
)


def test_inventory_parses_name_flavor_and_gpus() -> None:
    assert parse_inventory("gpu-a:h100-80gb:8, gpu-b : a100-40gb : 4") == [
        NodeInventory(name="gpu-a", flavor="h100-80gb", gpus=8),
        NodeInventory(name="gpu-b", flavor="a100-40gb", gpus=4),
    ]


def test_inventory_parses_each_nodes_topology() -> None:
    assert parse_inventory("gpu-a:h100:8:block=b0/rack=r1, gpu-b:h100:8: rack = r2 ") == [
        NodeInventory(
            name="gpu-a", flavor="h100", gpus=8, topology=(("block", "b0"), ("rack", "r1"))
        ),
        NodeInventory(name="gpu-b", flavor="h100", gpus=8, topology=(("rack", "r2"),)),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpu-a:h100:8:rack", r"topology 'rack' must be level=domain"),
        ("gpu-a:h100:8:=r1", r"topology '=r1' must be level=domain"),
        ("gpu-a:h100:8:rack=r1/", r"topology '' must be level=domain"),
        ("gpu-a:h100:8:rack=r1/rack=r2", "gives the rack twice"),
        ("gpu-a:h100:8:rack=r1:x", "must be name:flavor:gpus"),
    ],
)
def test_inventory_rejects_a_bad_topology(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_inventory(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        (" , ", "empty"),
        ("gpu-a:h100-80gb", r"entry 1 \('gpu-a:h100-80gb'\) must be name:flavor:gpus"),
        ("gpu-a:h100-80gb:8,gpu-b:h100:8:1", "entry 2"),
        ("gpu-a:h100-80gb:eight", "'eight' is not a positive integer"),
        ("gpu-a:h100-80gb:0", "'0' is not a positive integer"),
        ("gpu-a:h100-80gb:-2", "'-2' is not a positive integer"),
        (":h100-80gb:8", "needs a node name and a flavor"),
        ("gpu-a::8", "needs a node name and a flavor"),
        ("gpu-a:h100-80gb:8,gpu-a:a100-40gb:8", "names node 'gpu-a' twice"),
        ("gpu-a:h100-80gb:8,", "entry 2"),
    ],
)
def test_inventory_rejects_bad_input_with_a_clear_message(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_inventory(text)


def test_trap_events_are_parsed_in_order_and_noise_is_skipped() -> None:
    log = (
        b"step 1 loss 0.5\n"
        b'QM_EVENT {"event": "signal_received", "job_id": 3, "rank": 0, "at": 10.25}\n'
        b"QM_EVENT not json at all\n"
        b'QM_EVENT ["event", "a list"]\n'
        b'QM_EVENT {"no_event_key": 1}\n'
        b'QM_EVENT {"event": "x"} trailing words\n'
        b'warning from a child QM_EVENT {"event": "checkpoint_committed", "step": 7}\r\n'
        b'  QM_EVENT {"event": "exiting", "code": 0, "reason": "preempted \\u00e9"}\n'
        b'QM_EVENT {"event": "resumed", "ste'
    )
    assert list(iter_trap_events(log)) == [
        {"event": "signal_received", "job_id": 3, "rank": 0, "at": 10.25},
        {"event": "checkpoint_committed", "step": 7},
        {"event": "exiting", "code": 0, "reason": "preempted \u00e9"},
    ]
    assert list(iter_trap_events(b"")) == []


def test_gang_spec_names_its_gang_and_world_size() -> None:
    spec = GangSpec(
        job_id=4,
        attempt=2,
        command="true",
        ranks=(RankPlacement(0, "gpu-a", 0), RankPlacement(1, "gpu-b", 0)),
        gpus_per_rank=8,
        grace_seconds=30.0,
        priority_class="ai-batch-preemptible",
        env={},
    )
    assert spec.gang == GangId(job_id=4, attempt=2)
    assert spec.world_size == 2
