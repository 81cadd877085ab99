"""The scheduling cycle and the reconciler run in a real Celery worker over
Redis (not eager mode), against the same PostgreSQL database."""

from __future__ import annotations

import os
import re
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


def _worker_env(tmp_path: Path) -> dict[str, str]:
    """A worker's environment: this test database, and runs and checkpoints of its own."""
    db = connection.settings_dict
    return {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}:{db['PASSWORD']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}",
        "QM_RUNS_DIR": str(tmp_path / "runs"),
        "QM_CHECKPOINTS_DIR": str(tmp_path / "checkpoints"),
    }


def _start_worker(queue: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """The portal's own worker command line, on a queue of its own with one process,
    once it says it is ready: tasks expire five seconds after they are sent, and a
    worker starting on a loaded machine may take longer than that to take them."""
    with open(log, "wb") as out:
        worker = subprocess.Popen(
            [*worker_command(hostname=f"{queue}@%h", concurrency=1), "--pool", "solo", "-Q", queue],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and worker.poll() is None:
        if re.search(rf"{queue}@\S+ ready\.", log.read_text(errors="replace")):
            return worker
        time.sleep(0.2)
    worker.terminate()
    worker.wait(timeout=30)
    raise AssertionError(
        f"the worker never said it was ready:\n{log.read_text(errors='replace')[-6000:]}"
    )


def test_a_real_worker_admits_runs_and_finishes_a_job(world: Any, tmp_path: Path) -> None:
    assert settings.CELERY_BROKER_URL.startswith("redis://"), "make test runs this against Redis"
    queue = f"test-{uuid.uuid4().hex[:8]}"
    env = _worker_env(tmp_path)
    log = tmp_path / "worker.log"
    worker = _start_worker(queue, env, log)
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
        worker.wait(timeout=30)
        output = log.read_text(errors="replace")
        # What the worker said is the way to tell why it did not get there.
        raise AssertionError(f"{failure}\nthe worker's output:\n{output[-6000:]}") from failure
    finally:
        if worker.poll() is None:
            worker.terminate()
    worker.wait(timeout=30)
    output = log.read_text(errors="replace")
    assert "preemption.tasks.schedule_cycle" in output and "succeeded" in output


def _sessions_opened(database: str) -> int:
    """PostgreSQL's count of the sessions ever opened to `database`, read afresh."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT sessions FROM pg_stat_database WHERE datname = %s", [database])
        return int(cursor.fetchone()[0])


def test_a_worker_keeps_its_database_session_across_tasks(world: Any, tmp_path: Path) -> None:
    # Passes run four times a second: a new PostgreSQL session for each (a backend
    # forked, authenticated, its caches warmed) cost the worker a twentieth of its time.
    queue = f"test-{uuid.uuid4().hex[:8]}"
    env = _worker_env(tmp_path)
    log = tmp_path / "worker.log"
    tasks = 12
    database = connection.settings_dict["NAME"]
    before = _sessions_opened(database)
    worker = _start_worker(queue, env, log)
    try:
        for _ in range(tasks):
            reconcile.apply_async(kwargs={"job_ids": []}, queue=queue)
        deadline = time.monotonic() + 120
        done = 0
        while time.monotonic() < deadline and done < tasks:
            time.sleep(0.2)
            done = len(
                re.findall(
                    r"preemption\.tasks\.reconcile\[[^\]]+\] succeeded",
                    log.read_text(errors="replace"),
                )
            )
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    output = log.read_text(errors="replace")
    assert done == tasks, output[-6000:]
    # The worker's sessions have ended, so their counts are in; a second read waits
    # for the statistics to be flushed should the first come too early.
    deadline = time.monotonic() + 10
    opened = _sessions_opened(database) - before
    while opened == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        opened = _sessions_opened(database) - before
    assert 1 <= opened <= 2, (opened, output[-3000:])
