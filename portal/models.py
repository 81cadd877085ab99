"""Portal-wide records: the API tokens people create for `qm` and scripts."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class TokenScope(models.TextChoices):
    """What a token may do. A read-only token may only read (GET, HEAD, OPTIONS);
    no token may create tokens, whatever its scope (portal/auth.py)."""

    FULL = "full", "read and write"
    READ = "read", "read only"


class ApiToken(models.Model):
    """A bearer token a user created. Only a hash is kept; the token itself is
    shown once, at creation. Every token expires (settings.QM_TOKEN_MAX_DAYS at
    the longest) and may be narrowed to reading."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=12, db_index=True)
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField()
    scope = models.CharField(max_length=8, choices=TokenScope.choices, default=TokenScope.FULL)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.user} {self.name} ({self.prefix}…)"

    @property
    def read_only(self) -> bool:
        return self.scope == TokenScope.READ
