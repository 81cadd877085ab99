"""Browser pages for the team tree and quotas: the tree with usage, one team's
quotas and audit history, and the quota editor with its consequences preview.

Permissions are the API's: reads through the scoped selectors, edits only
where `Access.can_edit_quota_of` allows, writes only through the services.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from portal.web.quotas.forms import QuotaForm
from preemption.quota_preview import quota_preview as preview_change
from preemption.selectors import job_list, with_stop_reason
from preemption.templatetags.jobs import duration
from quotas.models import Membership, Quota, Team
from quotas.selectors import (
    access_for,
    audit_list,
    priority_allowance,
    quota_list,
    scheduling_policy,
    topology_levels,
)
from quotas.selectors import team_list as team_selector
from quotas.services import MIN_RUNTIME_FIELDS, quota_update
from telemetry.nodes import node_rows
from telemetry.selectors import flavor_names, team_rows


@login_required
def team_list(request: HttpRequest) -> HttpResponse:
    """The readable team tree with each team's quotas and current usage."""
    access = access_for(request.user)
    return render(
        request,
        "quotas/team_list.html",
        {
            "rows": team_rows(access=access),
            "flavors": flavor_names(),
            "nav": "teams",
        },
    )


@login_required
def node_list(request: HttpRequest) -> HttpResponse:
    """Every node with its flavor, GPUs, GPUs in use, whether it is schedulable or
    drained, and its topology. Every signed-in user reads it, as `/api/v1/nodes/`
    (cluster-wide figures, no team or job names); only admins change nodes, in the
    admin or through the API, so only they get the links to do so."""
    nodes = node_rows()
    flavors: dict[str, dict[str, int]] = {}
    for node in nodes:
        figures = flavors.setdefault(
            node.flavor, {"nodes": 0, "gpus": 0, "schedulable": 0, "drained": 0, "used": 0}
        )
        figures["nodes"] += 1
        figures["gpus"] += node.gpus
        figures["schedulable" if node.schedulable else "drained"] += node.gpus
        figures["used"] += node.used
    return render(
        request,
        "quotas/node_list.html",
        {
            "nodes": nodes,
            "flavor_totals": sorted(flavors.items()),
            "levels": list(topology_levels()),
            "can_change": access_for(request.user).is_admin,
            "nav": "nodes",
        },
    )


@login_required
def team_detail(request: HttpRequest, slug: str) -> HttpResponse:
    """One team: its quotas (editable where allowed), sub-teams, members, recent
    jobs and the audit history of its subtree's quotas."""
    team = get_object_or_404(team_selector(user=request.user), slug=slug)
    access = access_for(request.user)
    subtree = access.tree.subtree([team.pk])
    rows = team_rows(access=access, only_team_ids=subtree)
    own = next((row for row in rows if row.team_id == team.pk), None)
    children = [row for row in rows if row.parent_slug == team.slug]
    can_edit = access.can_edit_quota_of(team.pk)
    audit = list(audit_list(user=request.user).filter(team_id__in=subtree)[:50])
    for entry in audit:
        entry.changes = audit_changes(entry.before, entry.after)  # type: ignore[attr-defined]
    members = list(Membership.objects.filter(team=team).select_related("user"))
    jobs = list(with_stop_reason(job_list(user=request.user)).filter(team_id__in=subtree)[:10])
    ancestors = []
    for ancestor_id in reversed(access.tree.ancestors(team.pk)):
        if access.can_read_team(ancestor_id):
            ancestors.append(ancestor_id)
    ancestor_slugs = dict(
        team_selector(user=request.user).filter(id__in=ancestors).values_list("id", "slug")
    )
    return render(
        request,
        "quotas/team_detail.html",
        {
            "team": team,
            "own": own,
            "quota_flavors": [
                name for name, usage in (own.flavors.items() if own else []) if usage.has_quota
            ],
            "children": children,
            "child_can_edit": access.can_manage_team(team.pk),
            "can_edit": can_edit,
            "flavors": flavor_names(),
            "audit": audit,
            "members": members,
            "jobs": jobs,
            "breadcrumbs": [ancestor_slugs[a] for a in ancestors if a in ancestor_slugs],
            "allowance": priority_allowance(team=team, tree=access.tree),
            "nav": "teams",
        },
    )


def audit_changes(
    before: dict[str, Any] | None, after: dict[str, Any] | None
) -> list[tuple[str, Any, Any]]:
    """(field, before, after) for each field an audit entry records, naming
    fields (team, flavor) left out since the row already says them."""
    before = before or {}
    after = after or {}
    keys = [key for key in {**before, **after} if key not in {"team", "flavor"}]
    return [(key, before.get(key), after.get(key)) for key in keys if after]


def _editable_quota(request: HttpRequest, pk: int) -> Quota:
    quota = get_object_or_404(quota_list(user=request.user), pk=pk)
    if not access_for(request.user).can_edit_quota_of(quota.team_id):
        raise PermissionDenied("A team's own quota belongs to a manager above it.")
    return quota


