"""Whether a priority class lets the scheduler resize its running elastic jobs
(`shrink_elastic`), through the API: off unless set, set and changed by admins with
an audit row, a value that is no boolean refused naming the field; and what the engine's
snapshot offers a running elastic job of such a class."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from preemption.snapshot import read_snapshot
from preemption.snapshot import workload_id as wid
from quotas.models import AuditEntry, PriorityClass
from tests import builders
from tests.conftest import database_state

pytestmark = pytest.mark.django_db

CLASSES = "/api/v1/priority-classes/"


def refused(client: APIClient, method: str, path: str, body: Any) -> dict[str, Any]:
    before = database_state()
    response = getattr(client, method)(path, body, format="json")
    assert response.status_code == 400, (response.status_code, response.content[:500])
    assert database_state() == before, "a refused call changed the database"
    return response.json()


def test_a_class_does_not_resize_elastic_jobs_unless_told(world: Any) -> None:
    admin = world.client("admin")
    created = admin.post(CLASSES, {"name": "plain", "value": 5}, format="json")
    assert created.status_code == 201
    assert created.json()["shrink_elastic"] is False
    assert PriorityClass.objects.get(name="plain").shrink_elastic is False
    shown = admin.get(f"{CLASSES}{created.json()['id']}/")
    assert shown.status_code == 200 and shown.json()["shrink_elastic"] is False


def test_shrinking_is_set_changed_and_audited(world: Any) -> None:
    admin = world.client("admin")
    created = admin.post(
        CLASSES, {"name": "stretchy", "value": 5, "shrink_elastic": True}, format="json"
    )
    assert created.status_code == 201 and created.json()["shrink_elastic"] is True
    pk = created.json()["id"]
    changed = admin.patch(f"{CLASSES}{pk}/", {"shrink_elastic": False}, format="json")
    assert changed.status_code == 200 and changed.json()["shrink_elastic"] is False
    assert PriorityClass.objects.get(pk=pk).shrink_elastic is False
    entry = (
        AuditEntry.objects.filter(action="priority_class.save", object_id=str(pk))
        .order_by("id")
        .last()
    )
    assert entry is not None
    assert (entry.before["shrink_elastic"], entry.after["shrink_elastic"]) == (True, False)


@pytest.mark.parametrize("value", ["sometimes", 7, [True], None])
def test_a_value_that_is_no_boolean_is_refused_naming_the_field(world: Any, value: Any) -> None:
    admin = world.client("admin")
    answer = refused(admin, "post", CLASSES, {"name": "new", "value": 5, "shrink_elastic": value})
    assert list(answer) == ["shrink_elastic"]
    world.batch.refresh_from_db()
    answer = refused(admin, "patch", f"{CLASSES}{world.batch.pk}/", {"shrink_elastic": value})
    assert list(answer) == ["shrink_elastic"]


def test_only_an_admin_changes_it(world: Any) -> None:
    before = database_state()
    answer = world.client("manager").patch(
        f"{CLASSES}{world.batch.pk}/", {"shrink_elastic": True}, format="json"
    )
    assert answer.status_code == 403
    assert database_state() == before


def test_the_snapshot_offers_a_running_elastic_job_its_sizes_where_its_class_resizes(
    world: Any,
) -> None:
    running = builders.running_job(
        world, world.nlp, ranks=8, ranks_min=2, rank_sizes=[2, 4, 8], attempt_fields={"ranks": 4}
    )
    fixed = builders.running_job(world, world.nlp, ranks=4, node="h100-node-1")
    snapshot, _, _ = read_snapshot()
    classes = {c.name: c for c in snapshot.priority_classes}
    assert classes[world.batch.name].shrink_elastic is False
    assert {w.id: w.sizes for w in snapshot.workloads}[wid(running.pk)] == ()

    world.batch.shrink_elastic = True
    world.batch.save(update_fields=["shrink_elastic"])
    # The workload built in the last snapshot is not reused once its class changed.
    snapshot, _, _ = read_snapshot()
    classes = {c.name: c for c in snapshot.priority_classes}
    assert classes[world.batch.name].shrink_elastic is True
    workloads = {w.id: w for w in snapshot.workloads}
    assert (workloads[wid(running.pk)].ranks, workloads[wid(running.pk)].sizes) == (4, (2, 4, 8))
    assert workloads[wid(fixed.pk)].sizes == ()
