"""The plan runs with the cyclic collector paused, and leaves it as it found it."""

from __future__ import annotations

import gc

import pytest
from fairshare_builders import admitted, cluster, nodes, preempted, team
from fairshare_builders import workload as w

import fairshare
from fairshare import collector_paused
from fairshare.native import python_sources


def test_the_collector_is_off_inside_and_on_again_after(collector_on):
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_an_error_inside_still_turns_it_back_on(collector_on):
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("plan failed")
    assert gc.isenabled()


def test_a_pause_of_the_caller_is_kept(collector_on):
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_nested_pauses_turn_it_on_only_at_the_outer_end(collector_on):
    with collector_paused():
        with collector_paused():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_plan_runs_without_the_collector_and_restores_it(collector_on, monkeypatch):
    seen: list[bool] = []
    real = gc.isenabled

    def watching_prepare(snapshot):
        seen.append(real())
        return original(snapshot)

    # From the sources: the compiled engine calls its own ``prepare``, past the probe.
    engine = python_sources().engine
    original = engine.prepare
    monkeypatch.setattr(engine, "prepare", watching_prepare)
    snapshot = cluster(
        nodes("n", 1, 8), queues=[team("a", guarantee=8)], workloads=[w("w1").queue("a").gpus(2)]
    )
    result = engine.plan(snapshot)
    assert admitted(result) == {"w1"}
    assert seen == [False]
    assert gc.isenabled()


@pytest.mark.parametrize("engine", ["loaded", "sources"])
def test_a_plan_leaves_nothing_for_the_cyclic_collector(collector_on, engine):
    # Two levels of teams (the fair-share division and the statuses' lending walk the
    # tree), borrowed work reclaimed by its owner (a victim scan runs): everything the
    # plan built is freed by reference counting when it ends, so the collector's next
    # pass has no garbage of the plan's to walk and free.
    plan = python_sources().plan if engine == "sources" else fairshare.plan
    snapshot = cluster(
        nodes("n", 2, 8),
        queues=[
            team("org", guarantee=16),
            team("a", "org", guarantee=8),
            team("b", "org", guarantee=8),
        ],
        workloads=[
            *(w(f"b{i}").queue("b").gpus(4).running(f"n{i // 2}") for i in range(4)),
            w("a1").queue("a").gpus(8),
        ],
    )
    gc.collect()
    gc.disable()
    result = plan(snapshot)
    assert set(preempted(result)) == {"b0", "b1"} or set(preempted(result)) == {"b2", "b3"}
    assert gc.collect() == 0
