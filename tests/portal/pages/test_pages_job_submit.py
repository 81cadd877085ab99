"""The job submission page, from every persona: who is offered which teams, who
is sent to sign in, a researcher's job queued and shown, a forged team refused
with nothing queued, each bad input refused with the API's own words, the
team's default priority class chosen, and "Submit again" filled in from a job
the user can see (404 for one they cannot)."""

from __future__ import annotations

import copy
import html
import json
import re
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.messages import get_messages
from django.urls import reverse

from preemption.models import Job
from tests.conftest import PERSONAS, World, database_state
from tests.portal.pages.conftest import page_client

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(db: None, module_world: World) -> World:
    # Built once for the module's many tests; each gets its own copy of the instances.
    return copy.deepcopy(module_world)


SUBMIT = reverse("job-submit")

# persona -> the teams the form offers (leaf teams the persona may submit to)
OFFERED = {
    "admin": ["nlp", "ops", "vision"],
    "manager": ["nlp", "vision"],
    "other_manager": ["ops"],
    "researcher": ["vision"],
    "other_researcher": ["ops"],
}


def form_post(world: Any, **fields: Any) -> dict[str, Any]:
    """A complete, valid form for vision; `fields` replace or add to it."""
    post = {
        "team": "vision",
        "name": "resnet",
        "flavor": world.h100.name,
        "ranks": "2",
        "gpus_per_rank": "4",
        "priority_class": "",
        "image": "registry.example.org/vision/trainer:1.4",
        "command": "python train.py --epochs 3",
        "env": "BATCH=64\nLR=0.1",
        "retries": "2",
        "topology_level": "rack",
        "topology_required": "preferred",
    }
    post.update(fields)
    return post


def options(body: str, name: str) -> list[str]:
    select = re.search(rf'<select name="{name}".*?</select>', body, re.S)
    assert select is not None, f"no select {name}"
    return re.findall(r'<option value="([^"]*)"', select.group(0))


def chosen(body: str, name: str) -> str | None:
    select = re.search(rf'<select name="{name}".*?</select>', body, re.S)
    assert select is not None, f"no select {name}"
    found = re.search(r'<option value="([^"]*)" selected>', select.group(0))
    return found.group(1) if found else None


def field_errors(body: str, field: str) -> list[str]:
    return [
        html.unescape(message)
        for message in re.findall(rf'data-error-for="{field}">(.*?)</p>', body, re.S)
    ]


@pytest.mark.parametrize("persona", PERSONAS)
def test_the_form_offers_exactly_the_teams_the_persona_may_submit_to(
    world: Any, persona: str
) -> None:
    response = page_client(world, persona).get(SUBMIT)
    if persona == "anonymous":
        assert response.status_code == 302
        assert response["Location"].startswith(reverse("login"))
        return
    assert response.status_code == 200
    body = response.content.decode()
    assert options(body, "team") == OFFERED[persona]
    # Every flavor is offered, and the topology's levels with "anywhere" first.
    assert options(body, "flavor") == sorted([world.a100.name, world.h100.name])
    assert options(body, "topology_level") == ["", "block", "rack"]
    # The nav and the job list link to the form for anyone who may submit.
    assert f'href="{SUBMIT}"' in body
    jobs = page_client(world, persona).get(reverse("job-list")).content.decode()
    assert 'id="submit-job-link"' in jobs


def test_a_user_in_no_team_is_offered_no_team_and_no_link(world: Any) -> None:
    loner = get_user_model().objects.create_user("loner", "loner@example.org", "pw")
    client = page_client(world, "anonymous")
    client.force_login(loner)
    body = client.get(SUBMIT).content.decode()
    assert options(body, "team") == []
    assert "You may not submit jobs to any team" in body
    jobs = client.get(reverse("job-list")).content.decode()
    assert 'id="submit-job-link"' not in jobs and f'href="{SUBMIT}"' not in jobs


