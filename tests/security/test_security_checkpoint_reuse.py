"""The checkpoint store outlives the database that numbers jobs: after a restore or
a reinstall, a new job gets the number of an old one. It must start from nothing,
never from the `latest` the old job (another team's, perhaps) left behind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.db import connection

from preemption.models import Job
from preemption.services import job_submit


def _submit(world: Any, team: Any) -> Job:
    return job_submit(
        submitter=world.users["researcher"],
        team=team,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=1,
        command="python train.py",
    )


def _next_job_number_is(number: int) -> None:
    """What a database restored from an older backup does: count from `number` again."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT setval(pg_get_serial_sequence(%s, 'id'), %s, false)",
                [Job._meta.db_table, number],
            )
        else:
            cursor.execute(
                "UPDATE sqlite_sequence SET seq = %s WHERE name = %s",
                [number - 1, Job._meta.db_table],
            )


def test_a_job_with_an_old_jobs_number_gets_a_folder_of_its_own(
    world: Any, settings: Any, tmp_path: Path
) -> None:
    settings.QM_CHECKPOINTS_DIR = tmp_path
    old = _submit(world, world.vision)
    folder = Path(old.checkpoint_dir)
    folder.mkdir(parents=True)
    (folder / "latest").write_text(json.dumps({"step": 900, "path": "step_900"}))
    number = old.pk
    Job.objects.filter(pk=number).delete()
    _next_job_number_is(number)

    new = _submit(world, world.vision)

    assert new.pk == number
    assert new.checkpoint_dir != old.checkpoint_dir
    assert not Path(new.checkpoint_dir).exists()
    # The old job's files are left alone: they are not the new job's to delete.
    assert (folder / "latest").exists()
