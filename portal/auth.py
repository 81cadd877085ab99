"""Bearer-token authentication over ApiToken rows.

What a token can do: act as its user through the REST API and /metrics, until
it expires or is revoked; a read-only token only for safe methods (GET, HEAD,
OPTIONS). A token never creates tokens: that takes a password (`qm login`) or
a browser session, so a leaked token cannot outlive its own expiry.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from django.utils import timezone
from rest_framework import authentication, exceptions, permissions

from portal.models import ApiToken

TOKEN_PREFIX = "qm_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token_value() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


class BearerTokenAuthentication(authentication.BaseAuthentication):
    """`Authorization: Bearer qm_...` (also accepts the `Token` keyword)."""

    keywords = (b"bearer", b"token")

    def authenticate(self, request: Any) -> tuple[Any, ApiToken] | None:
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() not in self.keywords:
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Authorization header must be 'Bearer <token>'.")
        try:
            value = header[1].decode()
        except UnicodeError:
            raise exceptions.AuthenticationFailed(
                "The token contains invalid characters."
            ) from None
        if not value.startswith(TOKEN_PREFIX):
            # Job event tokens are checked by the events endpoint itself.
            return None
        token = (
            ApiToken.objects.select_related("user")
            .filter(key_hash=hash_token(value), revoked_at__isnull=True)
            .first()
        )
        if token is None or not token.user.is_active:
            raise exceptions.AuthenticationFailed("Invalid or revoked token.")
        now = timezone.now()
        if token.expires_at <= now:
            raise exceptions.AuthenticationFailed(
                f"This token expired at {token.expires_at.isoformat(timespec='seconds')}; "
                "sign in again with `qm login` or create a new token on the portal's tokens page."
            )
        # Checked here rather than in each view's permissions, so that no view
        # (including those with their own permission classes) can forget it.
        if token.read_only and request.method not in permissions.SAFE_METHODS:
            raise exceptions.PermissionDenied(
                f"This token is read-only: it may only read (GET, HEAD, OPTIONS), not {request.method}."
            )
        # Touch the row at most once a minute so reads stay reads.
        if token.last_used_at is None or (now - token.last_used_at).total_seconds() > 60:
            ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        return token.user, token

    def authenticate_header(self, request: Any) -> str:
        return "Bearer"
