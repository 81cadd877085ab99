"""Every write to the cluster's configuration. Each service is keyword-only,
runs in one transaction, validates before it writes (a rejected change leaves
the database untouched) and writes an audit row when a person acted.

The services live by what they edit: quotas.services.cluster (flavors, nodes,
the scheduling policy), .teams (the team tree, a team's priority classes,
memberships), .quotas and .priority_classes; .audit holds the audit row they
share. This package re-exports the entry points other apps call."""

from quotas.services.audit import UNSET
from quotas.services.cluster import (
    MAX_USAGE_STRENGTH,
    MIN_HALF_LIFE_SECONDS,
    flavor_create,
    node_delete,
    node_topology_sync,
    node_upsert,
    scheduling_policy_errors,
    scheduling_policy_update,
    topology_to_labels,
)
from quotas.services.priority_classes import (
    MIN_RUNTIME_FIELDS,
    default_notice_seconds,
    notice_window_validate,
    priority_class_delete,
    priority_class_save,
)
from quotas.services.quotas import quota_delete, quota_set, quota_update, quota_validate
from quotas.services.teams import (
    MAX_QUEUED_JOBS,
    membership_set,
    team_create,
    team_delete,
    team_priority_classes_set,
    team_update,
)

__all__ = [
    "MAX_QUEUED_JOBS",
    "MAX_USAGE_STRENGTH",
    "MIN_HALF_LIFE_SECONDS",
    "MIN_RUNTIME_FIELDS",
    "UNSET",
    "default_notice_seconds",
    "flavor_create",
    "membership_set",
    "node_delete",
    "node_topology_sync",
    "node_upsert",
    "notice_window_validate",
    "priority_class_delete",
    "priority_class_save",
    "quota_delete",
    "quota_set",
    "quota_update",
    "quota_validate",
    "scheduling_policy_errors",
    "scheduling_policy_update",
    "team_create",
    "team_delete",
    "team_priority_classes_set",
    "team_update",
    "topology_to_labels",
]
