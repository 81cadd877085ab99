"""The quota preview names the running jobs a change leaves beyond the
guarantee or over the new borrow limit: nobody is preempted at once, but those
GPUs are borrowed, the first to be reclaimed when an owner needs them. It names
only jobs of the edited team's subtree, which the editor may read; reclaimed jobs
of other tenants are only counted.

The world: org 16 > ml 16 > vision 8 and nlp 8; other 8 > ops 8; 24 h100 GPUs.
"""

from __future__ import annotations

import html
import re
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from preemption.models import Job, JobState
from quotas.models import Quota
from tests import builders
from tests.conftest import database_state
from tests.portal.pages.conftest import page_client

pytestmark = pytest.mark.django_db

MEANING = (
    "it keeps them for now, but borrowed GPUs are the first to be reclaimed when an owner "
    "needs them, and the job would be preempted whole."
)


def _running(
    world: Any,
    team: Any,
    gpus: int,
    *,
    name: str,
    critical: bool = False,
    nodes: tuple[str, ...] = ("h100-node-0",),
    admitted_at: datetime | None = None,
) -> Job:
    """A running job of `gpus` GPUs in ranks of at most 8, one rank per node of `nodes`."""
    ranks = len(nodes)
    return builders.running_job(
        world,
        team,
        name=name,
        ranks=ranks,
        gpus_per_rank=gpus // ranks,
        priority_class=world.critical if critical else world.batch,
        admitted_at=admitted_at or timezone.now(),
        attempt_fields={"placement": [{"node": node, "ranks": 1} for node in nodes]},
    )


def _exposed(body: str) -> dict[str, tuple[str, str]]:
    """Job name -> (GPUs beyond, what it means) of the preview's exposed table."""
    rows = re.findall(
        r'<tr data-job="\d+"><td><a href="/jobs/\d+/">#\d+</a> ([\w-]+)</td>.*?'
        r'data-field="beyond">(\d+)</td><td>(.*?)</td></tr>',
        body,
        re.S,
    )
    return {name: (beyond, html.unescape(meaning)) for name, beyond, meaning in rows}


def _preview(world: Any, persona: str, team: Any, change: dict[str, Any]) -> str:
    quota = world.quota(team)
    client = page_client(world, persona)
    before = database_state()
    response = client.post(reverse("quota-preview", args=[quota.pk]), change)
    assert response.status_code == 200, response.content
    assert database_state() == before
    return response.content.decode()


def test_lowering_a_guarantee_under_a_running_job_names_it(world: Any) -> None:
    _running(world, world.vision, 8, name="big")
    body = _preview(world, "manager", world.vision, {"guarantee": 4})
    assert 'id="no-reclaim"' in body
    assert "1 running job would run beyond the guarantee" in body
    assert _exposed(body) == {
        "big": (
            "4",
            f"4 of its 8 GPUs would run beyond vision's guarantee of 4: {MEANING}",
        )
    }
    assert "vision runs 8 GPUs of h100-80gb: 4 would be beyond its guarantee (now 0)" in body


def test_a_borrow_limit_of_zero_under_a_borrowing_job_names_it(world: Any) -> None:
    _running(world, world.vision, 12, name="borrower", nodes=("h100-node-0", "h100-node-1"))
    body = _preview(world, "manager", world.vision, {"guarantee": 8, "borrow_limit": 0})
    assert _exposed(body) == {
        "borrower": (
            "4",
            "4 of its 12 GPUs would run beyond vision's guarantee of 8, over the new borrow "
            f"limit of 0: {MEANING}",
        )
    }
    assert "4 over the new borrow limit" in body


def test_never_preempted_and_higher_priority_jobs_fill_the_guarantee_first(world: Any) -> None:
    _running(world, world.vision, 6, name="batch")
    _running(world, world.vision, 2, name="serve", critical=True)
    body = _preview(world, "manager", world.vision, {"guarantee": 4})
    # serve (never preempted) sits inside; batch gets the other 2 and runs 4 beyond.
    assert _exposed(body) == {
        "batch": ("4", f"4 of its 6 GPUs would run beyond vision's guarantee of 4: {MEANING}")
    }


