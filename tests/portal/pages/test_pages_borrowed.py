"""Borrowed GPUs are what a team holds now beyond its guarantee, and every
surface (dashboard, team pages, the usage API, /metrics) shows the same figure.

The scenario walks the cluster of tests/conftest.py (24 h100 GPUs; org 16 >
ml 16 > vision 8 and nlp 8; other 8 > ops 8) through a borrow, the end of
another job and a reclaim, and compares each surface with figures computed by
hand at each step.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from preemption.models import Attempt, Job, JobState
from tests.portal.pages.conftest import page_client

pytestmark = pytest.mark.django_db

FLAVOR = "h100-80gb"
TEAMS = ("org", "ml", "vision", "nlp", "other", "ops")


def _admit(world: Any, team: Any, gpus: int, *, borrowed_at_admission: int) -> Job:
    """A running job with the attempt the engine records: `borrowed_gpus` is
    what it borrowed when it was admitted, and stays so."""
    job = Job.objects.create(
        name=f"{team.slug}-{gpus}",
        team=team,
        submitter=world.users["admin"],
        priority_class=world.batch,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=gpus,
        command="python train.py",
        state=JobState.RUNNING,
    )
    Attempt.objects.create(
        job=job,
        number=1,
        admitted_at=timezone.now(),
        borrowed_gpus=borrowed_at_admission,
        placement=[{"node": "h100-node-0", "ranks": 1}],
    )
    return job


def _end(job: Job, state: str, end_reason: str) -> None:
    Attempt.objects.filter(job=job, ended_at__isnull=True).update(
        ended_at=timezone.now(), end_reason=end_reason
    )
    Job.objects.filter(pk=job.pk).update(state=state)


def _dashboard(client: Any) -> tuple[int, dict[str, int]]:
    body = client.get(reverse("dashboard")).content.decode()
    card = re.search(rf'data-flavor="{FLAVOR}">(.*?)</article>', body, re.S)
    assert card is not None
    cluster = re.search(r'data-figure="borrowed">(\d+)<', card.group(1))
    assert cluster is not None
    teams = {}
    for slug, row in re.findall(
        rf'<tr data-team="([\w-]+)" data-flavor="{FLAVOR}">(.*?)</tr>', body, re.S
    ):
        figure = re.search(r'data-field="borrowed">(?:<strong class="borrow">)?(\d+)', row)
        assert figure is not None
        teams[slug] = int(figure.group(1))
    return int(cluster.group(1)), teams


def _team_page(client: Any, slug: str) -> int:
    body = client.get(reverse("team-detail", args=[slug])).content.decode()
    own = re.search(rf'<tr data-flavor="{FLAVOR}">(.*?)</tr>', body, re.S)
    assert own is not None
    figure = re.search(r'data-field="borrowed">(\d+)<', own.group(1))
    assert figure is not None
    return int(figure.group(1))


def _api(world: Any, persona: str) -> tuple[int, dict[str, int], dict[str, int]]:
    response = world.client(persona).get("/api/v1/usage/")
    assert response.status_code == 200, response.content
    body = response.json()
    flavor = next(item for item in body["flavors"] if item["flavor"] == FLAVOR)
    rows = [row for row in body["teams"] if row["flavor"] == FLAVOR]
    return (
        flavor["borrowed"],
        {row["team"]: row["borrowed"] for row in rows},
        {row["team"]: row["used"] for row in rows},
    )


def _metrics(client: Any) -> dict[str, int]:
    text = client.get(reverse("metrics")).content.decode()
    return {
        team: int(value)
        for team, value in re.findall(
            rf'qm_gpus_borrowed{{team="([\w-]+)",flavor="{FLAVOR}"}} (\d+)', text
        )
    }


def _check(world: Any, step: str, cluster: int, expected: dict[str, tuple[int, int]]) -> None:
    """Every surface shows `cluster` borrowed GPUs on the h100 card and, per
    team, the (used, borrowed) pair computed by hand."""
    borrowed = {team: pair[1] for team, pair in expected.items()}
    admin = page_client(world, "admin")
    dashboard_cluster, dashboard_teams = _dashboard(admin)
    api_cluster, api_teams, api_used = _api(world, "admin")
    assert (step, dashboard_cluster, api_cluster) == (step, cluster, cluster)
    assert (step, dashboard_teams) == (step, borrowed)
    assert (step, {slug: _team_page(admin, slug) for slug in TEAMS}) == (step, borrowed)
    assert (step, api_teams) == (step, borrowed)
    assert (step, api_used) == (step, {team: pair[0] for team, pair in expected.items()})
    assert (step, _metrics(admin)) == (step, borrowed)


def test_borrowed_follows_usage_on_every_surface(world: Any) -> None:
    # Borrow: vision runs 8 inside its guarantee and 4 more on nlp's idle
    # guarantee; ops runs 12 of which 4 beyond its own 8, lent by org.
    inside = _admit(world, world.vision, 8, borrowed_at_admission=0)
    _admit(world, world.vision, 4, borrowed_at_admission=4)
    lender = _admit(world, world.ops, 12, borrowed_at_admission=4)
    _check(
        world,
        "borrow",
        # Only other crosses a top-level guarantee: 12 used of 8.
        cluster=4,
        expected={
            "org": (12, 0),
            "ml": (12, 0),
            "vision": (12, 4),
            "nlp": (0, 0),
            "other": (12, 4),
            "ops": (12, 4),
        },
    )

    # The other job ends: vision's 4-GPU job is inside its guarantee now,
    # although its attempt recorded 4 borrowed at admission.
    _end(inside, JobState.SUCCEEDED, Attempt.EndReason.SUCCEEDED)
    after_end = {
        "org": (4, 0),
        "ml": (4, 0),
        "vision": (4, 0),
        "nlp": (0, 0),
        "other": (12, 4),
        "ops": (12, 4),
    }
    _check(world, "the other job ends", cluster=4, expected=after_end)

    # Reclaim: vision wants 12 more; ops's job is preempting and its GPUs stay
    # counted until every rank has exited.
    Job.objects.filter(pk=lender.pk).update(state=JobState.PREEMPTING)
    _check(world, "reclaim, in the grace window", cluster=4, expected=after_end)

    # The reclaim is done: ops's job is requeued and vision's 12-GPU job runs,
    # 8 of vision's 16 beyond its guarantee but inside ml's and org's.
    _end(lender, JobState.REQUEUED, Attempt.EndReason.PREEMPTED)
    _admit(world, world.vision, 12, borrowed_at_admission=8)
    _check(
        world,
        "reclaim, done",
        cluster=0,
        expected={
            "org": (16, 0),
            "ml": (16, 0),
            "vision": (16, 8),
            "nlp": (0, 0),
            "other": (0, 0),
            "ops": (0, 0),
        },
    )


def test_usage_api_shows_only_readable_teams(world: Any) -> None:
    _admit(world, world.vision, 12, borrowed_at_admission=4)
    cluster, teams, _ = _api(world, "other_researcher")
    assert cluster == 0
    assert set(teams) == {"ops"}
    assert world.client("anonymous").get("/api/v1/usage/").status_code == 401
