"""Teams' webhooks: registering and removing them (audited), and their notices,
queued in the transaction that made the change and delivered later by a task
with retries and backoff, so a slow or broken receiver never holds up the
scheduling cycle.

Each run of the delivery task gives every webhook its own thread: a webhook's
notices go out one after another, each within QM_WEBHOOK_DEADLINE_SECONDS all
told, and a receiver that answers slowly (or not at all) delays only its own
notices. Where a webhook may point, and how the post stays on the address that
was checked, is preemption.webhook_transport.

Signing: with a secret, each post carries
`X-Quartermaster-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`.
`t` is the time of this try, so a receiver refuses a post whose `t` is more
than SIGNATURE_TOLERANCE_SECONDS (5 minutes) from its own clock; a captured
post cannot be replayed later, and the body cannot be moved to another time.
`verify_signature` is the receiver's check.

Webhook URLs may carry a credential in their path (many chat services work
that way), so logs name a webhook by its id and its scheme and host only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count, Min
from django.utils import timezone

from preemption.models import Job, Webhook, WebhookDelivery
from preemption.webhook_transport import (
    DeliveryTimeout,
    DestinationRefused,
    Network,
    check_destination,
    parse_networks,
    post,
)
from quotas.models import AuditEntry, Team

logger = logging.getLogger(__name__)
MAX_TRIES = 8
SIGNATURE_TOLERANCE_SECONDS = 300
# A run of the task must end well inside its Celery soft time limit (30 s).
RUN_BUDGET_SECONDS = 20.0
MAX_PARALLEL_WEBHOOKS = 16


def notify(*, job_id: int, event: str, payload: dict[str, Any]) -> int:
    """Queue a notice for every active webhook of the job's team that wants it."""
    return notify_each([Notice(job_id=job_id, event=event, payload=payload)])


@dataclass(frozen=True)
class Notice:
    """One notice about a job, for `notify_each`."""

    job_id: int
    event: str
    payload: dict[str, Any]


def notify_each(notices: list[Notice]) -> int:
    """`notify` for many jobs, in a fixed number of queries: the scheduling
    cycle may preempt hundreds of jobs in one decision."""
    if not notices:
        return 0
    job_ids = {notice.job_id for notice in notices}
    # The webhooks first: most teams have none, and then the jobs need not be loaded
    # (the exits listener calls this for every job that ends).
    hooks: dict[int, list[Webhook]] = {}
    for hook in Webhook.objects.filter(
        team_id__in=Job.objects.filter(pk__in=job_ids).values("team_id"), active=True
    ).order_by("pk"):
        hooks.setdefault(hook.team_id, []).append(hook)
    if not hooks:
        return 0
    jobs = Job.objects.select_related("team").filter(team_id__in=hooks).in_bulk(job_ids)
    now = timezone.now()
    deliveries = []
    for notice in notices:
        job = jobs.get(notice.job_id)
        if job is None:
            continue
        body = {
            "event": notice.event,
            "job": {"id": job.pk, "name": job.name, "team": job.team.slug, "state": job.state},
            "at": now.isoformat(),
            **notice.payload,
        }
        deliveries += [
            WebhookDelivery(webhook=hook, event=notice.event, payload=body, next_try_at=now)
            for hook in hooks.get(job.team_id, [])
            if not hook.events or notice.event in hook.events
        ]
    WebhookDelivery.objects.bulk_create(deliveries)
    return len(deliveries)


def allow_nets() -> list[Network]:
    """The networks an admin opened to webhooks (settings.QM_WEBHOOK_ALLOW_NETS)."""
    return parse_networks(settings.QM_WEBHOOK_ALLOW_NETS)


def destination_refusal(url: str) -> str | None:
    """Why a webhook may not point at `url` now (None when it may)."""
    try:
        check_destination(url, allow=allow_nets())
    except DestinationRefused as exc:
        return str(exc)
    return None


def signature(secret: str, body: bytes, *, at: int) -> str:
    """The signature header's value for `body` sent at Unix time `at`."""
    signed = f"{at}.".encode() + body
    return f"t={at},v1=" + hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


def verify_signature(
    secret: str,
    header: str,
    body: bytes,
    *,
    now: float,
    tolerance: float = SIGNATURE_TOLERANCE_SECONDS,
) -> bool:
    """The receiver's check: the HMAC matches and `t` is inside the replay window."""
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    try:
        at = int(fields["t"])
    except (KeyError, ValueError):
        return False
    if abs(now - at) > tolerance:
        return False
    expected = signature(secret, body, at=at).split("v1=", 1)[1]
    return hmac.compare_digest(expected, fields.get("v1", ""))


@dataclass(frozen=True)
class _Notice:
    delivery_id: int
    tries: int
    event: str
    body: bytes


@dataclass(frozen=True)
class _Outcome:
    delivery_id: int
    tries: int
    error: str  # empty when delivered
    tried: bool = True


def _send_all(
    url: str, secret: str, notices: list[_Notice], allow: list[Network], stop_at: float
) -> list[_Outcome]:
    """Post one webhook's notices in order; runs in its own thread, touches no database."""
    deadline = float(settings.QM_WEBHOOK_DEADLINE_SECONDS)
    outcomes: list[_Outcome] = []
    failed = False
    for notice in notices:
        # After a failure the rest wait for the next run rather than queue behind
        # a failing receiver; so do those the run has no time left for.
        if failed or time.monotonic() + deadline > stop_at:
            outcomes.append(_Outcome(notice.delivery_id, notice.tries, "", tried=False))
            continue
        headers = {"Content-Type": "application/json", "X-Quartermaster-Event": notice.event}
        if secret:
            headers["X-Quartermaster-Signature"] = signature(
                secret, notice.body, at=int(time.time())
            )
        error = ""
        try:
            # Resolved and checked at every try: where the name pointed at
            # registration proves nothing about where it points now.
            destination = check_destination(url, allow=allow)
            status = post(destination, notice.body, headers, deadline=deadline)
            if not 200 <= status < 300:
                error = f"HTTP {status}"
        except DestinationRefused as exc:
            error = f"refused: {exc}"
        except DeliveryTimeout as exc:
            error = f"timed out: {exc}"
        except OSError as exc:
            error = type(exc).__name__
        outcomes.append(_Outcome(notice.delivery_id, notice.tries, error))
        failed = bool(error)
    return outcomes


