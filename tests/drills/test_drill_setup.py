"""The drill sets up its cluster through the quotas services: every change is
validated and audited as the drill's own user, and what already matches is left
alone."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model

from drills.harness import Drill
from quotas.models import AuditEntry, Node, Quota, Team
from tests.conftest import mission_class

# The drill's waits close stale connections between polls, as a long-running
# command must; inside a test's open transaction that would close it, so these
# tests commit for real.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _classes() -> None:
    mission_class("ai-prod-critical")
    mission_class("ai-batch-preemptible")


def _drill(ranks: int) -> Drill:
    return Drill(ranks=ranks, grace=None, runtime="local", say=lambda line: None)


def _quotas() -> dict[str, int]:
    return {
        q.team.slug: q.guarantee
        for q in Quota.objects.filter(flavor__name="drill-gpu").select_related("team")
    }


def _last_audit_id() -> int:
    return AuditEntry.objects.order_by("-id").values_list("id", flat=True).first() or 0


def _audited(action: str) -> list[AuditEntry]:
    return list(AuditEntry.objects.filter(action=action).order_by("id"))


def test_setup_audits_every_change_it_makes() -> None:
    _drill(4).setup()

    bot = get_user_model().objects.get(username="drill-bot")
    assert _quotas() == {"drill": 8, "drill-owner": 8, "drill-borrower": 0}
    quota_changes = _audited("quota.set")
    assert {(e.object_repr, e.after["guarantee"]) for e in quota_changes} >= {
        (str(Quota.objects.get(team__slug=slug, flavor__name="drill-gpu")), guarantee)
        for slug, guarantee in _quotas().items()
    }
    assert all(e.actor == bot for e in AuditEntry.objects.all())
    assert {e.after["team"] for e in quota_changes} == {"drill", "drill-owner", "drill-borrower"}
    assert [e.after["slug"] for e in _audited("team.create")] == [
        "drill",
        "drill-owner",
        "drill-borrower",
    ]
    assert [e.object_repr for e in _audited("flavor.create")] == ["drill-gpu"]
    assert [e.after["gpus"] for e in _audited("node.upsert")] == [8]
    # The borrower's class without the checkpoint notice, for the rounds that compare.
    assert [e.after["name"] for e in _audited("priority_class.save")] == [
        "drill-short-grace",
        "drill-no-notice",
    ]
    assert Team.objects.get(slug="drill-borrower").parent.slug == "drill"

    # The same drill again finds everything as it wants it: nothing changes, nothing is audited.
    entries = AuditEntry.objects.count()
    _drill(4).setup()
    assert AuditEntry.objects.count() == entries


def test_a_larger_then_smaller_drill_moves_the_quotas_in_a_valid_order() -> None:
    _drill(4).setup()
    before = _last_audit_id()

    _drill(12).setup()  # two nodes of 8
    assert _quotas() == {"drill": 16, "drill-owner": 16, "drill-borrower": 0}
    assert Node.objects.filter(flavor__name="drill-gpu", schedulable=True).count() == 2
    grown = AuditEntry.objects.filter(pk__gt=before).order_by("id")
    assert [
        (e.action, e.before["guarantee"], e.after["guarantee"])
        for e in grown.filter(action="quota.set")
    ] == [
        ("quota.set", 8, 16),  # the root first, so the owner fits under it
        ("quota.set", 8, 16),
    ]
    assert [e.after["team"] for e in grown.filter(action="quota.set")] == ["drill", "drill-owner"]

    before = _last_audit_id()
    _drill(2).setup()  # back to one node: the owner comes down before the root
    assert _quotas() == {"drill": 8, "drill-owner": 8, "drill-borrower": 0}
    assert Node.objects.filter(flavor__name="drill-gpu", schedulable=True).count() == 1
    shrunk = AuditEntry.objects.filter(pk__gt=before).order_by("id")
    assert [e.after["team"] for e in shrunk.filter(action="quota.set")] == [
        "drill-owner",
        "drill",
    ]
    assert shrunk.filter(action="node.upsert", after__schedulable=False).count() == 1


def test_a_refused_setup_is_reported_and_changes_nothing(settings: Any) -> None:
    """Another top-level team already holds the drill flavor's GPUs: the root's
    guarantee cannot be raised, and the drill says why instead of forcing it."""
    from drills.base import DrillError
    from quotas.services import flavor_create, node_upsert, quota_set, team_create

    flavor = flavor_create(actor=None, name="drill-gpu")
    node_upsert(actor=None, name="drill-node-0", flavor=flavor, gpus=8)
    squatter = team_create(actor=None, slug="squatter", name="Squatter")
    quota_set(actor=None, team=squatter, flavor=flavor, guarantee=8)
    quotas = _quotas()

    with pytest.raises(DrillError, match=r"set-up was refused.*cluster has 8"):
        _drill(4).setup()
    assert not Quota.objects.filter(team__slug="drill").exists()
    assert _quotas() == {**quotas, "drill-borrower": 0}


def test_the_critical_job_comes_three_quarters_through_unless_told_a_step() -> None:
    assert Drill(ranks=4, grace=None, runtime="local", say=print, steps=120).steady_step == 90
    told = Drill(ranks=4, grace=None, runtime="local", say=print, steps=150, critical_at_step=40)
    assert told.steady_step == 40


@pytest.mark.parametrize("step", [0, 150, 200])
def test_a_critical_step_outside_the_run_is_refused(step: int) -> None:
    from drills.base import DrillError

    with pytest.raises(DrillError, match=r"--critical-at-step must be between 1 and 149"):
        Drill(ranks=4, grace=None, runtime="local", say=print, steps=150, critical_at_step=step)
