"""Every write to the cluster's configuration. Each service is keyword-only,
runs in one transaction, validates before it writes (a rejected change leaves
the database untouched) and writes an audit row when a person acted."""

from __future__ import annotations

import math
import re
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction

from core.access import TeamTree
from quotas.job_ledger import job_ledger
from quotas.limits import QueuedJobLimit, queued_job_limits
from quotas.models import (
    DEFAULT_NOTICE_SECONDS,
    AuditEntry,
    Membership,
    Node,
    PriorityClass,
    Quota,
    ResourceFlavor,
    SchedulingPolicy,
    Team,
)
from quotas.selectors import (
    PriorityAllowance,
    node_topology,
    priority_allowance,
    scheduling_policy,
    team_tree,
    topology_levels,
)
from quotas.validation import MAX_GPUS, check_weight, guarantee_range, quota_ranges

UNSET: Any = object()


def _audit(
    *,
    actor: AbstractBaseUser | None,
    action: str,
    obj: Any,
    team: Team | None,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    reason: str = "",
) -> None:
    AuditEntry.objects.create(
        actor=actor if actor is not None and actor.is_authenticated else None,
        action=action,
        object_type=type(obj)._meta.model_name,
        object_id=str(obj.pk),
        object_repr=str(obj)[:200],
        team=team,
        before=before,
        after=after,
        reason=reason.strip()[:300],
    )


def _quota_values(quota: Quota) -> dict[str, Any]:
    return {
        "team": quota.team.slug,
        "flavor": quota.flavor.name,
        "guarantee": quota.guarantee,
        "borrow_limit": quota.borrow_limit,
        "lend_limit": quota.lend_limit,
    }


def _team_values(team: Team) -> dict[str, Any]:
    return {
        "slug": team.slug,
        "name": team.name,
        "weight": team.weight,
        "parent": team.parent.slug if team.parent_id else None,
        "max_queued_jobs": team.max_queued_jobs,
    }


def _check_count(field: str, value: int | None, *, allow_none: bool = False) -> None:
    if value is None:
        if not allow_none:
            raise ValidationError({field: ["This field is required."]})
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError({field: ["Must be a whole number."]})
    if value < 0:
        raise ValidationError({field: [f"Must not be negative (got {value})."]})
    if value > MAX_GPUS:
        raise ValidationError({field: [f"Must be at most {MAX_GPUS} GPUs (got {value})."]})


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


# --- flavors and nodes -----------------------------------------------------


@transaction.atomic
def flavor_create(
    *, actor: AbstractBaseUser | None, name: str, description: str = ""
) -> ResourceFlavor:
    if ResourceFlavor.objects.filter(name=name).exists():
        raise ValidationError({"name": [f"A flavor named {name!r} already exists."]})
    flavor = ResourceFlavor(name=name, description=description)
    flavor.full_clean()
    flavor.save()
    _audit(
        actor=actor,
        action="flavor.create",
        obj=flavor,
        team=None,
        before=None,
        after={"name": name},
    )
    return flavor


# A topology domain is stored as a node label value, so it follows Kubernetes' rule
# for label values: up to 63 characters, alphanumerics inside with - _ . between.
DOMAIN_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def topology_to_labels(*, labels: dict[str, str], topology: Any) -> dict[str, str]:
    """`labels` with the node's domain at each level of `topology` written under the
    level's label key (`QM_TOPOLOGY_LABELS`); a level set to null or "" is removed.

    Refuses, under the field `topology`, a level the cluster does not have and a domain
    that is not a label value; levels left out keep their labels.
    """
    levels = topology_levels()
    if not isinstance(topology, dict):
        raise ValidationError({"topology": ["Must be an object of level to domain."]})
    errors = []
    merged = dict(labels)
    for level, domain in topology.items():
        if level not in levels:
            known = ", ".join(levels) or "none (QM_TOPOLOGY_LABELS is empty)"
            errors.append(f"Unknown topology level {level!r}; the levels are: {known}.")
        elif domain is None or domain == "":
            merged.pop(levels[level], None)
        elif not isinstance(domain, str) or not DOMAIN_NAME.fullmatch(domain):
            errors.append(
                f"The {level} domain {domain!r} is not a label value: up to 63 letters, "
                "digits, '-', '_' or '.', starting and ending with a letter or digit."
            )
        else:
            merged[levels[level]] = domain
    if errors:
        raise ValidationError({"topology": errors})
    return merged