def test_an_inner_team_lists_the_jobs_of_its_subtree(world: Any) -> None:
    Quota.objects.filter(team__in=[world.vision, world.nlp]).update(guarantee=4)
    # The longest running job is protected first: nlp's, admitted last, runs beyond.
    _running(world, world.nlp, 6, name="nlp-job")
    _running(
        world,
        world.vision,
        6,
        name="vision-job",
        nodes=("h100-node-1",),
        admitted_at=timezone.now() - timedelta(hours=1),
    )
    before = _preview(world, "admin", world.ml, {"guarantee": 16})
    assert 'id="exposed"' not in before
    body = _preview(world, "admin", world.ml, {"guarantee": 10})
    assert set(_exposed(body)) == {"nlp-job"}
    assert "ml runs 12 GPUs of h100-80gb: 2 would be beyond its guarantee (now 0)" in body


@pytest.mark.parametrize(
    "change",
    [
        {"guarantee": 8},
        {"guarantee": 8, "borrow_limit": 8},
        {"guarantee": 8, "lend_limit": 0},
    ],
)
def test_a_change_that_exposes_nothing_lists_nothing(world: Any, change: dict[str, Any]) -> None:
    _running(world, world.vision, 8, name="inside")
    body = _preview(world, "manager", world.vision, change)
    assert 'id="exposed"' not in body and 'id="no-reclaim"' in body


def test_a_job_already_beyond_is_listed_only_when_the_change_moves_it(world: Any) -> None:
    _running(world, world.vision, 12, name="borrower", nodes=("h100-node-0", "h100-node-1"))
    # A borrow limit above what it borrows changes nothing for it.
    assert (
        _exposed(_preview(world, "manager", world.vision, {"guarantee": 8, "borrow_limit": 6}))
        == {}
    )
    # A lower guarantee leaves more of it beyond.
    assert (
        _exposed(_preview(world, "manager", world.vision, {"guarantee": 6}))["borrower"][0] == "6"
    )


def test_the_api_preview_names_the_same_jobs(world: Any) -> None:
    job = _running(world, world.vision, 8, name="big")
    quota = world.quota(world.vision)
    response = world.client("manager").post(
        f"/api/v1/quotas/{quota.pk}/preview/", {"guarantee": 4, "reason": "ignored"}, format="json"
    )
    assert response.status_code == 200, response.content
    exposed = response.json()["exposed"]
    assert (exposed["beyond"], exposed["beyond_before"], exposed["over_borrow_limit"]) == (4, 0, 0)
    assert [(item["job_id"], item["beyond"], item["team"]) for item in exposed["jobs"]] == [
        (job.pk, 4, "vision")
    ]
    assert response.json()["reclaimed_elsewhere"] == {"jobs": 0, "gpus": 0}


def _reclaim_scene(world: Any) -> Job:
    """vision, guaranteed nothing, waits with 8 GPUs while ops borrows 8: raising
    vision's guarantee to 8 (all ml has left beside nlp's 8) reclaims ops's borrower."""
    for team, guarantee in ((world.vision, 0), (world.nlp, 8)):
        Quota.objects.filter(team=team, flavor=world.h100).update(guarantee=guarantee)
    _running(world, world.nlp, 8, name="nlp-job")
    _running(world, world.ops, 8, name="ops-own", nodes=("h100-node-1",))
    borrower = _running(world, world.ops, 8, name="ops-borrower", nodes=("h100-node-2",))
    builders.job(world, world.vision, state=JobState.PENDING, gpus_per_rank=8, name="wants")
    return borrower


def test_a_managers_preview_only_counts_other_tenants_reclaimed_jobs(world: Any) -> None:
    borrower = _reclaim_scene(world)
    body = _preview(world, "manager", world.vision, {"guarantee": 8})
    assert (
        '<p class="warn" id="reclaimed-elsewhere">1 running job of teams outside yours would be '
        "preempted (8 GPUs).</p>"
    ) in body
    assert "ops-borrower" not in body and f'href="/jobs/{borrower.pk}/"' not in body
    assert 'id="no-reclaim"' not in body
    response = world.client("manager").post(
        f"/api/v1/quotas/{world.quota(world.vision).pk}/preview/", {"guarantee": 8}, format="json"
    )
    assert (response.json()["reclaimed"], response.json()["reclaimed_elsewhere"]) == (
        [],
        {"jobs": 1, "gpus": 8},
    )
    assert "ops-borrower" not in response.content.decode()


def test_an_admins_preview_names_every_reclaimed_job(world: Any) -> None:
    borrower = _reclaim_scene(world)
    body = _preview(world, "admin", world.vision, {"guarantee": 8})
    assert "1 running job would be preempted" in body
    assert f'<a href="/jobs/{borrower.pk}/">#{borrower.pk}</a> ops-borrower' in body
    assert 'id="reclaimed-elsewhere"' not in body