def test_a_researcher_submits_to_their_team_and_lands_on_the_job_page(world: Any) -> None:
    client = page_client(world, "researcher")
    before = Job.objects.count()
    response = client.post(SUBMIT, form_post(world))
    assert Job.objects.count() == before + 1
    job = Job.objects.latest("pk")
    assert response.status_code == 302
    assert response["Location"] == reverse("job-detail", args=[job.pk])
    assert job.team == world.vision and job.submitter == world.users["researcher"]
    assert (job.name, job.flavor, job.ranks, job.gpus_per_rank) == ("resnet", world.h100, 2, 4)
    # Left empty, the class is the team's default, as the API gives it.
    assert job.priority_class == world.batch
    assert job.image == "registry.example.org/vision/trainer:1.4"
    assert job.command == "python train.py --epochs 3"
    assert job.env == {"BATCH": "64", "LR": "0.1"}
    assert (job.retries, job.topology_level, job.topology_required) == (2, "rack", False)
    assert job.state == "pending"
    assert [str(m) for m in get_messages(response.wsgi_request)] == [f"Queued job #{job.pk}."]


@pytest.mark.parametrize(
    ("persona", "team"),
    [("other_researcher", "vision"), ("researcher", "ops"), ("other_manager", "nlp")],
)
def test_a_forged_post_to_a_team_the_persona_is_not_in_is_refused(
    world: Any, persona: str, team: str
) -> None:
    client = page_client(world, persona)
    before = database_state()
    response = client.post(SUBMIT, form_post(world, team=team))
    assert response.status_code == 403
    assert field_errors(response.content.decode(), "team") == [
        f"You may not submit jobs to team {team}."
    ]
    assert database_state() == before


def test_anonymous_post_is_sent_to_sign_in_and_queues_nothing(world: Any) -> None:
    before = database_state()
    response = page_client(world, "anonymous").post(SUBMIT, form_post(world))
    assert response.status_code == 302 and response["Location"].startswith(reverse("login"))
    assert database_state() == before


# Each bad input, as the form takes it and as the API takes it: the form must show
# the API's own reasons under the field, word for word, and queue nothing.
BAD_INPUTS = [
    # (case, form fields, API body changes, field)
    ("ranks zero", {"ranks": "0"}, {"ranks": 0}, "ranks"),
    ("ranks not a number", {"ranks": "two"}, {"ranks": "two"}, "ranks"),
    ("ranks missing", {"ranks": ""}, {"ranks": None}, "ranks"),
    (
        "elastic min above max",
        {"ranks": "9:8", "topology_level": ""},
        {"ranks": {"min": 9, "max": 8}, "topology_level": ""},
        "ranks",
    ),
    (
        "elastic size outside the range",
        {"ranks": "2,4,30", "topology_level": ""},
        {"ranks": {"sizes": [2, 4, 30]}, "topology_level": ""},
        "ranks",
    ),
    (
        "elastic min not a number",
        {"ranks": "a:8", "topology_level": ""},
        {"ranks": {"min": "a", "max": 8}, "topology_level": ""},
        "ranks",
    ),
    (
        "elastic with a topology",
        {"ranks": "2:8"},
        {"ranks": {"min": 2, "max": 8}},
        "topology_level",
    ),
    ("rank larger than a node", {"gpus_per_rank": "9"}, {"gpus_per_rank": 9}, "gpus_per_rank"),
    (
        "more GPUs than the cluster",
        {"ranks": "4", "gpus_per_rank": "8"},
        {"ranks": 4, "gpus_per_rank": 8},
        "ranks",
    ),
    ("unknown flavor", {"flavor": "tpu-v5"}, {"flavor": "tpu-v5"}, "flavor"),
    # An unknown team is refused as another tenant's is (403, below, and
    # tests/security/test_security_names.py), so no answer tells which teams exist.
    ("inner team", {"team": "ml"}, {"team": "ml"}, "team"),
    ("blank command", {"command": "   "}, {"command": "   "}, "command"),
    ("no command", {"command": ""}, {"command": None}, "command"),
    ("bad image", {"image": "Not An Image!"}, {"image": "Not An Image!"}, "image"),
    ("reserved env name", {"env": "QM_JOB_ID=7"}, {"env": {"QM_JOB_ID": "7"}}, "env"),
    ("env name not portable", {"env": "1BAD=x"}, {"env": {"1BAD": "x"}}, "env"),
    ("too many retries", {"retries": "21"}, {"retries": 21}, "retries"),
    (
        "unknown topology level",
        {"topology_level": "row"},
        {"topology_level": "row"},
        "topology_level",
    ),
    (
        "topology neither word",
        {"topology_required": "maybe"},
        {"topology_required": "maybe"},
        "topology_required",
    ),
    ("unknown class", {"priority_class": "gold"}, {"priority_class": "gold"}, "priority_class"),
]