def _record(outcome: _Outcome, hook: Webhook) -> bool:
    now = timezone.now()
    if not outcome.tried:
        # The run ended before its turn: the claim is handed back, the try not counted.
        WebhookDelivery.objects.filter(pk=outcome.delivery_id, tries=outcome.tries).update(
            tries=outcome.tries - 1, next_try_at=now
        )
        return False
    if not outcome.error:
        WebhookDelivery.objects.filter(pk=outcome.delivery_id).update(
            delivered_at=now, last_error=""
        )
        return True
    update: dict[str, Any] = {"last_error": outcome.error[:300]}
    if outcome.tries >= MAX_TRIES:
        update["given_up_at"] = now
    else:
        update["next_try_at"] = now + timedelta(seconds=min(2**outcome.tries, 600))
    WebhookDelivery.objects.filter(pk=outcome.delivery_id).update(**update)
    logger.info(
        "webhook %s (%s) try %s failed: %s",
        hook.pk,
        hook.origin,
        outcome.tries,
        outcome.error,
    )
    return False


def _due_fairly(now: datetime, limit: int) -> list[WebhookDelivery]:
    """Up to `limit` due deliveries, each team with some due getting its share.

    Taking the oldest `limit` overall would let one team that floods its
    receivers (or points ten webhooks at a receiver that never answers) fill
    every run and starve every other team's notices. Instead the run is shared
    out as water fills vessels: each team gets an equal part, and what a team
    with fewer due leaves over goes to the others. With more teams than
    `limit`, those with the oldest notices go first."""
    due = WebhookDelivery.objects.filter(
        delivered_at__isnull=True, given_up_at__isnull=True, next_try_at__lte=now
    )
    teams = list(
        due.values("webhook__team_id")
        .annotate(oldest=Min("next_try_at"), waiting=Count("id"))
        .order_by("oldest", "webhook__team_id")
        .values_list("webhook__team_id", "waiting")[:limit]
    )
    shares: dict[int, int] = {}
    left = limit
    for place, (team_id, waiting) in enumerate(sorted(teams, key=lambda team: team[1])):
        shares[team_id] = min(waiting, max(1, left // (len(teams) - place)))
        left -= shares[team_id]
    chosen: list[WebhookDelivery] = []
    for team_id, _ in teams:
        chosen.extend(
            due.filter(webhook__team_id=team_id)
            .select_related("webhook")
            .order_by("next_try_at", "id")[: shares[team_id]]
        )
    return chosen


def deliver_due(*, limit: int = 50) -> int:
    """Try every delivery that is due, each webhook in its own thread; returns
    how many were delivered. Each team's receivers get a bounded share of a
    run's `limit` (`_due_fairly`)."""
    now = timezone.now()
    due = _due_fairly(now, limit)
    per_hook: dict[int, tuple[Webhook, list[_Notice]]] = {}
    for delivery in due:
        # Claim the row so two workers never post the same notice at once; the
        # claim lapses after a minute should this worker die mid-run.
        claimed = WebhookDelivery.objects.filter(
            pk=delivery.pk, tries=delivery.tries, delivered_at__isnull=True
        ).update(tries=delivery.tries + 1, next_try_at=now + timedelta(seconds=60))
        if claimed != 1:
            continue
        body = json.dumps(delivery.payload, sort_keys=True).encode()
        notice = _Notice(delivery.pk, delivery.tries + 1, delivery.event, body)
        per_hook.setdefault(delivery.webhook_id, (delivery.webhook, []))[1].append(notice)
    if not per_hook:
        return 0
    allow = allow_nets()
    stop_at = time.monotonic() + RUN_BUDGET_SECONDS
    delivered = 0
    # Not a `with` block: leaving one waits for every thread, and a thread can
    # outlive the run only while name resolution hangs, which no timer can cut.
    pool = ThreadPoolExecutor(
        max_workers=min(MAX_PARALLEL_WEBHOOKS, len(per_hook)), thread_name_prefix="webhook"
    )
    try:
        futures = {
            pool.submit(_send_all, hook.url, hook.secret, notices, allow, stop_at): hook
            for hook, notices in per_hook.values()
        }
        for future in as_completed(futures, timeout=RUN_BUDGET_SECONDS + 5):
            hook = futures[future]
            # Recorded as each webhook finishes: a slow one holds up no other's record.
            for outcome in future.result():
                delivered += _record(outcome, hook)
    except TimeoutError:
        # Deliveries still in flight keep their claim and are tried again later.
        logger.warning("webhook deliveries still running at the end of the run")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
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
    # The team's row is locked so that two registrations at once cannot both
    # pass the count.
    Team.objects.select_for_update().filter(pk=team.pk).first()
    limit = settings.QM_MAX_WEBHOOKS_PER_TEAM
    existing = Webhook.objects.filter(team=team).count()
    if existing >= limit:
        raise ValidationError(
            {
                "team": [
                    f"Team {team.slug} may have at most {limit} webhooks (it has {existing}); "
                    "remove one first."
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