def _node_values(node: Node) -> dict[str, Any]:
    return {
        "flavor": node.flavor.name,
        "gpus": node.gpus,
        "schedulable": node.schedulable,
        "topology": node_topology(node),
    }


@transaction.atomic
def node_upsert(
    *,
    actor: AbstractBaseUser | None,
    name: str,
    flavor: ResourceFlavor,
    gpus: int,
    labels: dict[str, str] | None = None,
    schedulable: bool = True,
    topology: dict[str, str | None] | None = None,
) -> Node:
    """Add or change a node. `topology` ({level: domain}) is written into its labels
    under each level's label key, after `labels`."""
    _check_count("gpus", gpus)
    labels = labels or {}
    if topology is not None:
        labels = topology_to_labels(labels=labels, topology=topology)
    node = Node.objects.select_for_update().filter(name=name).first()
    before = None
    if node is None:
        node = Node(name=name)
    else:
        before = _node_values(node)
    node.flavor = flavor
    node.gpus = gpus
    node.labels = labels
    node.schedulable = schedulable
    node.full_clean()
    node.save()
    _audit(
        actor=actor,
        action="node.upsert",
        obj=node,
        team=None,
        before=before,
        after=_node_values(node),
    )
    return node


@transaction.atomic
def node_topology_sync(*, topology_by_node: dict[str, dict[str, str]]) -> list[str]:
    """Write each node's topology as the runtime reports it (the Kubernetes nodes'
    labels, the local runtime's inventory) into its labels, under the level's label key;
    a level the runtime no longer reports is removed. Nodes the runtime does not report
    keep theirs. Returns the names of the nodes that changed, each audited as the
    system's change. A level the cluster does not have or a domain that is not a label
    value refuses the whole sync (ValidationError naming the node)."""
    levels = topology_levels()
    changed = []
    for node in Node.objects.select_for_update().filter(name__in=topology_by_node).order_by("name"):
        reported = topology_by_node[node.name]
        topology: dict[str, str | None] = {level: None for level in levels}
        topology.update(reported)
        labels = node.labels if isinstance(node.labels, dict) else {}
        try:
            merged = topology_to_labels(labels=labels, topology=topology)
        except ValidationError as error:
            raise ValidationError(
                {"topology": [f"node {node.name}: {m}" for m in error.message_dict["topology"]]}
            ) from None
        if merged == labels:
            continue
        before = _node_values(node)
        node.labels = merged
        node.save(update_fields=["labels"])
        _audit(
            actor=None,
            action="node.topology",
            obj=node,
            team=None,
            before=before,
            after=_node_values(node),
        )
        changed.append(node.name)
    return changed


