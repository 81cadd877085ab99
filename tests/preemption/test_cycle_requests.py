"""An extra scheduling cycle is asked for once until a cycle starts: a burst of
submissions sends one message, not one each, and no request is left uncovered."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from preemption.cycle import schedule_cycle
from preemption.models import Attempt
from preemption.services import job_submit
from preemption.wakeup import REQUEST_OVERDUE_SECONDS, claim_cycle_request

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
