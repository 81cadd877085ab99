"""Which priority classes a team may use: inherited down the tree, only ever
narrowed, with a default that is always one of them. Service-level, against
the real database; the API's refusals are in tests/security."""

from __future__ import annotations

from importlib import import_module
from typing import Any

import pytest
from django.apps import apps
from django.core.exceptions import PermissionDenied, ValidationError

from preemption.cycle import schedule_cycle
from preemption.models import JobState
from preemption.services import job_submit
from quotas.models import AuditEntry, PriorityClass, Quota, Team
from quotas.selectors import priority_allowance
from quotas.services import priority_class_delete, team_priority_classes_set, team_update
from tests.conftest import database_state


@pytest.fixture
def spare(world: Any) -> PriorityClass:
    """A third class, below batch, that no team may use yet."""
    return PriorityClass.objects.create(name="spare", value=5)


def allowed(team: Team) -> tuple[list[str], str | None, str | None]:
    allowance = priority_allowance(team=team)
    return allowance.names, allowance.default.name if allowance.default else None, allowance.source


def narrow(world: Any, team: Team, *classes: PriorityClass, **kwargs: Any) -> None:
    team_priority_classes_set(
        actor=world.users["admin"],
        team=team,
        priority_classes=list(classes),
        **{"may_widen": True, **kwargs},
    )


def test_sub_teams_inherit_the_list_of_the_nearest_team_above_with_one(world: Any) -> None:
    both = ["ai-prod-critical", "ai-batch-preemptible"]
    assert allowed(world.org) == (both, "ai-batch-preemptible", "org")
    assert allowed(world.ml) == (both, "ai-batch-preemptible", "org")
    assert allowed(world.vision) == (both, "ai-batch-preemptible", "org")
    narrow(world, world.ml, world.batch)
    assert allowed(world.ml) == (["ai-batch-preemptible"], "ai-batch-preemptible", "ml")
    assert allowed(world.vision) == (["ai-batch-preemptible"], "ai-batch-preemptible", "ml")
    assert allowed(world.org)[0] == both


def test_a_new_top_level_team_may_use_only_the_installation_default(world: Any) -> None:
    fresh = Team.objects.create(slug="fresh", name="Fresh")
    leaf = Team.objects.create(slug="fresh-leaf", name="Fresh leaf", parent=fresh)
    assert allowed(leaf) == (["ai-batch-preemptible"], "ai-batch-preemptible", None)


def test_a_moved_team_keeps_only_what_its_new_parent_allows(world: Any) -> None:
    narrow(world, world.other, world.batch)
    narrow(world, world.vision, world.critical, world.batch)
    Quota.objects.filter(team=world.ops).update(guarantee=0)  # room for vision under other
    team_update(actor=world.users["admin"], team=world.vision, parent=world.other)
    # Its own list still names critical, but a sub-team never widens its parent.
    assert allowed(world.vision)[0] == ["ai-batch-preemptible"]


def test_the_default_is_the_nearest_allowed_one_else_the_installations_else_the_least(
    world: Any, spare: PriorityClass
) -> None:
    narrow(world, world.org, world.critical, world.batch, spare, default_priority_class=spare)
    assert allowed(world.vision)[1] == "spare"  # inherited from org
    narrow(
        world, world.ml, world.critical, world.batch, spare, default_priority_class=world.critical
    )
    assert allowed(world.vision)[1] == "ai-prod-critical"  # the nearest own default
    narrow(world, world.vision, world.batch, spare)
    # ml's default is not allowed in vision; org's is, and comes before the installation's.
    assert allowed(world.vision)[1] == "spare"
    for team in (world.ml, world.org):
        team_priority_classes_set(
            actor=None, team=team, default_priority_class=None, may_widen=True
        )
    assert allowed(world.vision)[1] == "ai-batch-preemptible"  # the installation's default
    PriorityClass.objects.filter(pk=world.batch.pk).update(is_default=False)
    # No default anywhere: the allowed class of the lowest value.
    assert allowed(world.vision)[1] == "spare"


def test_a_job_without_a_class_gets_the_teams_default(world: Any) -> None:
    narrow(world, world.vision, world.critical, world.batch, default_priority_class=world.critical)
    job = job_submit(
        submitter=world.users["researcher"],
        team=world.vision,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=1,
        command="true",
    )
    assert job.priority_class == world.critical


