"""Writes to the cluster itself: flavors, nodes (with their topology labels) and the
cluster-wide scheduling policy. Keyword-only, one transaction each; never edits a
team, a quota or a priority class.
"""

from __future__ import annotations

import math
import re
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction

from quotas.job_ledger import job_ledger
from quotas.models import Node, ResourceFlavor, SchedulingPolicy
from quotas.selectors import node_topology, scheduling_policy, topology_levels
from quotas.services.audit import audit
from quotas.services.priority_classes import MIN_RUNTIME_FIELDS
from quotas.validation import MAX_GPUS


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
    audit(
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
    audit(
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
        audit(
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
    audit(
        actor=actor,
        action="node.delete",
        obj=node,
        team=None,
        before={"gpus": node.gpus},
        after=None,
    )
    node.delete()


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
    audit(
        actor=actor,
        action="scheduling_policy.update",
        obj=policy,
        team=None,
        before=before,
        after=_policy_values(policy),
        reason=reason,
    )
    return policy
