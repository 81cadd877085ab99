"""Writes to the team tree: creating, editing, moving and deleting teams, the
priority classes a team may use, and memberships. Keyword-only, one transaction
each; a quota is changed here only as a team's move requires it to be checked.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction

from core.access import TeamTree
from quotas.job_ledger import job_ledger
from quotas.limits import QueuedJobLimit, queued_job_limits
from quotas.models import Membership, PriorityClass, Quota, Team
from quotas.selectors import PriorityAllowance, priority_allowance, team_tree
from quotas.services.audit import UNSET, audit
from quotas.services.quotas import validate_guarantee_in_tree
from quotas.validation import check_weight


def _team_values(team: Team) -> dict[str, Any]:
    return {
        "slug": team.slug,
        "name": team.name,
        "weight": team.weight,
        "parent": team.parent.slug if team.parent_id else None,
        "max_queued_jobs": team.max_queued_jobs,
    }


MAX_QUEUED_JOBS = 1_000_000


def _check_queued_limit(value: int | None) -> None:
    """A team's own queued-job limit: a whole number from 0 (nothing may wait) up."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_QUEUED_JOBS:
        raise ValidationError(
            {
                "max_queued_jobs": [
                    f"Must be a whole number from 0 to {MAX_QUEUED_JOBS:,}, or null to inherit "
                    f"the limit of the teams above (got {value!r})."
                ]
            }
        )


def _check_queued_limit_narrows(team: Team, value: int) -> None:
    """Refuse a limit above the one the teams above `team` (or the site) allow."""
    if team.parent_id is None:
        above = QueuedJobLimit(limit=settings.QM_MAX_QUEUED_JOBS_PER_TEAM, set_by=None)
    else:
        above = queued_job_limits(team_ids=[team.parent_id], tree=team_tree())[team.parent_id]
    if value > above.limit:
        source = f"team {above.set_by}" if above.set_by else "the site default"
        raise ValidationError(
            {
                "max_queued_jobs": [
                    f"Must be at most {above.limit:,}, the limit {source} sets above "
                    f"{team.slug}; only platform admins may raise it (got {value:,})."
                ]
            }
        )


# --- the team tree ---------------------------------------------------------


@transaction.atomic
def team_create(
    *,
    actor: AbstractBaseUser | None,
    slug: str,
    name: str,
    parent: Team | None = None,
    weight: float = 1.0,
) -> Team:
    if Team.objects.filter(slug=slug).exists():
        raise ValidationError({"slug": [f"A team with slug {slug!r} already exists."]})
    check_weight(weight)
    if parent is not None and job_ledger().team_has_jobs(parent.pk):
        raise ValidationError(
            {
                "parent": [
                    f"Team {parent.slug} has jobs of its own; only leaf teams run jobs, so it cannot get sub-teams."
                ]
            }
        )
    team = Team(slug=slug, name=name or slug, parent=parent, weight=weight)
    team.full_clean()
    team.save()
    audit(
        actor=actor,
        action="team.create",
        obj=team,
        team=team,
        before=None,
        after=_team_values(team),
    )
    return team