def test_narrowing_a_parent_narrows_its_sub_teams_lists_and_audits_each(world: Any) -> None:
    narrow(world, world.vision, world.critical, world.batch, default_priority_class=world.critical)
    narrow(world, world.ml, world.batch)
    assert list(world.vision.priority_classes.all()) == [world.batch]
    world.vision.refresh_from_db()
    assert world.vision.default_priority_class is None
    entries = AuditEntry.objects.filter(action="team.priority_classes").order_by("id")
    assert [(e.team.slug, e.after["priority_classes"]) for e in entries] == [
        ("vision", ["ai-batch-preemptible", "ai-prod-critical"]),
        ("ml", ["ai-batch-preemptible"]),
        ("vision", ["ai-batch-preemptible"]),
    ]
    assert entries.last().actor == world.users["admin"]  # type: ignore[union-attr]


def test_narrowing_that_leaves_a_sub_team_no_class_is_refused(world: Any) -> None:
    narrow(world, world.vision, world.batch)
    before = database_state()
    with pytest.raises(ValidationError) as refused:
        narrow(world, world.ml, world.critical)
    assert refused.value.message_dict == {
        "priority_classes": [
            "Sub-team vision may use only ai-batch-preemptible; this change would leave it "
            "no class. Change vision first."
        ]
    }
    assert database_state() == before


def test_a_manager_may_narrow_and_choose_the_default_but_never_widen(world: Any) -> None:
    manager = world.users["manager"]
    team_priority_classes_set(
        actor=manager, team=world.vision, priority_classes=[world.batch], may_widen=False
    )
    team_priority_classes_set(
        actor=manager, team=world.vision, default_priority_class=world.batch, may_widen=False
    )
    assert allowed(world.vision)[:2] == (["ai-batch-preemptible"], "ai-batch-preemptible")
    before = database_state()
    for change in (
        {"priority_classes": [world.critical, world.batch]},
        {"priority_classes": None},  # back to ml's list, which holds critical
    ):
        with pytest.raises(PermissionDenied, match="may not use ai-prod-critical now"):
            team_priority_classes_set(actor=manager, team=world.vision, may_widen=False, **change)
    assert database_state() == before


def test_a_class_that_is_some_teams_whole_list_cannot_be_deleted(
    world: Any, spare: PriorityClass
) -> None:
    narrow(world, world.org, world.critical, world.batch, spare)
    narrow(world, world.vision, spare)
    before = database_state()
    with pytest.raises(ValidationError, match="spare is the only class teams vision may use"):
        priority_class_delete(actor=world.users["admin"], priority_class=spare)
    assert database_state() == before
    narrow(world, world.vision, world.batch, spare)
    priority_class_delete(actor=world.users["admin"], priority_class=spare)
    assert allowed(world.vision)[0] == ["ai-batch-preemptible"]


def test_the_migration_lets_existing_top_level_teams_keep_every_class(
    world: Any, spare: PriorityClass
) -> None:
    for team in Team.objects.all():
        team.priority_classes.clear()
    migration = import_module("quotas.migrations.0003_team_priority_classes")
    migration.allow_existing_classes(apps, None)
    every = ["ai-prod-critical", "ai-batch-preemptible", "spare"]
    assert allowed(world.org)[0] == every and allowed(world.other)[0] == every
    assert allowed(world.vision) == (every, "ai-batch-preemptible", "org")
    assert not world.vision.priority_classes.exists()


def test_a_waiting_job_whose_class_was_taken_away_is_held_and_says_why(world: Any) -> None:
    def submit(priority_class: PriorityClass, name: str) -> Any:
        return job_submit(
            submitter=world.users["researcher"],
            team=world.vision,
            flavor=world.h100,
            ranks=1,
            gpus_per_rank=4,
            command="true",
            priority_class=priority_class,
            name=name,
        )

    serve, train = submit(world.critical, "serve"), submit(world.batch, "train")
    narrow(world, world.vision, world.batch)
    result = schedule_cycle(act=False)
    serve.refresh_from_db()
    train.refresh_from_db()
    assert train.state == JobState.ADMITTED
    assert serve.state == JobState.PENDING and result.waiting == 1
    assert serve.waiting_reason == (
        "held: team vision may no longer use ai-prod-critical (it may use "
        "ai-batch-preemptible); cancel and resubmit in one of those"
    )
    # Given the class back, it is planned like any other job.
    narrow(world, world.vision, world.critical, world.batch)
    schedule_cycle(act=False)
    serve.refresh_from_db()
    assert serve.state == JobState.ADMITTED
