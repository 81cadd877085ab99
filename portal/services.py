"""Writes to the portal's own records: the API tokens people create."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from portal.auth import TOKEN_PREFIX, hash_token, new_token_value
from portal.models import ApiToken, TokenScope

MAX_ACTIVE_TOKENS = 50


@transaction.atomic
def api_token_create(
    *,
    user: AbstractBaseUser,
    name: str,
    days: int | None = None,
    scope: str = TokenScope.FULL,
) -> tuple[ApiToken, str]:
    """A new token for `user`, valid for `days` (settings.QM_TOKEN_DEFAULT_DAYS
    when not given, settings.QM_TOKEN_MAX_DAYS at most) with the given scope.
    Returns the row and the token itself, which is never stored and so can be
    shown only this once."""
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": ["A token needs a name, e.g. the machine it is for."]})
    if days is None:
        days = settings.QM_TOKEN_DEFAULT_DAYS
    if (
        isinstance(days, bool)
        or not isinstance(days, int)
        or not 1 <= days <= settings.QM_TOKEN_MAX_DAYS
    ):
        raise ValidationError(
            {"days": [f"A token lasts from 1 to {settings.QM_TOKEN_MAX_DAYS} days; got {days!r}."]}
        )
    if scope not in TokenScope.values:
        raise ValidationError(
            {"scope": [f"Unknown scope {scope!r}; choose from {', '.join(TokenScope.values)}."]}
        )
    active = ApiToken.objects.filter(user_id=user.pk, revoked_at__isnull=True).count()
    if active >= MAX_ACTIVE_TOKENS:
        raise ValidationError(
            {
                "name": [
                    f"You already have {active} active tokens; revoke one before creating another."
                ]
            }
        )
    value = new_token_value()
    token = ApiToken.objects.create(
        user=user,
        name=name[:100],
        prefix=value[: len(TOKEN_PREFIX) + 6],
        key_hash=hash_token(value),
        expires_at=timezone.now() + timedelta(days=days),
        scope=scope,
    )
    return token, value


@transaction.atomic
def api_token_revoke(*, user: AbstractBaseUser, token: ApiToken) -> ApiToken:
    """Revoke one of the user's own tokens. Revoking twice changes nothing."""
    token = ApiToken.objects.select_for_update().get(pk=token.pk)
    if token.user_id != user.pk:
        raise ValidationError({"token": ["You can revoke only your own tokens."]})
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
    return token


@transaction.atomic
def api_tokens_revoke_all(*, user: AbstractBaseUser) -> int:
    """Revoke every active token of `user`; returns how many. Called when the
    password changes: a token minted with the old password (by `qm login`, say,
    on a machine the user no longer trusts) must not outlive it."""
    return ApiToken.objects.filter(user_id=user.pk, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )
