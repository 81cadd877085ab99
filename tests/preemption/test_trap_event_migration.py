"""Trap events moved from telemetry to preemption without losing a row: the
migration keeps the table (renamed) and every event in it."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from tests.conftest import MISSION_CLASSES

BEFORE = [("preemption", "0005_preemption_reason_shutdown"), ("telemetry", "0002_simulationrun")]
AFTER = [
    ("preemption", "0006_trapevent_from_telemetry"),
    ("telemetry", "0003_trapevent_to_preemption"),
]


@pytest.mark.django_db(transaction=True)
def test_events_recorded_under_telemetry_are_preemptions_after_the_move() -> None:
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    old = executor.loader.project_state(BEFORE).apps
    flavor = old.get_model("quotas", "ResourceFlavor").objects.create(name="h100-80gb")
    team = old.get_model("quotas", "Team").objects.create(slug="vision", name="Vision")
    user = old.get_model("auth", "User").objects.create(username="researcher")
    batch = old.get_model("quotas", "PriorityClass").objects.get_or_create(
        name="ai-batch-preemptible", defaults=MISSION_CLASSES["ai-batch-preemptible"]
    )[0]
    job = old.get_model("preemption", "Job").objects.create(
        team=team,
        submitter=user,
        priority_class=batch,
        flavor=flavor,
        ranks=1,
        gpus_per_rank=1,
        command="true",
    )
    old.get_model("telemetry", "TrapEvent").objects.create(
        job=job, attempt=1, rank=0, event="signal_received", at=1.5, payload={}, fingerprint="f1"
    )

    executor = MigrationExecutor(connection)
    executor.migrate(AFTER)
    new = executor.loader.project_state(AFTER).apps
    moved = new.get_model("preemption", "TrapEvent").objects.get()
    assert (moved.job_id, moved.event, moved.fingerprint) == (job.pk, "signal_received", "f1")
    assert "preemption_trapevent" in connection.introspection.table_names()
    assert "telemetry_trapevent" not in connection.introspection.table_names()

    # Back again (the way out of a bad deploy) keeps the row as well.
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    back = executor.loader.project_state(BEFORE).apps
    assert back.get_model("telemetry", "TrapEvent").objects.get().fingerprint == "f1"
    MigrationExecutor(connection).migrate(executor.loader.graph.leaf_nodes())