@transaction.atomic
def team_update(
    *,
    actor: AbstractBaseUser | None,
    team: Team,
    name: str | None = None,
    weight: float | None = None,
    parent: Team | Any | None = UNSET,
    max_queued_jobs: int | Any | None = UNSET,
    may_widen: bool = True,
) -> Team:
    """Change a team's name, weight, place in the tree or queued-job limit
    (None: inherit the limit of the teams above it, or the site default). Without
    `may_widen` (a manager's edit) the limit may only narrow the one in force above."""
    team = Team.objects.select_for_update().get(pk=team.pk)
    before = _team_values(team)
    fields: list[str] = []
    if max_queued_jobs is not UNSET and max_queued_jobs != team.max_queued_jobs:
        _check_queued_limit(max_queued_jobs)
        if not may_widen and max_queued_jobs is not None:
            _check_queued_limit_narrows(team, max_queued_jobs)
        team.max_queued_jobs = max_queued_jobs
        fields.append("max_queued_jobs")
    if name is not None:
        team.name = name
        fields.append("name")
    if weight is not None:
        check_weight(weight)
        team.weight = weight
        fields.append("weight")
    if parent is not UNSET and parent != team.parent:
        tree = team_tree()
        if parent is not None and (parent.pk == team.pk or parent.pk in tree.descendants(team.pk)):
            raise ValidationError(
                {
                    "parent": [
                        f"Moving {team.slug} under {parent.slug} would make a cycle in the team tree."
                    ]
                }
            )
        team.parent = parent
        fields.append("parent")
    if not fields:
        return team
    team.full_clean()
    team.save(update_fields=fields)
    if "parent" in fields:
        for quota in Quota.objects.filter(team=team).select_related("flavor"):
            validate_guarantee_in_tree(team=team, flavor=quota.flavor, guarantee=quota.guarantee)
    audit(
        actor=actor,
        action="team.update",
        obj=team,
        team=team,
        before=before,
        after=_team_values(team),
    )
    return team


@transaction.atomic
def team_delete(*, actor: AbstractBaseUser | None, team: Team) -> None:
    tree = team_tree()
    subtree = tree.subtree([team.pk])
    unfinished = job_ledger().unfinished_job_ids(subtree, limit=5)
    if unfinished:
        names = ", ".join(f"job {job_id}" for job_id in unfinished)
        raise ValidationError(
            {"team": [f"Team {team.slug} has unfinished jobs ({names}); cancel them first."]}
        )
    if tree.children.get(team.pk):
        raise ValidationError(
            {"team": [f"Team {team.slug} has sub-teams; delete or move them first."]}
        )
    if job_ledger().team_has_jobs(team.pk):
        raise ValidationError(
            {"team": [f"Team {team.slug} has a job history; it cannot be deleted."]}
        )
    audit(
        actor=actor,
        action="team.delete",
        obj=team,
        team=team.parent,
        before=_team_values(team),
        after=None,
    )
    team.delete()


# --- which priority classes a team may use ------------------------------------


class _RollBack(Exception):
    def __init__(self, allowance: PriorityAllowance) -> None:
        self.allowance = allowance


def _allowance_values(team: Team) -> dict[str, Any]:
    allowance = priority_allowance(team=team)
    own = sorted(team.priority_classes.values_list("name", flat=True))
    return {
        "priority_classes": own or None,
        "default_priority_class": (
            team.default_priority_class.name if team.default_priority_class_id else None
        ),
        "allowed": allowance.names,
        "default": allowance.default.name if allowance.default else None,
    }