def _api_body(world: Any, changes: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "team": "vision",
        "name": "resnet",
        "flavor": world.h100.name,
        "ranks": 2,
        "gpus_per_rank": 4,
        "image": "registry.example.org/vision/trainer:1.4",
        "command": "python train.py --epochs 3",
        "env": {"BATCH": "64", "LR": "0.1"},
        "retries": 2,
        "topology_level": "rack",
        "topology_required": False,
    }
    body.update(changes)
    return {key: value for key, value in body.items() if value is not None}


@pytest.mark.parametrize(
    ("form_fields", "api_changes", "field"),
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_a_bad_input_shows_the_api_reason_under_its_field_and_queues_nothing(
    world: Any, form_fields: dict[str, str], api_changes: dict[str, Any], field: str
) -> None:
    api = world.client("manager").post(
        "/api/v1/jobs/", _api_body(world, api_changes), format="json"
    )
    assert api.status_code == 400, api.content
    expected = api.json()[field]
    assert expected, api.json()

    client = page_client(world, "manager")
    before = database_state()
    response = client.post(SUBMIT, form_post(world, **form_fields))
    assert response.status_code == 400
    body = response.content.decode()
    assert field_errors(body, field) == expected
    assert 'class="field field-' + field + ' invalid"' in body
    assert database_state() == before
    # What was typed stays in the form, to be mended.
    for name, value in form_fields.items():
        if name in ("ranks", "image", "retries") and value:
            assert f'value="{value}"' in body


def test_a_class_the_team_may_not_use_is_refused_in_the_api_words(world: Any) -> None:
    world.vision.priority_classes.set([world.batch])
    api = world.client("researcher").post(
        "/api/v1/jobs/", _api_body(world, {"priority_class": world.critical.name}), format="json"
    )
    assert api.status_code == 400
    client = page_client(world, "researcher")
    before = database_state()
    response = client.post(SUBMIT, form_post(world, priority_class=world.critical.name))
    assert response.status_code == 400
    assert field_errors(response.content.decode(), "priority_class") == api.json()["priority_class"]
    assert database_state() == before


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ("BATCH", "Line 1 is not NAME=VALUE (got 'BATCH')."),
        ("A=1\n\n=2", "Line 3 is not NAME=VALUE (got '=2')."),
        ("A=1\nB=2\nA=3", "A is set twice (lines 1 and 3)."),
    ],
)
def test_environment_lines_that_are_not_name_value_pairs_are_refused(
    world: Any, env: str, message: str
) -> None:
    client = page_client(world, "researcher")
    before = database_state()
    response = client.post(SUBMIT, form_post(world, env=env))
    assert response.status_code == 400
    assert field_errors(response.content.decode(), "env") == [message]
    assert database_state() == before


def test_blank_lines_and_windows_line_ends_in_the_environment_are_fine(world: Any) -> None:
    response = page_client(world, "researcher").post(
        SUBMIT, form_post(world, env="\r\nA=1\r\n\r\nB=x=y \r\n")
    )
    assert response.status_code == 302
    assert Job.objects.get().env == {"A": "1", "B": "x=y "}


def test_the_team_default_class_is_chosen_and_each_team_brings_its_own(world: Any) -> None:
    # vision may use both classes with critical as its own default; nlp keeps ml's.
    world.vision.default_priority_class = world.critical
    world.vision.save(update_fields=["default_priority_class"])
    world.nlp.priority_classes.set([world.batch])
    body = page_client(world, "manager").get(SUBMIT).content.decode()
    # The first team offered is nlp: only batch, its default.
    assert options(body, "team")[0] == "nlp" and chosen(body, "team") is None
    assert options(body, "priority_class") == [world.batch.name]
    assert chosen(body, "priority_class") == world.batch.name
    # The classes of every offered team, for the page's script, as GET
    # /api/v1/teams/<id>/priority-classes/ answers them.
    script = re.search(
        r'<script id="team-priority-classes" type="application/json">(.*?)</script>', body, re.S
    )
    assert script is not None
    classes = json.loads(script.group(1))
    assert {slug: (c["default"], [n for n, _ in c["allowed"]]) for slug, c in classes.items()} == {
        "nlp": (world.batch.name, [world.batch.name]),
        "vision": (world.critical.name, [world.critical.name, world.batch.name]),
    }
    for team in (world.vision, world.nlp):
        api = world.client("manager").get(f"/api/v1/teams/{team.pk}/priority-classes/").json()
        assert classes[team.slug]["default"] == api["default"]
        assert [n for n, _ in classes[team.slug]["allowed"]] == api["allowed"]
    # Left empty, a vision job gets vision's default.
    response = page_client(world, "manager").post(SUBMIT, form_post(world))
    assert response.status_code == 302
    assert Job.objects.get().priority_class == world.critical


