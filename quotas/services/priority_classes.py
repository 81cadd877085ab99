"""Writes to priority classes: saving and deleting a class, and its notice window.
Keyword-only, one transaction each; never edits which teams may use a class
(quotas.services.teams does).
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction

from quotas.models import DEFAULT_NOTICE_SECONDS, PriorityClass, Team
from quotas.services.audit import audit

# --- priority classes and memberships ----------------------------------------

# A class's own minimum runtime per preemption reason; None: the cluster's setting.
MIN_RUNTIME_FIELDS = (
    "priority_min_runtime_seconds",
    "fair_share_min_runtime_seconds",
    "reclaim_min_runtime_seconds",
    "consolidation_min_runtime_seconds",
)


def _priority_values(pc: PriorityClass) -> dict[str, Any]:
    return {
        "name": pc.name,
        "value": pc.value,
        "preemption_policy": pc.preemption_policy,
        "preemptible": pc.preemptible,
        "grace_seconds": pc.grace_seconds,
        "notice_seconds": pc.notice_seconds,
        "min_runtime_seconds": pc.min_runtime_seconds,
        **{field: getattr(pc, field) for field in MIN_RUNTIME_FIELDS},
        "shrink_elastic": pc.shrink_elastic,
        "is_default": pc.is_default,
    }


def notice_window_validate(*, notice_seconds: int, grace_seconds: int) -> None:
    """The checkpoint notice is part of the grace budget: the eviction that follows
    it needs some of the budget left for its own (short) save, so a window must be
    shorter than the grace period, or 0 for no notice."""
    if notice_seconds and notice_seconds >= grace_seconds:
        raise ValidationError(
            {
                "notice_seconds": [
                    f"Must be shorter than the grace period ({grace_seconds} s), since the notice "
                    f"is part of it, or 0 for no notice (got {notice_seconds})."
                ]
            }
        )


def default_notice_seconds(grace_seconds: int) -> int:
    """The notice window of a new class that names none: the default, or half the
    grace period where that is shorter, so that a short grace period stays valid."""
    return min(DEFAULT_NOTICE_SECONDS, grace_seconds // 2)


@transaction.atomic
def priority_class_save(
    *, actor: AbstractBaseUser | None, priority_class: PriorityClass
) -> PriorityClass:
    """Create or update a priority class; a new default replaces the old one."""
    if priority_class.preemption_policy not in PriorityClass.Policy.values:
        raise ValidationError({"preemption_policy": ["Must be PreemptLowerPriority or Never."]})
    for field in ("grace_seconds", "notice_seconds", "min_runtime_seconds", *MIN_RUNTIME_FIELDS):
        value = getattr(priority_class, field)
        if value is None and field in MIN_RUNTIME_FIELDS:
            continue
        if value is None or value < 0 or value > 7 * 24 * 3600:
            raise ValidationError({field: [f"Must be between 0 and 604800 seconds (got {value})."]})
    notice_window_validate(
        notice_seconds=priority_class.notice_seconds, grace_seconds=priority_class.grace_seconds
    )
    if abs(priority_class.value) > 1_000_000_000:
        raise ValidationError(
            {"value": ["Must be between -1000000000 and 1000000000 (as in Kubernetes)."]}
        )
    before = None
    if priority_class.pk:
        before = _priority_values(PriorityClass.objects.get(pk=priority_class.pk))
    elif PriorityClass.objects.filter(name=priority_class.name).exists():
        raise ValidationError(
            {"name": [f"A priority class named {priority_class.name!r} already exists."]}
        )
    if priority_class.is_default:
        PriorityClass.objects.filter(is_default=True).exclude(pk=priority_class.pk).update(
            is_default=False
        )
    priority_class.full_clean(validate_unique=False, validate_constraints=False)
    priority_class.save()
    audit(
        actor=actor,
        action="priority_class.save",
        obj=priority_class,
        team=None,
        before=before,
        after=_priority_values(priority_class),
    )
    return priority_class


@transaction.atomic
def priority_class_delete(*, actor: AbstractBaseUser | None, priority_class: PriorityClass) -> None:
    if priority_class.jobs.exists():
        raise ValidationError(
            {"priority_class": [f"{priority_class.name} is used by jobs and cannot be deleted."]}
        )
    # A team whose own list held only this class would be left with an empty
    # list, which means "the parent's classes": deleting would widen it.
    only_class = [
        team.slug
        for team in Team.objects.filter(priority_classes=priority_class).prefetch_related(
            "priority_classes"
        )
        if len(team.priority_classes.all()) == 1
    ]
    if only_class:
        raise ValidationError(
            {
                "priority_class": [
                    f"{priority_class.name} is the only class teams {', '.join(sorted(only_class))} "
                    "may use; give them another class first."
                ]
            }
        )
    audit(
        actor=actor,
        action="priority_class.delete",
        obj=priority_class,
        team=None,
        before=_priority_values(priority_class),
        after=None,
    )
    priority_class.delete()