@transaction.atomic
def team_priority_classes_set(
    *,
    actor: AbstractBaseUser | None,
    team: Team,
    priority_classes: list[PriorityClass] | Any | None = UNSET,
    default_priority_class: PriorityClass | Any | None = UNSET,
    may_widen: bool,
    dry_run: bool = False,
) -> PriorityAllowance:
    """Set the classes `team`'s jobs may use (None or empty: its parent's) and
    its default class (None: its parent's).

    A sub-team's list must lie inside its parent's classes. Narrowing a team
    narrows the own lists of its sub-teams with it (each change audited), and is
    refused where a sub-team would be left with no class. With `may_widen`
    false (managers), a change that would let the team use a class it cannot
    use now is refused with PermissionDenied. With `dry_run`, every rule is
    checked and the answer computed, then everything is rolled back (the
    Django admin validates its form this way).
    """
    if dry_run:
        try:
            with transaction.atomic():
                allowance = team_priority_classes_set(
                    actor=actor,
                    team=team,
                    priority_classes=priority_classes,
                    default_priority_class=default_priority_class,
                    may_widen=may_widen,
                )
                raise _RollBack(allowance)
        except _RollBack as rolled_back:
            return rolled_back.allowance
    team = Team.objects.select_for_update().get(pk=team.pk)
    tree = team_tree()
    before = _allowance_values(team)
    old = priority_allowance(team=team, tree=tree)
    if priority_classes is not UNSET:
        wanted = list(priority_classes or [])
        if team.parent_id is not None and wanted:
            parent = priority_allowance(team=team.parent, tree=tree)
            outside = sorted(pc.name for pc in wanted if not parent.allows(pc))
            if outside:
                raise ValidationError(
                    {
                        "priority_classes": [
                            f"A sub-team can only narrow its parent's classes: {team.parent.slug} "
                            f"may use {parent.describe()}, not {', '.join(outside)}."
                        ]
                    }
                )
        team.priority_classes.set(wanted)
    if default_priority_class is not UNSET:
        team.default_priority_class = default_priority_class
        team.save(update_fields=["default_priority_class"])
    new = priority_allowance(team=team, tree=tree)
    if not new.allowed:
        raise ValidationError(
            {"priority_classes": [f"{team.slug} would be left with no class its jobs may use."]}
        )
    if team.default_priority_class_id and not new.allows(team.default_priority_class):
        if default_priority_class is not UNSET:
            raise ValidationError(
                {
                    "default_priority_class": [
                        f"{team.default_priority_class.name} is not among the classes {team.slug} "
                        f"may use ({new.describe()})."
                    ]
                }
            )
        # The list no longer holds the old default: fall back to the parent's.
        team.default_priority_class = None
        team.save(update_fields=["default_priority_class"])
        new = priority_allowance(team=team, tree=tree)
    if not may_widen:
        gained = sorted(pc.name for pc in new.allowed if not old.allows(pc))
        if gained:
            raise PermissionDenied(
                f"Only platform admins may widen the classes of {team.slug}: it may not use "
                f"{', '.join(gained)} now."
            )
    after = _allowance_values(team)
    if before == after:
        return new
    audit(
        actor=actor, action="team.priority_classes", obj=team, team=team, before=before, after=after
    )
    _narrow_sub_teams(actor=actor, team=team, tree=tree)
    return new


def _narrow_sub_teams(*, actor: AbstractBaseUser | None, team: Team, tree: TeamTree) -> None:
    """Trim the own lists below `team` to what their parents now allow."""
    pending = list(tree.children.get(team.pk, ()))
    while pending:
        child = Team.objects.select_related("parent").get(pk=pending.pop(0))
        pending.extend(tree.children.get(child.pk, ()))
        own = list(child.priority_classes.all())
        if not own:
            continue
        parent = priority_allowance(team=child.parent, tree=tree)  # type: ignore[arg-type]
        kept = [pc for pc in own if parent.allows(pc)]
        if len(kept) == len(own):
            continue
        if not kept:
            raise ValidationError(
                {
                    "priority_classes": [
                        f"Sub-team {child.slug} may use only {', '.join(pc.name for pc in own)}; "
                        f"this change would leave it no class. Change {child.slug} first."
                    ]
                }
            )
        before = _allowance_values(child)
        child.priority_classes.set(kept)
        if child.default_priority_class_id and not any(
            pc.pk == child.default_priority_class_id for pc in kept
        ):
            child.default_priority_class = None
            child.save(update_fields=["default_priority_class"])
        audit(
            actor=actor,
            action="team.priority_classes",
            obj=child,
            team=child,
            before=before,
            after=_allowance_values(child),
        )


@transaction.atomic
def membership_set(
    *, actor: AbstractBaseUser | None, user: AbstractBaseUser, team: Team, role: str
) -> Membership:
    if role not in Membership.Role.values:
        raise ValidationError({"role": ["Must be manager or researcher."]})
    membership, _ = Membership.objects.update_or_create(
        user=user, team=team, defaults={"role": role}
    )
    audit(
        actor=actor,
        action="membership.set",
        obj=membership,
        team=team,
        before=None,
        after={"user": user.get_username(), "role": role},
    )
    return membership
