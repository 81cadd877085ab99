"""The image allow-list as a hostile researcher tries it: a sub-team has no list
of its own (it inherits its parent's), a look-alike repository shares the
allowed one's first characters, a sub-team's own list would widen its parent's.
Each is refused at submission, with the reason, through the API (single and
batch) and the portal's job form, and nothing is queued.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from preemption.job_rules import image_admitted
from tests.conftest import database_state

VISION = "registry.example/vision"


@pytest.fixture(autouse=True)
def _allow_list(settings: Any) -> None:
    # Set on ml, the parent of vision and nlp; vision has no list of its own.
    settings.QM_K8S_IMAGE_ALLOWLIST = {"ml": (VISION,)}


def _job(image: str) -> dict[str, Any]:
    return {
        "team": "vision",
        "flavor": "h100-80gb",
        "ranks": 1,
        "gpus_per_rank": 1,
        "command": "true",
        "image": image,
    }


REFUSED = [
    "registry.example/vision-exfil/trainer:1",
    "registry.example/visionary:1",
    "registry.example/other/vision/trainer:1",
    "evil.example/registry.example/vision/trainer:1",
    "registry.example:5000/vision/trainer:1",
    "docker.io/library/python:3.11",
]
ADMITTED = [
    "registry.example/vision/trainer:1.4",
    "registry.example/vision/team/deep/trainer@sha256:" + "a" * 64,
    "registry.example/vision",
    "registry.example/vision:latest",
]


@pytest.mark.parametrize("image", REFUSED)
def test_an_image_outside_the_inherited_list_is_refused_at_submission(
    world: Any, image: str
) -> None:
    before = database_state()
    response = world.client("researcher").post("/api/v1/jobs/", _job(image), format="json")
    assert response.status_code == 400, response.content
    assert response.json() == {
        "image": [
            f"Image {image} is not allowed for the jobs of team ml and its sub-teams; "
            f"allowed are images under: {VISION}."
        ]
    }
    assert database_state() == before


@pytest.mark.parametrize("image", ADMITTED)
def test_an_image_under_the_list_is_queued(world: Any, image: str) -> None:
    response = world.client("researcher").post("/api/v1/jobs/", _job(image), format="json")
    assert response.status_code == 201, response.content


def test_a_batch_with_one_image_outside_the_list_queues_nothing(world: Any) -> None:
    before = database_state()
    jobs = [_job(ADMITTED[0]), _job(REFUSED[0]), _job(ADMITTED[0])]
    response = world.client("researcher").post("/api/v1/jobs/batch/", {"jobs": jobs}, format="json")
    assert response.status_code == 400, response.content
    errors = response.json()["jobs"]
    assert list(errors) == ["1"] and list(errors["1"]) == ["image"]
    assert "not allowed for the jobs of team ml" in errors["1"]["image"][0]
    assert database_state() == before


def test_a_sub_teams_own_list_cannot_widen_its_parents(world: Any, settings: Any) -> None:
    settings.QM_K8S_IMAGE_ALLOWLIST = {"ml": (VISION,), "vision": ("docker.io/attacker",)}
    before = database_state()
    response = world.client("researcher").post(
        "/api/v1/jobs/", _job("docker.io/attacker/miner:1"), format="json"
    )
    assert response.status_code == 400
    assert "not allowed for the jobs of team ml" in response.json()["image"][0]
    # Nor does it admit what its parent's admits but its own does not.
    narrowed = world.client("researcher").post("/api/v1/jobs/", _job(ADMITTED[0]), format="json")
    assert narrowed.status_code == 400
    assert "not allowed for the jobs of team vision" in narrowed.json()["image"][0]
    assert database_state() == before


def test_a_team_outside_every_list_may_run_any_image(world: Any) -> None:
    response = world.client("other_researcher").post(
        "/api/v1/jobs/", {**_job("docker.io/library/python:3.11"), "team": "ops"}, format="json"
    )
    assert response.status_code == 201, response.content


def test_the_portal_form_shows_the_refusal_under_the_image(world: Any) -> None:
    client = Client()
    client.force_login(world.users["researcher"])
    before = database_state()
    response = client.post(
        "/jobs/new/",
        {
            "team": "vision",
            "flavor": "h100-80gb",
            "ranks": "1",
            "gpus_per_rank": "1",
            "command": "true",
            "image": REFUSED[0],
            "retries": "0",
            "topology_required": "required",
        },
    )
    assert response.status_code == 400
    assert "is not allowed for the jobs of team ml" in response.content.decode()
    assert database_state() == before


@pytest.mark.parametrize(
    ("image", "prefix", "admitted"),
    [
        ("registry.example/vision/a:1", "registry.example/vision/", True),
        ("registry.example/vision-exfil/a:1", "registry.example/vision/", False),
        ("registry.example/vision-exfil/a:1", "registry.example/vision", False),
        ("registry.example/vision:1", "registry.example/vision", True),
        ("registry.example:5000/vision/a", "registry.example:5000", True),
        ("registry.example:5000/vision/a", "registry.example", False),
        ("anything/at/all", "/", False),
    ],
)
def test_prefixes_match_by_path_segment(image: str, prefix: str, admitted: bool) -> None:
    assert image_admitted(image, prefix) is admitted
