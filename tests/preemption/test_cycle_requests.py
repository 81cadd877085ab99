"""An extra scheduling cycle is asked for once until a cycle starts: a burst of
submissions sends one message, not one each, and no request is left uncovered."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from portal import tasks
from preemption.cycle import schedule_cycle
from preemption.models import Attempt, JobState
from preemption.services import job_submit
from preemption.wakeup import REQUEST_OVERDUE_SECONDS, claim_cycle_request, cycle_waiting
from tests import builders

pytestmark = [pytest.mark.django_db(transaction=True)]


def test_a_request_waits_for_the_cycle_that_takes_it(
    world: Any, settings: Any, tmp_path: Path
) -> None:
    settings.VAR_DIR = tmp_path
    assert claim_cycle_request() is True
    assert claim_cycle_request() is False  # the first request's cycle will see this one too
    job = job_submit(
        submitter=world.users["researcher"],
        team=world.vision,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=1,
        command="true",
        priority_class=world.batch,
    )
    schedule_cycle(act=False)
    assert Attempt.objects.filter(job=job).exists()
    # The cycle took the request: the next one is sent again.
    assert claim_cycle_request() is True
    # A request whose cycle never came (its message lost or expired) is sent again.
    marker = tmp_path / "cycle.requested"
    past = time.time() - REQUEST_OVERDUE_SECONDS - 1
    os.utime(marker, (past, past))
    assert claim_cycle_request() is True
    assert claim_cycle_request() is False


def test_a_requested_cycle_that_another_cycle_served_does_nothing(
    world: Any, settings: Any, tmp_path: Path
) -> None:
    settings.VAR_DIR = tmp_path
    asked = time.time() - 1.0  # file times may run a clock tick behind time.time()
    schedule_cycle(act=False)  # starts after the request: it saw what the request saw
    job = builders.job(world, world.vision, state=JobState.PENDING)
    assert tasks.schedule_cycle(requested_at=asked) == {
        "admitted": 0,
        "preempted": 0,
        "waiting": 0,
    }
    assert not Attempt.objects.filter(job=job).exists()
    # A request made after the last cycle started gets its cycle.
    assert tasks.schedule_cycle(requested_at=time.time())["admitted"] == 1
    assert Attempt.objects.filter(job=job).exists()


def test_the_beats_cycle_is_skipped_right_after_another_cycle(
    world: Any, settings: Any, tmp_path: Path
) -> None:
    settings.VAR_DIR = tmp_path
    settings.QM_CYCLE_SECONDS = 4.0
    schedule_cycle(act=False)
    job = builders.job(world, world.vision, state=JobState.PENDING)
    # Less than half a period later the beat's cycle plans nothing again.
    assert tasks.schedule_cycle() == {"admitted": 0, "preempted": 0, "waiting": 0}
    assert not Attempt.objects.filter(job=job).exists()
    # Half a period on, it runs.
    time.sleep(2.2)
    assert tasks.schedule_cycle()["admitted"] == 1
    assert Attempt.objects.filter(job=job).exists()


def test_a_reconcile_pass_runs_the_cycle_that_was_asked_for(
    world: Any, settings: Any, tmp_path: Path, local_runtime: Any
) -> None:
    settings.VAR_DIR = tmp_path
    # Runs throughout, so that no job ends (and asks for a cycle) during the test.
    job = builders.job(world, world.vision, state=JobState.PENDING, command="sleep 60")
    assert claim_cycle_request() is True  # asked for; no cycle has started since
    tasks.reconcile()
    assert Attempt.objects.filter(job=job).exists()
    # With no cycle asked for, a pass leaves waiting jobs to the periodic cycle.
    (tmp_path / "cycle.requested").unlink(missing_ok=True)
    other = builders.job(world, world.vision, state=JobState.PENDING)
    assert not cycle_waiting()
    tasks.reconcile()
    assert not Attempt.objects.filter(job=other).exists()
