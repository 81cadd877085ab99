"""Each validation rule through the API, with its exact message, and bad input
of every kind: wrong types, missing fields, unknown ids, absurd numbers. A
refused change leaves the database as it was."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from preemption.models import Job
from tests import builders
from tests.conftest import database_state


@pytest.fixture(autouse=True)
def _fast_passwords(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def refused(
    client: Any, method: str, path: str, body: Any = None, status: int = 400
) -> dict[str, Any]:
    """Make a call that must be refused, check nothing changed, return the answer."""
    before = database_state()
    response = getattr(client, method)(path, body, format="json")
    assert response.status_code == status, (response.status_code, response.content[:500])
    assert database_state() == before, "a refused call changed the database"
    return response.json()


def running_job(
    world: Any, team: Any, *, critical: bool, ranks: int, gpus_per_rank: int, name: str
) -> Job:
    now = timezone.now()
    return builders.running_job(
        world,
        team,
        name=name,
        priority_class=world.critical if critical else world.batch,
        ranks=ranks,
        gpus_per_rank=gpus_per_rank,
        admitted_at=now,
        running_at=now,
    )


# --- the quota rules, each with its message ------------------------------------------


# vision's guarantee may be 0 to 8: ml has 16 and nlp holds 8.
VISION_GUARANTEE = (
    "Must be a whole number from 0 to 8: ml has 16 GPUs of h100-80gb and its other "
    "sub-teams hold 8 (got {})."
)
LIMIT = "Must be a whole number from 0 to 1000000, or empty ({}) (got {})."


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("guarantee", -1, VISION_GUARANTEE.format(-1)),
        ("borrow_limit", -3, LIMIT.format("no limit", -3)),
        ("lend_limit", -2, LIMIT.format("lend all", -2)),
        ("guarantee", 10_000_000, VISION_GUARANTEE.format(10000000)),
        ("borrow_limit", 2_000_000, LIMIT.format("no limit", 2000000)),
        ("guarantee", "eight", VISION_GUARANTEE.format("eight")),
        ("guarantee", 2.5, VISION_GUARANTEE.format(2.5)),
        ("guarantee", None, VISION_GUARANTEE.format("nothing")),
    ],
)
def test_quota_numbers_are_checked(world: Any, field: str, value: Any, message: str) -> None:
    admin = world.client("admin")
    body = refused(
        admin, "patch", f"/api/v1/quotas/{world.quota(world.vision).pk}/", {field: value}
    )
    assert body == {field: [message]}


def test_children_guarantees_cannot_sum_above_the_parent(world: Any) -> None:
    body = refused(
        world.client("manager"),
        "patch",
        f"/api/v1/quotas/{world.quota(world.vision).pk}/",
        {"guarantee": 9},
    )
    assert body == {"guarantee": [VISION_GUARANTEE.format(9)]}


def test_a_parent_cannot_go_below_its_childrens_guarantees(world: Any) -> None:
    body = refused(
        world.client("admin"),
        "patch",
        f"/api/v1/quotas/{world.quota(world.ml).pk}/",
        {"guarantee": 15},
    )
    assert body == {
        "guarantee": [
            "Must be exactly 16: the sub-teams of ml are guaranteed 16 GPUs of h100-80gb; "
            "org has 16 GPUs of h100-80gb and its other sub-teams hold 0 (got 15)."
        ]
    }


def test_top_level_guarantees_cannot_exceed_the_cluster(world: Any) -> None:
    body = refused(
        world.client("admin"),
        "patch",
        f"/api/v1/quotas/{world.quota(world.org).pk}/",
        {"guarantee": 17},
    )
    assert body == {
        "guarantee": [
            "Must be exactly 16: the sub-teams of org are guaranteed 16 GPUs of h100-80gb; "
            "the cluster has 24 GPUs of h100-80gb and the other top-level teams hold 8 (got 17)."
        ]
    }
    # A new top-level quota of a flavor counts against that flavor's nodes only.
    body = refused(
        world.client("admin"),
        "post",
        "/api/v1/quotas/",
        {"team": "org", "flavor": "a100-40gb", "guarantee": 9},
    )
    assert body == {
        "guarantee": [
            "Must be a whole number from 0 to 8: the cluster has 8 GPUs of a100-40gb and the "
            "other top-level teams hold 0 (got 9)."
        ]
    }


def test_a_guarantee_cannot_go_below_running_non_preemptible_gpus(world: Any) -> None:
    job = running_job(world, world.vision, critical=True, ranks=2, gpus_per_rank=3, name="serve")
    running_job(world, world.vision, critical=False, ranks=1, gpus_per_rank=2, name="batch")
    body = refused(
        world.client("manager"),
        "patch",
        f"/api/v1/quotas/{world.quota(world.vision).pk}/",
        {"guarantee": 5},
    )
    assert body == {
        "guarantee": [
            f"Must be a whole number from 6 to 8: vision runs 6 GPUs of h100-80gb in "
            f"non-preemptible jobs (job {job.pk} (serve)); ml has 16 GPUs of h100-80gb and its "
            "other sub-teams hold 8 (got 5)."
        ]
    }
    # The preview refuses it with the very same message.
    preview = refused(
        world.client("manager"),
        "post",
        f"/api/v1/quotas/{world.quota(world.vision).pk}/preview/",
        {"guarantee": 5},
    )
    assert preview == body
    # 6 is allowed: the preemptible job may be reclaimed, the critical one may not.
    response = world.client("manager").patch(
        f"/api/v1/quotas/{world.quota(world.vision).pk}/", {"guarantee": 6}, format="json"
    )
    assert response.status_code == 200 and response.json()["guarantee"] == 6


def test_the_preview_shows_the_floor_and_the_waiting_work_a_cut_would_strand(world: Any) -> None:
    serve = running_job(world, world.vision, critical=True, ranks=2, gpus_per_rank=3, name="serve")
    running_job(world, world.vision, critical=False, ranks=1, gpus_per_rank=2, name="batch")
    waiting = Job.objects.create(
        name="big-serve",
        team=world.vision,
        submitter=world.users["researcher"],
        priority_class=world.critical,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=8,
        command="sleep 60",
    )
    url = f"/api/v1/quotas/{world.quota(world.vision).pk}/preview/"
    before = database_state()
    cut = world.client("manager").post(url, {"guarantee": 6}, format="json")
    assert cut.status_code == 200, cut.json()
    assert cut.json()["non_preemptible"] == {
        "running": [
            {
                "job_id": serve.pk,
                "job_name": "serve",
                "team": "vision",
                "gpus": 6,
                "priority_class": "ai-prod-critical",
            }
        ],
        "floor": 6,
        "stranded": [
            {
                "job_id": waiting.pk,
                "job_name": "big-serve",
                "team": "vision",
                "gpus": 8,
                "priority_class": "ai-prod-critical",
                "why": "ai-prod-critical is never preempted, so it runs only inside vision's "
                "guarantee: it needs 8 GPUs of h100-80gb, the guarantee would be 6.",
            }
        ],
    }
    # The same work seen from the parent: running jobs below it count, and the
    # waiting one is vision's to strand, not ml's.
    above = world.client("admin").post(
        f"/api/v1/quotas/{world.quota(world.ml).pk}/preview/", {"guarantee": 16}, format="json"
    )
    assert above.json()["non_preemptible"]["floor"] == 6
    assert above.json()["non_preemptible"]["stranded"] == []
    keep = world.client("manager").post(url, {"guarantee": 8}, format="json")
    assert keep.json()["non_preemptible"]["stranded"] == []
    assert database_state() == before


def test_a_team_cannot_move_under_its_own_subtree(world: Any) -> None:
    body = refused(
        world.client("admin"), "patch", f"/api/v1/teams/{world.ml.pk}/", {"parent": "vision"}
    )
    assert body == {"parent": ["Moving ml under vision would make a cycle in the team tree."]}
    body = refused(
        world.client("admin"), "patch", f"/api/v1/teams/{world.ml.pk}/", {"parent": "ml"}
    )
    assert body == {"parent": ["Moving ml under ml would make a cycle in the team tree."]}


def test_a_team_with_running_jobs_cannot_be_deleted(world: Any) -> None:
    job = running_job(world, world.vision, critical=False, ranks=1, gpus_per_rank=1, name="train")
    body = refused(world.client("admin"), "delete", f"/api/v1/teams/{world.vision.pk}/")
    assert body == {"team": [f"Team vision has unfinished jobs (job {job.pk}); cancel them first."]}
    body = refused(world.client("admin"), "delete", f"/api/v1/teams/{world.ml.pk}/")
    assert body == {"team": [f"Team ml has unfinished jobs (job {job.pk}); cancel them first."]}


def test_a_job_cannot_ask_more_gpus_per_rank_than_any_node_has(world: Any) -> None:
    job = {
        "team": "vision",
        "flavor": "h100-80gb",
        "ranks": 2,
        "gpus_per_rank": 16,
        "command": "python train.py",
    }
    body = refused(world.client("researcher"), "post", "/api/v1/jobs/", job)
    assert body == {"gpus_per_rank": ["Each rank needs 16 GPUs; the largest h100-80gb node has 8."]}


@pytest.mark.parametrize(
    ("change", "errors"),
    [
        ({"ranks": 0}, {"ranks": ["Must be a whole number from 1 to 4096 (got 0)."]}),
        (
            {"ranks": 10**12},
            {"ranks": ["Must be a whole number from 1 to 4096 (got 1000000000000)."]},
        ),
        (
            {"gpus_per_rank": 0},
            {"gpus_per_rank": ["Must be a whole number of at least 1 (got 0)."]},
        ),
        ({"ranks": "two"}, {"ranks": ["A valid integer is required."]}),
        ({"command": "   "}, {"command": ["A command is required."]}),
        # Flavors are cluster-wide, so the refusal lists the valid ones; team
        # names are never listed to another tenant (a missing team is refused as a
        # hidden one is: tests/security/test_security_names.py).
        (
            {"flavor": "tpu"},
            {"flavor": ["There is no 'tpu'; the valid choices are: a100-40gb, h100-80gb."]},
        ),
        (
            {"priority_class": "urgent"},
            {"priority_class": ["Object with name=urgent does not exist."]},
        ),
        ({"env": {"A": {"B": "C"}}}, {"env": {"A": ["Not a valid string."]}}),
        ({"env": ["A=1"]}, {"env": ['Expected a dictionary of items but got type "list".']}),
        (
            {"max_attempts": 0},
            {"max_attempts": ["Ensure this value is greater than or equal to 1."]},
        ),
    ],
)
def test_bad_job_submissions_name_the_field(
    world: Any, change: dict[str, Any], errors: dict[str, Any]
) -> None:
    job = {
        "team": "vision",
        "flavor": "h100-80gb",
        "ranks": 2,
        "gpus_per_rank": 4,
        "command": "python train.py",
    }
    assert refused(world.client("researcher"), "post", "/api/v1/jobs/", {**job, **change}) == errors


def test_jobs_go_to_leaf_teams(world: Any) -> None:
    job = {"team": "ml", "flavor": "h100-80gb", "ranks": 1, "gpus_per_rank": 1, "command": "true"}
    # The manager of ml may submit below ml, but ml itself has sub-teams.
    assert refused(world.client("manager"), "post", "/api/v1/jobs/", job) == {
        "team": ["Team ml has sub-teams; jobs are submitted to leaf teams."]
    }


def test_missing_fields_are_each_named(world: Any) -> None:
    required = ["This field is required."]
    assert refused(world.client("researcher"), "post", "/api/v1/jobs/", {}) == {
        "team": required,
        "flavor": required,
        "ranks": required,
        "gpus_per_rank": required,
        "command": required,
    }
    assert refused(world.client("admin"), "post", "/api/v1/quotas/", {"team": "nlp"}) == {
        "flavor": required,
        "guarantee": required,
    }
    assert refused(world.client("admin"), "post", "/api/v1/teams/", {}) == {"slug": required}
    assert refused(world.client("admin"), "post", "/api/v1/priority-classes/", {"name": "x"}) == {
        "value": required
    }


def test_a_body_that_is_not_an_object_or_not_json(world: Any) -> None:
    client = world.client("researcher")
    body = refused(client, "post", "/api/v1/jobs/", ["vision"])
    assert body == {"non_field_errors": ["Invalid data. Expected a dictionary, but got list."]}
    before = database_state()
    response = client.post("/api/v1/jobs/", "{not json", content_type="application/json")
    assert response.status_code == 400 and "JSON parse error" in response.json()["detail"]
    assert database_state() == before


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/api/v1/jobs/999999/"),
        ("post", "/api/v1/jobs/999999/cancel/"),
        ("get", "/api/v1/jobs/999999/logs/"),
        ("patch", "/api/v1/quotas/999999/"),
        ("post", "/api/v1/quotas/999999/preview/"),
        ("delete", "/api/v1/teams/999999/"),
        ("get", "/api/v1/nodes/99999999999999999999999999/"),
        ("get", "/api/v1/jobs/twelve/"),
        ("get", "/api/v1/no-such-collection/"),
    ],
)
def test_unknown_ids_answer_404_in_json(world: Any, method: str, path: str) -> None:
    body = refused(world.client("admin"), method, path, {}, status=404)
    assert body["detail"]


@pytest.mark.parametrize(
    ("query", "errors"),
    [
        (
            "state=sleeping",
            {"state": ["Select a valid choice. sleeping is not one of the available choices."]},
        ),
        ("since=yesterday", {"since": ["Enter a valid date/time."]}),
        ("until=2026-13-01T00:00:00Z", {"until": ["Enter a valid date/time."]}),
    ],
)
def test_bad_job_filters_name_the_field(world: Any, query: str, errors: dict[str, Any]) -> None:
    assert refused(world.client("admin"), "get", f"/api/v1/jobs/?{query}") == errors


def test_bad_id_filters_and_pages(world: Any) -> None:
    admin = world.client("admin")
    assert refused(admin, "get", "/api/v1/attempts/?job=1e40") == {"job": ["Enter a whole number."]}
    assert refused(admin, "get", "/api/v1/ranks/?job=-1") == {
        "job": ["Ensure this value is greater than or equal to 1."]
    }
    # An absurd page size is capped, an absurd offset is simply past the end.
    page = admin.get(
        "/api/v1/teams/?limit=100000000000000000000&offset=99999999999999999999"
    ).json()
    assert page["results"] == [] and page["count"] == 6


def test_bad_log_queries_name_the_field(world: Any) -> None:
    job = running_job(world, world.vision, critical=False, ranks=2, gpus_per_rank=1, name="train")
    admin = world.client("admin")
    assert refused(admin, "get", f"/api/v1/jobs/{job.pk}/logs/?rank=-1") == {
        "rank": ["Ensure this value is greater than or equal to 0."]
    }
    assert refused(admin, "get", f"/api/v1/jobs/{job.pk}/logs/?offset=1e99") == {
        "offset": ["A valid integer is required."]
    }
    assert refused(admin, "get", f"/api/v1/jobs/{job.pk}/logs/?rank=2", status=404) == {
        "rank": [f"Job {job.pk} has ranks 0 to 1 (got 2)."]
    }
    assert refused(admin, "get", f"/api/v1/jobs/{job.pk}/logs/?attempt=7", status=404) == {
        "attempt": [f"Job {job.pk} has no attempt 7."]
    }


def test_weights_and_priority_classes_are_bounded(world: Any) -> None:
    admin = world.client("admin")
    weight = "Must be a number from 0.001 to 1000000 (got {})."
    assert refused(admin, "patch", f"/api/v1/teams/{world.vision.pk}/", {"weight": 0}) == {
        "weight": [weight.format(0)]
    }
    assert refused(admin, "patch", f"/api/v1/teams/{world.vision.pk}/", {"weight": 1e300}) == {
        "weight": [weight.format("1e+300")]
    }
    preview = f"/api/v1/quotas/{world.quota(world.vision).pk}/preview/"
    assert refused(admin, "post", preview, {"weight": 1e300}) == {
        "weight": [weight.format("1e+300")]
    }
    body = refused(admin, "post", "/api/v1/priority-classes/", {"name": "huge", "value": 10**10})
    assert body == {"value": ["Ensure this value is less than or equal to 1000000000."]}
    body = refused(
        admin, "post", "/api/v1/priority-classes/", {"name": "ai-prod-critical", "value": 5}
    )
    assert body == {"name": ["A priority class named 'ai-prod-critical' already exists."]}
    body = refused(
        admin,
        "post",
        "/api/v1/priority-classes/",
        {"name": "x", "value": 5, "preemption_policy": "Always"},
    )
    assert body == {"preemption_policy": ['"Always" is not a valid choice.']}
    running_job(world, world.vision, critical=False, ranks=1, gpus_per_rank=1, name="train")
    body = refused(admin, "delete", f"/api/v1/priority-classes/{world.batch.pk}/")
    assert body == {
        "priority_class": ["ai-batch-preemptible is used by jobs and cannot be deleted."]
    }
