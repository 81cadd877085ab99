"""Django admin for the cluster's configuration. Quota edits go through the
same validation as the API and the pages, and leave an audit row."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.core.exceptions import ValidationError
from django.http import HttpRequest

from preemption.runtimes.sandbox import format_size, parse_size
from quotas import services
from quotas.models import (
    RANK_FILE_SIZE_MIN,
    RANK_MEMORY_PER_GPU_MIN,
    RANK_PIDS_MIN,
    AuditEntry,
    Membership,
    Node,
    PriorityClass,
    Quota,
    ResourceFlavor,
    SchedulingPolicy,
    Team,
)
from quotas.selectors import node_topology, scheduling_policy, topology_levels


class SizeField(forms.CharField):
    """Bytes, typed as `512M` or `64G` (binary units) and shown the same way; empty
    means none. Refuses anything else, or less than `minimum`, saying so."""

    def __init__(self, *, minimum: int, **kwargs: Any) -> None:
        super().__init__(required=False, **kwargs)
        self.minimum = minimum

    def prepare_value(self, value: Any) -> Any:
        if isinstance(value, int):
            return format_size(value)
        return value

    def to_python(self, value: Any) -> int | None:  # type: ignore[override]
        text = str(super().to_python(value)).strip()
        if not text:
            return None
        try:
            size = parse_size(text)
        except ValueError:
            raise forms.ValidationError(
                f"{text!r} is not a size: give a number with K, M, G or T, such as 512M or 64G."
            ) from None
        if size < self.minimum:
            raise forms.ValidationError(
                f"{text} is too small: a rank needs at least {format_size(self.minimum)}."
            )
        return size


class ResourceFlavorAdminForm(forms.ModelForm):  # type: ignore[type-arg]
    """A flavor with its ranks' sandbox limits on the local runtime, sizes in binary units."""

    rank_pids_max = forms.IntegerField(
        required=False,
        min_value=RANK_PIDS_MIN,
        label="Rank processes max",
        help_text="Processes and threads a rank may have at once; empty: the site's "
        "QM_RANK_PIDS_MAX.",
    )
    rank_memory_per_gpu = SizeField(
        minimum=RANK_MEMORY_PER_GPU_MIN,
        label="Rank memory per GPU",
        help_text="Memory a rank may hold per GPU it has, such as 32G; empty: the site's "
        "QM_RANK_MEMORY_MAX per rank. A rank past it is killed by the kernel.",
    )
    rank_file_size_max = SizeField(
        minimum=RANK_FILE_SIZE_MIN,
        label="Rank largest file",
        help_text="The largest file a rank may write, such as 100G; empty: the site's "
        "QM_RANK_FILE_SIZE_MAX.",
    )

    class Meta:
        model = ResourceFlavor
        fields = [
            "name",
            "description",
            "rank_pids_max",
            "rank_memory_per_gpu",
            "rank_file_size_max",
        ]


@admin.register(ResourceFlavor)
class ResourceFlavorAdmin(admin.ModelAdmin):
    form = ResourceFlavorAdminForm
    list_display = ["name", "description", "rank_limits"]
    search_fields = ["name"]

    @admin.display(description="rank limits (local runtime)")
    def rank_limits(self, obj: ResourceFlavor) -> str:
        limits = [
            f"{obj.rank_pids_max} processes" if obj.rank_pids_max else "",
            f"{format_size(obj.rank_memory_per_gpu)} per GPU" if obj.rank_memory_per_gpu else "",
            f"files up to {format_size(obj.rank_file_size_max)}" if obj.rank_file_size_max else "",
        ]
        return ", ".join(limit for limit in limits if limit) or "the site's"