def _preview(request: HttpRequest, quota: Quota, form: QuotaForm) -> dict[str, Any] | None:
    """The consequences of the edit, or None with the services' messages on the form.
    What concerns teams the user may not read is only counted or summed."""
    access = access_for(request.user)
    try:
        return preview_change(
            quota=quota,
            visible_team_ids=None if access.is_admin else set(access.readable_teams),
            **form.values(),
        )
    except ValidationError as error:
        form.add_service_errors(error)
        return None


def preview_context(consequences: dict[str, Any] | None) -> dict[str, Any]:
    """Rows for the preview template: the jobs that would be reclaimed, the jobs
    that would be admitted, and the fair shares that move."""
    if consequences is None:
        return {"consequences": None}
    moves = []
    for queue, flavors in sorted((consequences.get("fair_share") or {}).items()):
        for flavor, values in sorted(flavors.items()):
            before, after = values.get("before"), values.get("after")
            if before is None and after is None:
                continue
            moves.append(
                {
                    "queue": queue,
                    "flavor": flavor,
                    "before": before,
                    "after": after,
                    "delta": (after or 0) - (before or 0),
                }
            )
    changed = [move for move in moves if abs(move["delta"]) > 1e-9]
    reclaimed = [dict(item) for item in consequences.get("reclaimed") or []]
    admitted = consequences.get("admitted") or consequences.get("admissions") or []
    return {
        "consequences": consequences,
        "reclaimed": reclaimed,
        "admitted": admitted,
        "moves": changed,
        "unchanged_queues": len(moves) - len(changed),
        "change": consequences.get("change") or {},
        "non_preemptible": consequences.get("non_preemptible") or {},
        "decayed_usage": consequences.get("decayed_usage") or [],
        "exposed": consequences.get("exposed") or {},
        "reclaimed_elsewhere": consequences.get("reclaimed_elsewhere") or {},
        "admitted_elsewhere": consequences.get("admitted_elsewhere") or {},
        "fair_share_elsewhere": [
            {"flavor": flavor, **total, "delta": total["after"] - total["before"]}
            for flavor, total in sorted((consequences.get("fair_share_elsewhere") or {}).items())
            if abs(total["after"] - total["before"]) > 1e-9
        ],
        "decayed_usage_elsewhere": consequences.get("decayed_usage_elsewhere") or 0,
    }


REASON_NAMES = ("priority", "fair share", "reclaim", "consolidation")


def _seconds(value: float) -> str:
    return duration(timedelta(seconds=value)) if value else "none"


def scheduling_context(team: Team) -> dict[str, Any]:
    """What the scheduler applies to the team that only platform admins change, for the
    editor to show beside what a manager may edit: decayed usage and the minimum
    runtime per preemption reason, the cluster's and each of the team's classes'."""
    policy = scheduling_policy()
    defaults = [getattr(policy, field) for field in MIN_RUNTIME_FIELDS]
    classes = [
        {
            "name": pc.name,
            "minimums": [
                _seconds(own) if own is not None else f"{_seconds(default)} (cluster)"
                for own, default in zip(
                    (getattr(pc, field) for field in MIN_RUNTIME_FIELDS), defaults, strict=True
                )
            ],
        }
        for pc in priority_allowance(team=team).allowed
    ]
    return {
        "policy": {
            "usage_strength": policy.usage_strength,
            "half_life": _seconds(policy.usage_half_life_seconds),
            "minimums": [_seconds(value) for value in defaults],
        },
        "reason_names": REASON_NAMES,
        "class_minimums": classes,
    }


@login_required
def quota_edit(request: HttpRequest, pk: int) -> HttpResponse:
    """Edit a quota in two steps: preview the consequences, then save."""
    quota = _editable_quota(request, pk)
    consequences: dict[str, Any] | None = None
    if request.method == "POST":
        form = QuotaForm.for_quota(quota, request.POST)
        action = request.POST.get("action", "preview")
        if form.is_valid():
            if action == "save":
                try:
                    quota_update(
                        actor=request.user,
                        quota=quota,
                        reason=form.cleaned_data.get("reason") or "",
                        **form.values(),
                    )
                except ValidationError as error:
                    form.add_service_errors(error)
                else:
                    messages.success(
                        request, f"Saved the {quota.flavor.name} quota of {quota.team.slug}."
                    )
                    return redirect("team-detail", slug=quota.team.slug)
            else:
                consequences = _preview(request, quota, form)
        status = 200 if form.is_valid() else 400
    else:
        form = QuotaForm.for_quota(quota)
        status = 200
    context = {
        "quota": quota,
        "form": form,
        "nav": "teams",
        **preview_context(consequences),
        **scheduling_context(quota.team),
    }
    return render(request, "quotas/quota_edit.html", context, status=status)


@require_POST
@login_required
def quota_preview(request: HttpRequest, pk: int) -> HttpResponse:
    """The preview panel alone, for the editor's script: it validates like an
    edit and saves nothing."""
    quota = _editable_quota(request, pk)
    form = QuotaForm.for_quota(quota, request.POST)
    consequences = _preview(request, quota, form) if form.is_valid() else None
    status = 200 if form.is_valid() else 400
    return render(
        request,
        "quotas/_preview.html",
        {
            "quota": quota,
            "form": form,
            "partial": True,
            **preview_context(consequences),
        },
        status=status,
    )
