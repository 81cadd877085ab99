"""Django admin for the portal's records: API tokens (hashes only, never the token)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from portal.models import ApiToken


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "user",
        "prefix",
        "scope",
        "created_at",
        "expires_at",
        "last_used_at",
        "revoked_at",
    ]
    list_filter = ["scope", "revoked_at"]
    search_fields = ["name", "user__username", "prefix"]
    # An admin may revoke a token, never widen it: its lifetime and scope are
    # what its owner chose within settings.QM_TOKEN_MAX_DAYS.
    readonly_fields = [
        "user",
        "name",
        "prefix",
        "key_hash",
        "scope",
        "created_at",
        "expires_at",
        "last_used_at",
    ]

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # A token is created by its owner, who alone sees its value once.
        return False