def _earlier_job(world: Any) -> Job:
    return Job.objects.create(
        name="sweep-7",
        team=world.vision,
        submitter=world.users["researcher"],
        priority_class=world.critical,
        flavor=world.a100,
        ranks=3,
        gpus_per_rank=2,
        command="torchrun train.py --lr 3e-4",
        image="registry.example.org/vision/trainer:2.0",
        env={"SEED": "7", "MODE": "a b"},
        retries=1,
        topology_level="block",
        topology_required=True,
        state="failed",
    )


def test_submit_again_fills_the_form_in_from_the_job_and_queues_a_copy(world: Any) -> None:
    job = _earlier_job(world)
    client = page_client(world, "researcher")
    detail = client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert f'href="{SUBMIT}?from={job.pk}"' in detail
    response = client.get(SUBMIT, {"from": job.pk})
    assert response.status_code == 200
    body = response.content.decode()
    assert f"Submit job #{job.pk} again" in body
    assert chosen(body, "team") == "vision"
    assert chosen(body, "flavor") == world.a100.name
    assert chosen(body, "priority_class") == world.critical.name
    assert chosen(body, "topology_level") == "block"
    assert 'name="ranks" value="3"' in body and 'name="gpus_per_rank" value="2"' in body
    assert 'name="retries" value="1"' in body
    assert "torchrun train.py --lr 3e-4</textarea>" in body
    assert "MODE=a b\nSEED=7</textarea>" in body  # by name, on either database
    assert re.search(r'name="topology_required" value="required"[^>]*checked', body)
    assert not re.search(r'name="topology_required" value="preferred"[^>]*checked', body)
    # What the browser sends back for the filled-in form queues the same job again.
    again = client.post(
        SUBMIT,
        form_post(
            world,
            name="sweep-7",
            flavor=world.a100.name,
            ranks="3",
            gpus_per_rank="2",
            priority_class=world.critical.name,
            image="registry.example.org/vision/trainer:2.0",
            command="torchrun train.py --lr 3e-4",
            env="SEED=7\nMODE=a b",
            retries="1",
            topology_level="block",
            topology_required="required",
        ),
    )
    assert again.status_code == 302
    copy = Job.objects.exclude(pk=job.pk).get()
    fields = [
        "name",
        "team",
        "flavor",
        "priority_class",
        "ranks",
        "gpus_per_rank",
        "command",
        "image",
        "env",
        "retries",
        "topology_level",
        "topology_required",
    ]
    assert [getattr(copy, f) for f in fields] == [getattr(job, f) for f in fields]
    assert copy.state == "pending"


@pytest.mark.parametrize("persona", ["other_researcher", "other_manager"])
def test_submit_again_of_a_job_the_persona_cannot_see_is_404_like_its_page(
    world: Any, persona: str
) -> None:
    job = _earlier_job(world)
    client = page_client(world, persona)
    assert client.get(reverse("job-detail", args=[job.pk])).status_code == 404
    assert client.get(SUBMIT, {"from": job.pk}).status_code == 404


@pytest.mark.parametrize("value", ["abc", "-1", "99999999999999999999999", "", "1e3"])
def test_submit_again_of_no_such_job_is_404(world: Any, value: str) -> None:
    response = page_client(world, "researcher").get(SUBMIT, {"from": value})
    assert response.status_code == 404


def test_submit_again_chooses_the_team_default_when_the_job_class_is_no_longer_allowed(
    world: Any,
) -> None:
    job = _earlier_job(world)
    world.vision.priority_classes.set([world.batch])
    body = page_client(world, "researcher").get(SUBMIT, {"from": job.pk}).content.decode()
    assert options(body, "priority_class") == [world.batch.name]
    assert chosen(body, "priority_class") == world.batch.name
