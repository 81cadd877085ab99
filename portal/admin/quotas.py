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


class TeamAdminForm(forms.ModelForm):  # type: ignore[type-arg]
    class Meta:
        model = Team
        fields = ["slug", "name", "parent", "weight", "priority_classes", "default_priority_class"]

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if self.errors or self.instance.pk is None or "priority_classes" not in cleaned:
            return cleaned
        # The service's rules, tried and rolled back, so the admin cannot save
        # a list the API refuses (a class the parent lacks, a default outside it).
        services.team_priority_classes_set(
            actor=None,
            team=self.instance,
            priority_classes=list(cleaned["priority_classes"]),
            default_priority_class=cleaned.get("default_priority_class"),
            may_widen=True,
            dry_run=True,
        )
        return cleaned


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    form = TeamAdminForm
    list_display = ["slug", "name", "parent", "weight", "default_priority_class"]
    list_filter = ["parent"]
    search_fields = ["slug", "name"]
    filter_horizontal = ["priority_classes"]
    inlines = [QuotaInline, MembershipInline]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # A new team starts with its parent's classes; they are changed on the
        # team's own page, where the service can check them against the tree.
        fields = ["slug", "name", "parent", "weight"]
        return fields if obj is None else [*fields, "priority_classes", "default_priority_class"]

    def save_model(self, request: HttpRequest, obj: Team, form: Any, change: bool) -> None:
        if change:
            # The default class is written by the service in save_related, with
            # its audit row; the plain save keeps the stored one.
            obj.default_priority_class_id = (
                Team.objects.filter(pk=obj.pk).values_list("default_priority_class_id", flat=True)
            ).first()
        super().save_model(request, obj, form, change)

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        allowance = {
            key: form.cleaned_data.pop(key)
            for key in ("priority_classes", "default_priority_class")
            if key in form.cleaned_data
        }
        super().save_related(request, form, formsets, change)
        if allowance:
            # Through the service, so the change is checked again and audited.
            services.team_priority_classes_set(
                actor=request.user,
                team=form.instance,
                priority_classes=list(allowance["priority_classes"]),
                default_priority_class=allowance.get("default_priority_class"),
                may_widen=True,
            )


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


class PriorityClassForm(forms.ModelForm):  # type: ignore[type-arg]
    """The notice window is checked against the grace period as the API checks it."""

    class Meta:
        model = PriorityClass
        exclude: list[str] = []

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        notice, grace = cleaned.get("notice_seconds"), cleaned.get("grace_seconds")
        if notice is not None and grace is not None:
            try:
                services.notice_window_validate(notice_seconds=notice, grace_seconds=grace)
            except ValidationError as error:
                self.add_error(None, error)
        return cleaned


@admin.register(PriorityClass)
class PriorityClassAdmin(admin.ModelAdmin):
    form = PriorityClassForm
    list_display = [
        "name",
        "value",
        "preemption_policy",
        "preemptible",
        "grace_seconds",
        "notice_seconds",
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
