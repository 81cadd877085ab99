"""Teams' webhooks: registering and removing them (audited), and their notices,
queued in the transaction that made the change and delivered later by a task
with retries and backoff, so a slow or broken receiver never holds up the
scheduling cycle."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from datetime import timedelta
from typing import Any

import requests
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from preemption.models import Job, Webhook, WebhookDelivery
from quotas.models import AuditEntry, Team

logger = logging.getLogger(__name__)
MAX_TRIES = 8
TIMEOUT_SECONDS = 5.0


def notify(*, job_id: int, event: str, payload: dict[str, Any]) -> int:
    """Queue a notice for every active webhook of the job's team that wants it."""
    job = Job.objects.select_related("team").filter(pk=job_id).first()
    if job is None:
        return 0
    now = timezone.now()
    body = {
        "event": event,
        "job": {"id": job.pk, "name": job.name, "team": job.team.slug, "state": job.state},
        "at": now.isoformat(),
        **payload,
    }
    deliveries = [
        WebhookDelivery(webhook=hook, event=event, payload=body, next_try_at=now)
        for hook in Webhook.objects.filter(team_id=job.team_id, active=True)
        if not hook.events or event in hook.events
    ]
    WebhookDelivery.objects.bulk_create(deliveries)
    return len(deliveries)


def signature(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def deliver_due(*, limit: int = 50) -> int:
    """Try every delivery that is due; returns how many were delivered."""
    now = timezone.now()
    due = list(
        WebhookDelivery.objects.select_related("webhook")
        .filter(delivered_at__isnull=True, given_up_at__isnull=True, next_try_at__lte=now)
        .order_by("next_try_at")[:limit]
    )
    delivered = 0
    for delivery in due:
        # Claim the row so two workers never post the same notice at once.
        claimed = WebhookDelivery.objects.filter(
            pk=delivery.pk, tries=delivery.tries, delivered_at__isnull=True
        ).update(tries=delivery.tries + 1, next_try_at=now + timedelta(seconds=60))
        if claimed != 1:
            continue
        tries = delivery.tries + 1
        body = json.dumps(delivery.payload, sort_keys=True).encode()
        headers = {"Content-Type": "application/json", "X-Quartermaster-Event": delivery.event}
        if delivery.webhook.secret:
            headers["X-Quartermaster-Signature"] = signature(delivery.webhook.secret, body)
        error = ""
        try:
            response = requests.post(
                delivery.webhook.url, data=body, headers=headers, timeout=TIMEOUT_SECONDS
            )
            if 200 <= response.status_code < 300:
                WebhookDelivery.objects.filter(pk=delivery.pk).update(
                    delivered_at=timezone.now(), last_error=""
                )
                delivered += 1
                continue
            error = f"HTTP {response.status_code}"
        except requests.RequestException as exc:
            error = type(exc).__name__
        update: dict[str, Any] = {"last_error": error[:300]}
        if tries >= MAX_TRIES:
            update["given_up_at"] = timezone.now()
        else:
            update["next_try_at"] = timezone.now() + timedelta(seconds=min(2**tries, 600))
        WebhookDelivery.objects.filter(pk=delivery.pk).update(**update)
        logger.info("webhook %s try %s failed: %s", delivery.webhook.url, tries, error)
    return delivered


# --- the team webhooks managers register ----------------------------------------


def _webhook_values(webhook: Webhook) -> dict[str, Any]:
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
) -> Webhook:
    """Register a URL that receives the team's job notices (all of them when
    `events` is empty)."""
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
def webhook_delete(*, actor: AbstractBaseUser, webhook: Webhook) -> None:
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
