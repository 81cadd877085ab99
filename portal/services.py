"""Writes to the portal's own records: API tokens, and the team webhooks that
managers register through the API."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from portal.auth import TOKEN_PREFIX, hash_token, new_token_value
from portal.models import ApiToken, TokenScope
from quotas.models import AuditEntry, Team

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


def _webhook_values(webhook: Any) -> dict[str, Any]:
    # The secret is never written to the audit log.
    return {
        "team": webhook.team.slug,
        "url": webhook.url,
        "events": list(webhook.events),
        "active": webhook.active,
    }


@transaction.atomic
def webhook_create(
    *,
    actor: AbstractBaseUser,
    team: Team,
    url: str,
    events: list[str] | None = None,
    secret: str = "",
) -> Any:
    """Register a URL that receives the team's job notices (all of them when
    `events` is empty)."""
    from preemption.models import Webhook
    from preemption.webhooks import destination_refusal

    events = list(events or [])
    unknown = sorted(set(events) - set(Webhook.EVENTS))
    if unknown:
        raise ValidationError(
            {
                "events": [
                    f"Unknown events {', '.join(unknown)}; choose from {', '.join(Webhook.EVENTS)}."
                ]
            }
        )
    webhook = Webhook(team=team, url=url, events=events, secret=secret)
    # An empty list of events is valid (it means all of them); the model field calls it blank.
    webhook.full_clean(exclude=["events"])
    refusal = destination_refusal(url)
    if refusal is not None:
        raise ValidationError({"url": [refusal]})
    webhook.save()
    AuditEntry.objects.create(
        actor=actor,
        action="webhook.create",
        object_type="webhook",
        object_id=str(webhook.pk),
        object_repr=str(webhook)[:200],
        team=team,
        before=None,
        after=_webhook_values(webhook),
    )
    return webhook


@transaction.atomic
def webhook_delete(*, actor: AbstractBaseUser, webhook: Any) -> None:
    """Remove a team webhook and its pending deliveries."""
    AuditEntry.objects.create(
        actor=actor,
        action="webhook.delete",
        object_type="webhook",
        object_id=str(webhook.pk),
        object_repr=str(webhook)[:200],
        team=webhook.team,
        before=_webhook_values(webhook),
        after=None,
    )
    webhook.delete()
