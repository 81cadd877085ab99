"""The engine's newer settings through the API: the cluster's scheduling policy (decayed
usage and the minimum runtime per preemption reason), a priority class's own minimums,
a node's topology and a job's topology. Each is read by everyone who may see it and
changed only by whom it belongs to; each bad value is a 400 naming the field and the
reason, and every refusal leaves the database as it was. A saved value reaches the
engine's input (`build_snapshot`)."""

from __future__ import annotations

from typing import Any

import pytest

from preemption.models import Job, JobState
from preemption.snapshot import build_snapshot
from quotas.models import AuditEntry, Node, SchedulingPolicy
from tests import builders
from tests.conftest import database_state

POLICY = "/api/v1/scheduling-policy/"
RACK_KEY = "topology.quartermaster.io/rack"
BLOCK_KEY = "topology.quartermaster.io/block"


@pytest.fixture(autouse=True)
def _settings(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.QM_TOPOLOGY_LABELS = {"block": BLOCK_KEY, "rack": RACK_KEY}
    settings.QM_USAGE_STRENGTH = 0.0
    settings.QM_USAGE_HALF_LIFE_SECONDS = 7 * 86_400.0
    settings.QM_FAIR_SHARE_MIN_RUNTIME_SECONDS = 60.0
    settings.QM_CONSOLIDATION_MIN_RUNTIME_SECONDS = 600.0


def refused(
    client: Any, method: str, path: str, body: Any = None, status: int = 400
) -> dict[str, Any]:
    """Make a call that must be refused, check nothing changed, return the answer."""
    before = database_state()
    response = getattr(client, method)(path, body, format="json")
    assert response.status_code == status, (response.status_code, response.content[:500])
    assert database_state() == before, "a refused call changed the database"
    return response.json()


# --- the cluster's scheduling policy ------------------------------------------------


@pytest.mark.parametrize("persona", ["researcher", "manager", "other_researcher", "admin"])
def test_everyone_signed_in_reads_the_policy_the_deployment_set(world: Any, persona: str) -> None:
    response = world.client(persona).get(POLICY)
    assert response.status_code == 200
    assert response.json() == {
        "usage_strength": 0.0,
        "usage_half_life_seconds": 604800.0,
        "priority_min_runtime_seconds": 0,
        "fair_share_min_runtime_seconds": 60,
        "reclaim_min_runtime_seconds": 0,
        "consolidation_min_runtime_seconds": 600,
        "topology_levels": {"block": BLOCK_KEY, "rack": RACK_KEY},
    }


def test_anonymous_reads_nothing(world: Any) -> None:
    assert world.client("anonymous").get(POLICY).status_code == 401


def test_an_admin_changes_the_policy_and_the_engine_reads_it(world: Any) -> None:
    response = world.client("admin").patch(
        POLICY,
        {
            "usage_strength": 1.5,
            "usage_half_life_seconds": 3600,
            "reclaim_min_runtime_seconds": 900,
        },
        format="json",
    )
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["usage_strength"] == 1.5
    assert body["usage_half_life_seconds"] == 3600.0
    assert body["reclaim_min_runtime_seconds"] == 900
    # Fields left out keep the deployment's values, now saved with the change.
    assert body["consolidation_min_runtime_seconds"] == 600
    snapshot = build_snapshot()
    assert snapshot.usage_strength == 1.5
    assert snapshot.usage_half_life_seconds == 3600.0
    assert snapshot.reclaim_min_runtime_seconds == 900.0
    assert snapshot.fair_share_min_runtime_seconds == 60.0
    entry = AuditEntry.objects.get(action="scheduling_policy.update")
    assert entry.actor == world.users["admin"]
    assert entry.before is not None and entry.before["usage_strength"] == 0.0
    assert entry.after is not None and entry.after["usage_strength"] == 1.5


@pytest.mark.parametrize("persona", ["manager", "other_manager", "researcher"])
def test_nobody_but_an_admin_changes_a_cluster_wide_setting(world: Any, persona: str) -> None:
    body = refused(world.client(persona), "patch", POLICY, {"usage_strength": 2}, status=403)
    assert body["detail"] == "Only platform admins may change this."
    assert not SchedulingPolicy.objects.exists()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("usage_strength", -1, "Must be a number from 0 (weight alone) to 10 (got -1.0)."),
        ("usage_strength", 11, "Must be a number from 0 (weight alone) to 10 (got 11.0)."),
        ("usage_strength", "strong", "A valid number is required."),
        ("usage_strength", "nan", "A valid number is required."),
        (
            "usage_half_life_seconds",
            0,
            "Must be from 60 seconds to 3.1536e+07 (a year) (got 0.0).",
        ),
        (
            "usage_half_life_seconds",
            10**9,
            "Must be from 60 seconds to 3.1536e+07 (a year) (got 1000000000.0).",
        ),
        (
            "reclaim_min_runtime_seconds",
            -5,
            "Must be a whole number of seconds from 0 to 604800 (got -5).",
        ),
        (
            "consolidation_min_runtime_seconds",
            10**7,
            "Must be a whole number of seconds from 0 to 604800 (got 10000000).",
        ),
        ("fair_share_min_runtime_seconds", 1.5, "A valid integer is required."),
        ("priority_min_runtime_seconds", None, "This field may not be null."),
        ("half_life", 3600, "Not a setting of the scheduling policy."),
        (
            "topology_levels",
            {"rack": "x"},
            "Set by the deployment (QM_TOPOLOGY_LABELS), not through the API.",
        ),
    ],
)
def test_a_bad_policy_value_is_refused_naming_the_field(
    world: Any, field: str, value: Any, message: str
) -> None:
    body = refused(world.client("admin"), "patch", POLICY, {field: value})
    assert body == {field: [message]}


def test_one_bad_value_refuses_the_whole_change(world: Any) -> None:
    body = refused(
        world.client("admin"),
        "patch",
        POLICY,
        {"usage_strength": 1, "reclaim_min_runtime_seconds": -1},
    )
    assert list(body) == ["reclaim_min_runtime_seconds"]
    assert build_snapshot().usage_strength == 0.0


# --- a priority class's own minimum runtime per reason ---------------------------------


def test_an_admin_sets_a_class_minimum_per_reason_and_the_engine_reads_it(world: Any) -> None:
    path = f"/api/v1/priority-classes/{world.batch.pk}/"
    response = world.client("admin").patch(
        path, {"reclaim_min_runtime_seconds": 900, "fair_share_min_runtime_seconds": 120}, "json"
    )
    assert response.status_code == 200, response.content
    assert response.json()["reclaim_min_runtime_seconds"] == 900
    assert response.json()["priority_min_runtime_seconds"] is None
    read = world.client("researcher").get(path).json()
    assert read["fair_share_min_runtime_seconds"] == 120
    classes = {pc.name: pc for pc in build_snapshot().priority_classes}
    assert dict(classes[world.batch.name].min_runtime_by_reason) == {
        "reclaim": 900.0,
        "fair-share": 120.0,
    }
    # Null gives the reason back to the scheduling policy.
    response = world.client("admin").patch(path, {"reclaim_min_runtime_seconds": None}, "json")
    assert response.json()["reclaim_min_runtime_seconds"] is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1, "Ensure this value is greater than or equal to 0."),
        (604801, "Ensure this value is less than or equal to 604800."),
        ("soon", "A valid integer is required."),
    ],
)
def test_a_bad_class_minimum_is_refused(world: Any, value: Any, message: str) -> None:
    body = refused(
        world.client("admin"),
        "patch",
        f"/api/v1/priority-classes/{world.batch.pk}/",
        {"consolidation_min_runtime_seconds": value},
    )
    assert body == {"consolidation_min_runtime_seconds": [message]}


@pytest.mark.parametrize("persona", ["manager", "researcher"])
def test_a_class_minimum_is_the_admins_alone(world: Any, persona: str) -> None:
    refused(
        world.client(persona),
        "patch",
        f"/api/v1/priority-classes/{world.batch.pk}/",
        {"reclaim_min_runtime_seconds": 0},
        status=403,
    )


# --- a node's topology -------------------------------------------------------------------


def test_an_admin_sets_a_nodes_topology_and_the_engine_reads_it(world: Any) -> None:
    node = Node.objects.get(name="h100-node-0")
    path = f"/api/v1/nodes/{node.pk}/"
    response = world.client("admin").patch(
        path, {"topology": {"block": "b0", "rack": "r1"}}, format="json"
    )
    assert response.status_code == 200, response.content
    assert response.json()["topology"] == {"block": "b0", "rack": "r1"}
    node.refresh_from_db()
    assert node.labels == {BLOCK_KEY: "b0", RACK_KEY: "r1"}
    topology = {n.name: dict(n.topology) for n in build_snapshot().nodes}
    assert topology["h100-node-0"] == {"block": "b0", "rack": "r1"}
    # Null removes one level; the others stay.
    response = world.client("admin").patch(path, {"topology": {"rack": None}}, format="json")
    assert response.json()["topology"] == {"block": "b0"}
    assert world.client("researcher").get(path).json()["topology"] == {"block": "b0"}
    entry = AuditEntry.objects.filter(action="node.upsert").order_by("-id").first()
    assert entry is not None and entry.after is not None
    assert entry.after["topology"] == {"block": "b0"}


