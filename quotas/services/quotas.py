"""Writes to quotas: a team's guarantee, borrow limit and lend limit per flavor, and
the validation the quota editor and its preview share. Keyword-only, one
transaction each; never edits the team tree.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction

from quotas.models import Quota, ResourceFlavor, Team
from quotas.selectors import team_tree
from quotas.services.audit import UNSET, audit
from quotas.validation import guarantee_range, quota_ranges


def _quota_values(quota: Quota) -> dict[str, Any]:
    return {
        "team": quota.team.slug,
        "flavor": quota.flavor.name,
        "guarantee": quota.guarantee,
        "borrow_limit": quota.borrow_limit,
        "lend_limit": quota.lend_limit,
    }


# --- quotas ----------------------------------------------------------------


def validate_guarantee_in_tree(*, team: Team, flavor: ResourceFlavor, guarantee: int) -> None:
    """Refuse a guarantee its place in the tree no longer allows (after a move)."""
    allowed = guarantee_range(team=team, flavor=flavor, subtree=team_tree().subtree([team.pk]))
    if (message := allowed.check(guarantee)) is not None:
        raise ValidationError({"guarantee": [message]})


def quota_validate(
    *,
    team: Team,
    flavor: ResourceFlavor,
    guarantee: int,
    borrow_limit: int | None,
    lend_limit: int | None,
) -> None:
    """Every rule a quota must keep, without writing anything. Raises ValidationError
    naming each refused field with its allowed range (`quotas.validation`).

    The values may be anything a person typed: a value that is not a whole number
    is refused like one out of range, so every refusal reads the same."""
    ranges = quota_ranges(team=team, flavor=flavor, subtree=team_tree().subtree([team.pk]))
    errors = {
        field: [message]
        for field, value in (
            ("guarantee", guarantee),
            ("borrow_limit", borrow_limit),
            ("lend_limit", lend_limit),
        )
        if (message := ranges[field].check(value)) is not None
    }
    if errors:
        raise ValidationError(errors)


@transaction.atomic
def quota_set(
    *,
    actor: AbstractBaseUser | None,
    team: Team,
    flavor: ResourceFlavor,
    guarantee: int,
    borrow_limit: int | None = None,
    lend_limit: int | None = None,
    reason: str = "",
) -> Quota:
    """Create or replace the quota of (team, flavor); `reason`, if given, is
    stored with the audit entry."""
    # Lock the flavor row so two edits of the same flavor's tree cannot both
    # pass the sum checks and together break them.
    ResourceFlavor.objects.select_for_update().filter(pk=flavor.pk).first()
    quota_validate(
        team=team,
        flavor=flavor,
        guarantee=guarantee,
        borrow_limit=borrow_limit,
        lend_limit=lend_limit,
    )
    quota = Quota.objects.select_for_update().filter(team=team, flavor=flavor).first()
    before = _quota_values(quota) if quota is not None else None
    if quota is None:
        quota = Quota(team=team, flavor=flavor)
    quota.guarantee = guarantee
    quota.borrow_limit = borrow_limit
    quota.lend_limit = lend_limit
    quota.save()
    after = _quota_values(quota)
    if before != after:
        audit(
            actor=actor,
            action="quota.set",
            obj=quota,
            team=team,
            before=before,
            after=after,
            reason=reason,
        )
    return quota


def quota_update(
    *,
    actor: AbstractBaseUser | None,
    quota: Quota,
    guarantee: int | Any = UNSET,
    borrow_limit: int | Any | None = UNSET,
    lend_limit: int | Any | None = UNSET,
    reason: str = "",
) -> Quota:
    """Change some fields of an existing quota; fields left out keep their value."""
    return quota_set(
        actor=actor,
        team=quota.team,
        flavor=quota.flavor,
        guarantee=quota.guarantee if guarantee is UNSET else guarantee,
        borrow_limit=quota.borrow_limit if borrow_limit is UNSET else borrow_limit,
        lend_limit=quota.lend_limit if lend_limit is UNSET else lend_limit,
        reason=reason,
    )


@transaction.atomic
def quota_delete(*, actor: AbstractBaseUser | None, quota: Quota) -> None:
    quota_validate(
        team=quota.team, flavor=quota.flavor, guarantee=0, borrow_limit=None, lend_limit=None
    )
    audit(
        actor=actor,
        action="quota.delete",
        obj=quota,
        team=quota.team,
        before=_quota_values(quota),
        after=None,
    )
    quota.delete()
