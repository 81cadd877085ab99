"""Django admin for the cluster's configuration. Quota edits go through the
same validation as the API and the pages, and leave an audit row."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.core.exceptions import ValidationError
from django.http import HttpRequest

from quotas import services
from quotas.models import AuditEntry, Membership, Node, PriorityClass, Quota, ResourceFlavor, Team


@admin.register(ResourceFlavor)
class ResourceFlavorAdmin(admin.ModelAdmin):
    list_display = ["name", "description"]
    search_fields = ["name"]


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["name", "flavor", "gpus", "schedulable"]
    list_filter = ["flavor", "schedulable"]
    search_fields = ["name"]


class QuotaInline(admin.TabularInline):
    model = Quota
    extra = 0
    fields = ["flavor", "guarantee", "borrow_limit", "lend_limit"]
    readonly_fields = fields
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "parent", "weight"]
    list_filter = ["parent"]
    search_fields = ["slug", "name"]
    inlines = [QuotaInline, MembershipInline]


class QuotaAdminForm(forms.ModelForm):  # type: ignore[type-arg]
    class Meta:
        model = Quota
        fields = ["team", "flavor", "guarantee", "borrow_limit", "lend_limit"]

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if self.errors or "team" not in cleaned or "flavor" not in cleaned:
            return cleaned
        # The service's rules, so the admin cannot save what the API refuses.
        services.quota_validate(
            team=cleaned["team"],
            flavor=cleaned["flavor"],
            guarantee=cleaned.get("guarantee") or 0,
            borrow_limit=cleaned.get("borrow_limit"),
            lend_limit=cleaned.get("lend_limit"),
        )
        return cleaned


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin):
    form = QuotaAdminForm
    list_display = ["team", "flavor", "guarantee", "borrow_limit", "lend_limit", "updated_at"]
    list_filter = ["flavor"]
    search_fields = ["team__slug"]

    def save_model(self, request: HttpRequest, obj: Quota, form: Any, change: bool) -> None:
        saved = services.quota_set(
            actor=request.user,
            team=obj.team,
            flavor=obj.flavor,
            guarantee=obj.guarantee,
            borrow_limit=obj.borrow_limit,
            lend_limit=obj.lend_limit,
        )
        obj.pk = saved.pk

    def delete_model(self, request: HttpRequest, obj: Quota) -> None:
        try:
            services.quota_delete(actor=request.user, quota=obj)
        except ValidationError as error:
            self.message_user(request, "; ".join(error.messages), level="error")


@admin.register(PriorityClass)
class PriorityClassAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "value",
        "preemption_policy",
        "preemptible",
        "grace_seconds",
        "is_default",
    ]
    list_filter = ["preemptible", "preemption_policy"]


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "team", "role"]
    list_filter = ["role", "team"]
    search_fields = ["user__username", "team__slug"]
    autocomplete_fields = ["user", "team"]


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    list_display = ["at", "actor", "action", "object_repr", "team"]
    list_filter = ["action", "object_type"]
    search_fields = ["object_repr", "actor__username"]
    date_hierarchy = "at"

    # The audit log is a record of what happened: nobody edits it afterwards.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
