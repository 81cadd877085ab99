"""A reconcile pass runs with the cyclic garbage collector paused, as a scheduling
cycle does, and leaves it as it found it: on again after the pass, whether the pass
ended well or raised, and still off where its caller had turned it off."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from preemption.models import Rank
from preemption.reconcile import reconcile_jobs
from preemption.runtimes.mimic import MimicRuntime
from tests.preemption.conftest import launched

pytestmark = pytest.mark.django_db


def watch_observe(mimic: MimicRuntime, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether the collector was on at each of the pass's observations of the runtime."""
    seen: list[bool] = []
    observe = mimic.observe

    def watching(gang: Any = None) -> Any:
        seen.append(gc.isenabled())
        return observe(gang)

    monkeypatch.setattr(mimic, "observe", watching)
    return seen


def test_a_pass_runs_with_the_collector_off_and_turns_it_on_again(
    world: Any, mimic: MimicRuntime, monkeypatch: pytest.MonkeyPatch, collector_on: None
) -> None:
    job = launched(world, mimic)
    seen = watch_observe(mimic, monkeypatch)
    assert reconcile_jobs(runtime=mimic) == 1
    assert seen and not any(seen)
    assert gc.isenabled()
    # The pass did its work with the collector off: the ranks are recorded as running.
    assert set(Rank.objects.filter(attempt__job=job).values_list("state", flat=True)) == {
        Rank.State.RUNNING
    }


def test_a_pass_for_named_jobs_runs_with_the_collector_off_too(
    world: Any, mimic: MimicRuntime, monkeypatch: pytest.MonkeyPatch, collector_on: None
) -> None:
    job = launched(world, mimic)
    seen = watch_observe(mimic, monkeypatch)
    assert reconcile_jobs(job_ids=[job.pk], runtime=mimic) == 1
    assert seen and not any(seen)
    assert gc.isenabled()


def test_a_pass_that_raises_still_turns_the_collector_on_again(
    world: Any, mimic: MimicRuntime, monkeypatch: pytest.MonkeyPatch, collector_on: None
) -> None:
    launched(world, mimic)

    def broken(gang: Any = None) -> Any:
        raise ValueError("a record that is not JSON")

    monkeypatch.setattr(mimic, "observe", broken)
    with pytest.raises(ValueError, match="not JSON"):
        reconcile_jobs(runtime=mimic)
    assert gc.isenabled()


def test_a_pass_keeps_a_pause_of_its_caller(
    world: Any, mimic: MimicRuntime, monkeypatch: pytest.MonkeyPatch, collector_on: None
) -> None:
    launched(world, mimic)
    gc.disable()
    assert reconcile_jobs(runtime=mimic) == 1
    assert not gc.isenabled()
