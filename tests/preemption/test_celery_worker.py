"""The scheduling cycle and the reconciler run in a real Celery worker over
Redis (not eager mode), against the same PostgreSQL database."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection

from portal.processes import worker_command
from portal.tasks import reconcile, schedule_cycle
from preemption.models import Attempt, Job, JobState
from preemption.services import job_submit
from tests.preemption.conftest import sleeper_command

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def test_a_real_worker_admits_runs_and_finishes_a_job(world: Any, tmp_path: Path) -> None:
    assert settings.CELERY_BROKER_URL.startswith("redis://"), "make test runs this against Redis"
    queue = f"test-{uuid.uuid4().hex[:8]}"
    db = connection.settings_dict
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}:{db['PASSWORD']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}",
        "QM_RUNS_DIR": str(tmp_path / "runs"),
        "QM_CHECKPOINTS_DIR": str(tmp_path / "checkpoints"),
    }
    worker = subprocess.Popen(
        # The portal's own worker command line, on a queue of its own with one process.
        [*worker_command(hostname=f"{queue}@%h", concurrency=1), "--pool", "solo", "-Q", queue],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        job = job_submit(
            submitter=world.users["researcher"],
            team=world.vision,
            flavor=world.h100,
            ranks=2,
            gpus_per_rank=2,
            command=sleeper_command(1),
            priority_class=world.batch,
            name="via-worker",
        )
        schedule_cycle.apply_async(queue=queue)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not Attempt.objects.filter(job=job).exists():
            time.sleep(0.2)
        assert Attempt.objects.filter(job=job).exists(), "the worker's cycle admitted the job"
        while (
            time.monotonic() < deadline and Job.objects.get(pk=job.pk).state != JobState.SUCCEEDED
        ):
            # A pass of this job only, as the events endpoint asks for one once a
            # victim's notice checkpoint committed: the job's arguments go through
            # the broker.
            reconcile.apply_async(kwargs={"job_ids": [job.pk]}, queue=queue)
            time.sleep(0.5)
        assert Job.objects.get(pk=job.pk).state == JobState.SUCCEEDED
        assert sorted(
            Attempt.objects.get(job=job).rank_set.values_list("exit_code", flat=True)
        ) == [0, 0]
    except AssertionError as failure:
        worker.terminate()
        output = worker.communicate(timeout=30)[0].decode(errors="replace")
        # What the worker said is the way to tell why it did not get there.
        raise AssertionError(f"{failure}\nthe worker's output:\n{output[-6000:]}") from failure
    finally:
        if worker.poll() is None:
            worker.terminate()
    output = worker.communicate(timeout=30)[0].decode(errors="replace")
    assert "preemption.tasks.schedule_cycle" in output and "succeeded" in output