@pytest.mark.parametrize(
    ("topology", "message"),
    [
        ({"row": "x1"}, "Unknown topology level 'row'; the levels are: block, rack."),
        (
            {"rack": "r 1"},
            "The rack domain 'r 1' is not a label value: up to 63 letters, digits, '-', '_' "
            "or '.', starting and ending with a letter or digit.",
        ),
    ],
)
def test_a_bad_topology_is_refused(world: Any, topology: Any, message: str) -> None:
    node = Node.objects.get(name="h100-node-1")
    body = refused(
        world.client("admin"), "patch", f"/api/v1/nodes/{node.pk}/", {"topology": topology}
    )
    assert body == {"topology": [message]}


def test_only_an_admin_sets_a_nodes_topology(world: Any) -> None:
    node = Node.objects.get(name="h100-node-1")
    refused(
        world.client("manager"),
        "patch",
        f"/api/v1/nodes/{node.pk}/",
        {"topology": {"rack": "r1"}},
        status=403,
    )


# --- a job's topology --------------------------------------------------------------------


def submission(**fields: Any) -> dict[str, Any]:
    return {
        "team": "vision",
        "flavor": "h100-80gb",
        "ranks": 2,
        "gpus_per_rank": 4,
        "command": "sleep 60",
        **fields,
    }


def test_a_researcher_submits_a_gang_that_needs_one_rack(world: Any) -> None:
    response = world.client("researcher").post(
        "/api/v1/jobs/", submission(topology_level="rack"), format="json"
    )
    assert response.status_code == 201, response.content
    assert response.json()["topology_level"] == "rack"
    assert response.json()["topology_required"] is True
    job = Job.objects.get(pk=response.json()["id"])
    gang = next(w for w in build_snapshot().workloads if w.id == str(job.pk))
    assert gang.topology_level == "rack" and gang.topology_required


def test_a_preferred_rack_is_stored_as_a_preference(world: Any) -> None:
    response = world.client("researcher").post(
        "/api/v1/jobs/",
        submission(topology_level="block", topology_required=False),
        format="json",
    )
    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    assert (job.topology_level, job.topology_required) == ("block", False)


@pytest.mark.parametrize(
    ("fields", "errors"),
    [
        (
            {"topology_level": "row"},
            {
                "topology_level": [
                    "Unknown topology level 'row'; this cluster's levels are: block, rack."
                ]
            },
        ),
        ({"topology_required": "maybe"}, {"topology_required": ["Must be a valid boolean."]}),
    ],
)
def test_a_bad_job_topology_is_refused(world: Any, fields: Any, errors: Any) -> None:
    body = refused(world.client("researcher"), "post", "/api/v1/jobs/", submission(**fields))
    assert body == errors


def test_a_researcher_cannot_submit_into_another_teams_queue_with_a_topology(world: Any) -> None:
    body = refused(
        world.client("other_researcher"),
        "post",
        "/api/v1/jobs/",
        submission(topology_level="rack"),
        status=403,
    )
    assert body["detail"] == "You may not submit jobs to team vision."


def test_the_submitter_changes_a_waiting_jobs_topology(world: Any) -> None:
    job = builders.job(world, world.vision, state=JobState.PENDING, ranks=2, gpus_per_rank=4)
    response = world.client("researcher").post(
        f"/api/v1/jobs/{job.pk}/topology/",
        {"topology_level": "rack", "topology_required": False},
        format="json",
    )
    assert response.status_code == 200, response.content
    job.refresh_from_db()
    assert (job.topology_level, job.topology_required) == ("rack", False)


@pytest.mark.parametrize("persona", ["other_researcher", "other_manager"])
def test_another_team_cannot_set_a_jobs_topology(world: Any, persona: str) -> None:
    job = builders.job(world, world.vision, state=JobState.PENDING, ranks=2, gpus_per_rank=4)
    # The job is not theirs to see, so it is not there for them.
    refused(
        world.client(persona),
        "post",
        f"/api/v1/jobs/{job.pk}/topology/",
        {"topology_level": "rack"},
        status=404,
    )


def test_a_teammate_who_did_not_submit_cannot_set_a_jobs_topology(world: Any) -> None:
    job = builders.job(
        world,
        world.vision,
        state=JobState.PENDING,
        submitter=world.users["manager"],
    )
    body = refused(
        world.client("researcher"),
        "post",
        f"/api/v1/jobs/{job.pk}/topology/",
        {"topology_level": "rack"},
        status=403,
    )
    assert "Only the submitter" in body["detail"]


def test_a_running_jobs_topology_cannot_change(world: Any) -> None:
    job = builders.job(world, world.vision, state=JobState.RUNNING)
    body = refused(
        world.client("researcher"),
        "post",
        f"/api/v1/jobs/{job.pk}/topology/",
        {"topology_level": "rack"},
    )
    assert body == {
        "state": [f"Job {job.pk} is running; only a waiting job's topology may change."]
    }
