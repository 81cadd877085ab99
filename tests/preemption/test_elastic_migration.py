"""Attempts written before elastic jobs ran at their job's size: the migration that
adds `Attempt.ranks` gives each of them its job's `ranks`."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from tests.conftest import MISSION_CLASSES

BEFORE = [("preemption", "0017_rank_end_reason_disk_limit")]
AFTER = [("preemption", "0018_elastic_ranks")]


@pytest.mark.django_db(transaction=True)
def test_every_earlier_attempt_gets_its_jobs_size() -> None:
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    old = executor.loader.project_state(BEFORE).apps
    flavor = old.get_model("quotas", "ResourceFlavor").objects.create(name="h100-80gb")
    team = old.get_model("quotas", "Team").objects.create(slug="vision", name="Vision")
    user = old.get_model("auth", "User").objects.create(username="researcher")
    batch = old.get_model("quotas", "PriorityClass").objects.get_or_create(
        name="ai-batch-preemptible", defaults=MISSION_CLASSES["ai-batch-preemptible"]
    )[0]
    Job = old.get_model("preemption", "Job")
    Attempt = old.get_model("preemption", "Attempt")
    sizes = {}
    for ranks in (1, 3, 8):
        job = Job.objects.create(
            team=team,
            submitter=user,
            priority_class=batch,
            flavor=flavor,
            ranks=ranks,
            gpus_per_rank=1,
            command="true",
        )
        for number in (1, 2):
            attempt = Attempt.objects.create(
                job=job,
                number=number,
                admitted_at=datetime(2026, 12, 1, tzinfo=UTC),
                ended_at=datetime(2026, 12, 1, 1, tzinfo=UTC) if number == 1 else None,
            )
            sizes[attempt.pk] = ranks

    executor = MigrationExecutor(connection)
    executor.migrate(AFTER)
    new = executor.loader.project_state(AFTER).apps
    migrated = dict(new.get_model("preemption", "Attempt").objects.values_list("pk", "ranks"))
    assert migrated == sizes
    jobs = new.get_model("preemption", "Job").objects.values_list("ranks_min", "rank_sizes")
    assert list(jobs) == [(None, [])] * 3
    MigrationExecutor(connection).migrate(executor.loader.graph.leaf_nodes())