@transaction.atomic
def node_delete(*, actor: AbstractBaseUser | None, node: Node) -> None:
    if job_ledger().node_runs_active_ranks(node.name):
        raise ValidationError({"node": [f"Node {node.name} still runs ranks of active jobs."]})
    _audit(
        actor=actor,
        action="node.delete",
        obj=node,
        team=None,
        before={"gpus": node.gpus},
        after=None,
    )
    node.delete()


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
    _audit(
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
            _validate_guarantee_in_tree(team=team, flavor=quota.flavor, guarantee=quota.guarantee)
    _audit(
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
    _audit(
        actor=actor,
        action="team.delete",
        obj=team,
        team=team.parent,
        before=_team_values(team),
        after=None,
    )
    team.delete()


# --- quotas ----------------------------------------------------------------


def _validate_guarantee_in_tree(*, team: Team, flavor: ResourceFlavor, guarantee: int) -> None:
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
        _audit(
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
    _audit(
        actor=actor,
        action="quota.delete",
        obj=quota,
        team=quota.team,
        before=_quota_values(quota),
        after=None,
    )
    quota.delete()


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
    _audit(
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
    _audit(
        actor=actor,
        action="priority_class.delete",
        obj=priority_class,
        team=None,
        before=_priority_values(priority_class),
        after=None,
    )
    priority_class.delete()


# --- the cluster-wide scheduling policy ------------------------------------------

MAX_USAGE_STRENGTH = 10.0
MIN_HALF_LIFE_SECONDS = 60.0
MAX_HALF_LIFE_SECONDS = 365 * 86_400.0
MAX_MIN_RUNTIME_SECONDS = 7 * 24 * 3600


def _policy_values(policy: SchedulingPolicy) -> dict[str, Any]:
    return {
        "usage_strength": policy.usage_strength,
        "usage_half_life_seconds": policy.usage_half_life_seconds,
        **{field: getattr(policy, field) for field in MIN_RUNTIME_FIELDS},
    }


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def scheduling_policy_errors(changes: dict[str, Any]) -> dict[str, list[str]]:
    errors: dict[str, list[str]] = {}
    for field, value in changes.items():
        if field == "usage_strength":
            if not _number(value) or not 0 <= value <= MAX_USAGE_STRENGTH:
                errors[field] = [
                    f"Must be a number from 0 (weight alone) to {MAX_USAGE_STRENGTH:g} "
                    f"(got {value!r})."
                ]
        elif field == "usage_half_life_seconds":
            if not _number(value) or not MIN_HALF_LIFE_SECONDS <= value <= MAX_HALF_LIFE_SECONDS:
                errors[field] = [
                    f"Must be from {MIN_HALF_LIFE_SECONDS:g} seconds to "
                    f"{MAX_HALF_LIFE_SECONDS:g} (a year) (got {value!r})."
                ]
        elif field in MIN_RUNTIME_FIELDS:
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_MIN_RUNTIME_SECONDS
            ):
                errors[field] = [
                    f"Must be a whole number of seconds from 0 to {MAX_MIN_RUNTIME_SECONDS} "
                    f"(got {value!r})."
                ]
        else:
            errors[field] = ["Not a setting of the scheduling policy."]
    return errors


@transaction.atomic
def scheduling_policy_update(
    *, actor: AbstractBaseUser | None, reason: str = "", **changes: Any
) -> SchedulingPolicy:
    """Change the cluster-wide scheduling policy (admins only): decayed usage's
    strength and half-life and the minimum runtime per preemption reason.

    Every field is checked before anything is written, so one bad value refuses the
    whole change; the first change saves the deployment's settings with it.
    """
    if actor is not None and not (actor.is_authenticated and getattr(actor, "is_staff", False)):
        raise PermissionDenied("Only platform admins change the cluster's scheduling policy.")
    if errors := scheduling_policy_errors(changes):
        raise ValidationError(errors)
    SchedulingPolicy.objects.select_for_update().filter(pk=SchedulingPolicy.SINGLETON).first()
    policy = scheduling_policy()
    # Before the first save the deployment's settings are the policy in force.
    before = _policy_values(policy)
    for field, value in changes.items():
        setattr(policy, field, float(value) if field.startswith("usage_") else value)
    policy.save()
    _audit(
        actor=actor,
        action="scheduling_policy.update",
        obj=policy,
        team=None,
        before=before,
        after=_policy_values(policy),
        reason=reason,
    )
    return policy


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
    _audit(
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
        _audit(
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
    _audit(
        actor=actor,
        action="membership.set",
        obj=membership,
        team=team,
        before=None,
        after={"user": user.get_username(), "role": role},
    )
    return membership