class NodeAdminForm(forms.ModelForm):  # type: ignore[type-arg]
    """A node with one field per topology level (`NodeAdmin.get_form` adds them), written
    into its labels by the same rule as the API (`services.topology_to_labels`)."""

    class Meta:
        model = Node
        fields = ["name", "flavor", "gpus", "labels", "schedulable"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            for level, domain in node_topology(self.instance).items():
                self.initial[f"topology_{level}"] = domain

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        topology = {level: cleaned.get(f"topology_{level}") or None for level in topology_levels()}
        labels = cleaned.get("labels") if isinstance(cleaned.get("labels"), dict) else {}
        try:
            cleaned["labels"] = services.topology_to_labels(labels=labels, topology=topology)
        except ValidationError as error:
            raise forms.ValidationError(error.message_dict["topology"]) from None
        return cleaned


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    form = NodeAdminForm
    list_display = ["name", "flavor", "gpus", "topology", "schedulable"]
    list_filter = ["flavor", "schedulable"]
    search_fields = ["name"]

    @admin.display(description="topology")
    def topology(self, obj: Node) -> str:
        return " / ".join(f"{level} {domain}" for level, domain in node_topology(obj).items())

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> Any:
        # One field per level of this deployment's QM_TOPOLOGY_LABELS.
        fields = {
            f"topology_{level}": forms.CharField(
                required=False,
                max_length=63,
                label=f"{level} domain",
                help_text=f"Stored as the node label {key}; empty: none.",
            )
            for level, key in topology_levels().items()
        }
        kwargs["form"] = type("NodeTopologyForm", (NodeAdminForm,), fields)
        return super().get_form(request, obj, change, **kwargs)

    def save_model(self, request: HttpRequest, obj: Node, form: Any, change: bool) -> None:
        saved = services.node_upsert(
            actor=request.user,
            name=obj.name,
            flavor=obj.flavor,
            gpus=obj.gpus,
            labels=obj.labels,
            schedulable=obj.schedulable,
        )
        obj.pk = saved.pk


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
        fields = [
            "slug",
            "name",
            "parent",
            "weight",
            "priority_classes",
            "default_priority_class",
            "max_queued_jobs",
        ]

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
    list_display = ["slug", "name", "parent", "weight", "default_priority_class", "max_queued_jobs"]
    list_filter = ["parent"]
    search_fields = ["slug", "name"]
    filter_horizontal = ["priority_classes"]
    inlines = [QuotaInline, MembershipInline]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # A new team starts with its parent's classes; they are changed on the
        # team's own page, where the service can check them against the tree.
        fields = ["slug", "name", "parent", "weight", "max_queued_jobs"]
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
        "shrink_elastic",
        "is_default",
    ]
    list_filter = ["preemptible", "preemption_policy", "shrink_elastic"]


class SchedulingPolicyAdminForm(forms.ModelForm):  # type: ignore[type-arg]
    class Meta:
        model = SchedulingPolicy
        fields = [
            "usage_strength",
            "usage_half_life_seconds",
            *services.MIN_RUNTIME_FIELDS,
        ]

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        # The service's rules, so the admin cannot save what the API refuses.
        for field, messages in services.scheduling_policy_errors(
            {field: cleaned[field] for field in self.Meta.fields if field in cleaned}
        ).items():
            for message in messages:
                self.add_error(field, message)
        return cleaned


@admin.register(SchedulingPolicy)
class SchedulingPolicyAdmin(admin.ModelAdmin):
    """The one row of the cluster's scheduling policy. Before it is first saved the
    deployment's settings are in force, and the add form starts from them."""

    form = SchedulingPolicyAdminForm
    list_display = [
        "__str__",
        "usage_strength",
        "usage_half_life_seconds",
        *services.MIN_RUNTIME_FIELDS,
        "updated_at",
    ]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return super().has_add_permission(request) and not SchedulingPolicy.objects.exists()

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_changeform_initial_data(self, request: HttpRequest) -> dict[str, Any]:
        policy = scheduling_policy()
        return {field: getattr(policy, field) for field in SchedulingPolicyAdminForm.Meta.fields}

    def save_model(
        self, request: HttpRequest, obj: SchedulingPolicy, form: Any, change: bool
    ) -> None:
        saved = services.scheduling_policy_update(
            actor=request.user,
            **{field: form.cleaned_data[field] for field in SchedulingPolicyAdminForm.Meta.fields},
        )
        obj.pk = saved.pk


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
