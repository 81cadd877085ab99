"""Django admin for jobs and their history. History rows are read-only here:
the scheduling cycle and the reconcilers own them."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.http import HttpRequest

from preemption.models import (
    Attempt,
    Checkpoint,
    Job,
    PreemptionEvent,
    Rank,
    RankLogTail,
    TrapEvent,
    Webhook,
    WebhookDelivery,
)
from preemption.services import topology_errors
from preemption.webhooks import destination_refusal


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows the system writes: visible to admins, changed only by the system."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class AttemptInline(admin.TabularInline):
    model = Attempt
    extra = 0
    fields = ["number", "placement", "borrowed_gpus", "admitted_at", "ended_at", "end_reason"]
    readonly_fields = fields
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class JobAdminForm(forms.ModelForm):  # type: ignore[type-arg]
    # No Meta: the admin builds it with every field that is not read-only.

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        # The submission's rule: only a level this cluster's nodes are labelled with.
        for field, messages in topology_errors(
            cleaned.get("topology_level", ""), cleaned.get("topology_required", True)
        ).items():
            for message in messages:
                self.add_error(field, message)
        return cleaned


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    form = JobAdminForm
    list_display = [
        "id",
        "name",
        "team",
        "submitter",
        "priority_class",
        "flavor",
        "ranks",
        "gpus_per_rank",
        "state",
        "submitted_at",
    ]
    list_filter = ["state", "priority_class", "flavor", "team"]
    search_fields = ["name", "command", "submitter__username", "team__slug"]
    date_hierarchy = "submitted_at"
    readonly_fields = [
        "state",
        "submitted_at",
        "admitted_at",
        "running_at",
        "preempting_at",
        "requeued_at",
        "finished_at",
        "cancel_requested_at",
        "waiting_reason",
        "failure_reason",
        "resume_step",
        "checkpoint_dir",
    ]
    inlines = [AttemptInline]


class RankInline(admin.TabularInline):
    model = Rank
    extra = 0
    fields = [
        "index",
        "node",
        "state",
        "exit_code",
        "pid",
        "pod_name",
        "signal_sent_at",
        "signal_received_at",
        "exited_at",
    ]
    readonly_fields = fields
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Attempt)
class AttemptAdmin(ReadOnlyAdmin):
    list_display = ["job", "number", "borrowed_gpus", "admitted_at", "ended_at", "end_reason"]
    list_filter = ["end_reason"]
    inlines = [RankInline]


@admin.register(Rank)
class RankAdmin(ReadOnlyAdmin):
    list_display = ["attempt", "index", "node", "state", "exit_code", "exited_at"]
    list_filter = ["state"]


@admin.register(RankLogTail)
class RankLogTailAdmin(ReadOnlyAdmin):
    list_display = ["attempt", "rank", "first_byte", "saved_at"]
    # The saved log itself is read on the job page, where every log read is
    # scoped and bounded; the admin lists only which tails were kept.
    exclude = ["content"]


@admin.register(PreemptionEvent)
class PreemptionEventAdmin(ReadOnlyAdmin):
    list_display = [
        "job",
        "reason",
        "preemptor",
        "decided_at",
        "deadline",
        "outcome",
        "checkpoint_step",
        "lost_gpu_seconds",
    ]
    list_filter = ["reason", "outcome"]
    date_hierarchy = "decided_at"


@admin.register(Checkpoint)
class CheckpointAdmin(ReadOnlyAdmin):
    list_display = ["job", "attempt", "step", "bytes", "seconds", "committed_at"]


class WebhookAdminForm(forms.ModelForm):  # type: ignore[type-arg]
    """The admin's webhook form refuses the destinations the API refuses, and treats the
    signing secret as write-only: the page never shows it (as the API only says whether
    one is set), a blank field keeps the current one, and removing it is explicit."""

    # An address typed without its scheme is read as https, as the API's callers write
    # it out in full anyway (Django's own default until 6.0 is http).
    url = Webhook._meta.get_field("url").formfield(label="URL", assume_scheme="https")
    secret = forms.CharField(
        required=False,
        max_length=64,
        strip=False,
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "new-password"}),
        help_text="Write-only. Leave blank to keep the current secret.",
    )
    remove_secret = forms.BooleanField(
        required=False, label="Remove the secret", help_text="Deliveries go out unsigned."
    )

    class Meta:
        model = Webhook
        fields = ["team", "url", "secret", "events", "active"]

    def clean_url(self) -> str:
        url: str = self.cleaned_data["url"]
        refusal = destination_refusal(url)
        if refusal is not None:
            raise forms.ValidationError(refusal)
        return url

    def clean(self) -> dict[str, Any]:
        cleaned: dict[str, Any] = super().clean() or {}
        if cleaned.get("remove_secret"):
            if cleaned.get("secret"):
                self.add_error("secret", "Either a new secret or its removal, not both.")
            cleaned["secret"] = ""
        elif not cleaned.get("secret"):
            cleaned["secret"] = self.instance.secret if self.instance.pk else ""
        return cleaned


@admin.register(Webhook)
class WebhookAdmin(admin.ModelAdmin):
    form = WebhookAdminForm
    # The origin only: a webhook URL may carry a credential in its path.
    list_display = ["team", "origin", "active", "created_at"]
    list_filter = ["active"]


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(ReadOnlyAdmin):
    list_display = [
        "webhook",
        "event",
        "tries",
        "next_try_at",
        "delivered_at",
        "given_up_at",
        "last_error",
    ]
    list_filter = ["event"]


@admin.register(TrapEvent)
class TrapEventAdmin(ReadOnlyAdmin):
    list_display = ["job", "attempt", "rank", "event", "step", "at", "source", "received_at"]
    list_filter = ["event", "source"]
