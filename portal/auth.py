"""Bearer-token authentication over ApiToken rows."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from django.utils import timezone
from rest_framework import authentication, exceptions

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
        # Touch the row at most once a minute so reads stay reads.
        if token.last_used_at is None or (now - token.last_used_at).total_seconds() > 60:
            ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        return token.user, token

    def authenticate_header(self, request: Any) -> str:
        return "Bearer"
