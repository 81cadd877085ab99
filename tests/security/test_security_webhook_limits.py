"""A team's webhooks as a way to take more than its share: the number each team
may register is capped, each delivery run gives every team's notices a share
(so one team's flood or its dead receivers cannot starve another's), and the
deprecated site-local IPv6 range is closed like the private ones.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from preemption.models import Webhook, WebhookDelivery
from preemption.webhook_transport import why_not_public
from preemption.webhooks import deliver_due, webhook_create
from tests.conftest import database_state
from tests.security.test_security_webhooks import LOOPBACK_OPEN, Receiver, _job, _serve, ok


@pytest.fixture(autouse=True)
def _loopback_open(settings: Any) -> None:
    settings.QM_WEBHOOK_ALLOW_NETS = LOOPBACK_OPEN
    settings.QM_WEBHOOK_DEADLINE_SECONDS = 2.0


@pytest.fixture
def receivers() -> Any:
    started: list[Receiver] = []
    yield started
    for receiver in started:
        receiver.close()


def test_the_eleventh_webhook_of_a_team_is_refused(world: Any, receivers: list[Receiver]) -> None:
    receiver = _serve(receivers, ok)
    for index in range(10):
        webhook_create(actor=world.users["admin"], team=world.vision, url=receiver.url(f"/{index}"))
    before = database_state()
    response = world.client("manager").post(
        "/api/v1/webhooks/", {"team": "vision", "url": receiver.url("/11")}, format="json"
    )
    assert response.status_code == 400, response.content
    assert response.json() == {
        "team": ["Team vision may have at most 10 webhooks (it has 10); remove one first."]
    }
    assert database_state() == before
    # Another team is not held to vision's count.
    other = world.client("manager").post(
        "/api/v1/webhooks/", {"team": "nlp", "url": receiver.url("/nlp")}, format="json"
    )
    assert other.status_code == 201, other.content


def test_the_webhook_cap_is_a_setting(world: Any, settings: Any, receivers: list[Receiver]) -> None:
    settings.QM_MAX_WEBHOOKS_PER_TEAM = 1
    receiver = _serve(receivers, ok)
    webhook_create(actor=world.users["admin"], team=world.vision, url=receiver.url("/a"))
    response = world.client("manager").post(
        "/api/v1/webhooks/", {"team": "vision", "url": receiver.url("/b")}, format="json"
    )
    assert response.status_code == 400
    assert "at most 1 webhooks (it has 1)" in response.json()["team"][0]
    assert Webhook.objects.count() == 1


def test_one_teams_flood_of_notices_does_not_starve_another_team(
    world: Any, receivers: list[Receiver]
) -> None:
    flooded = _serve(receivers, ok)
    quiet = _serve(receivers, ok)
    admin = world.users["admin"]
    flood_hook = webhook_create(actor=admin, team=world.ops, url=flooded.url())
    quiet_hook = webhook_create(actor=admin, team=world.vision, url=quiet.url())
    now = timezone.now()
    ops_job = _job(world, world.ops)
    # Sixty notices of ops, every one older than vision's single notice: taken
    # oldest first, a run of 50 would be ops' alone.
    WebhookDelivery.objects.bulk_create(
        WebhookDelivery(
            webhook=flood_hook,
            event="finished",
            payload={"event": "finished", "job": {"id": ops_job.pk}, "n": index},
            next_try_at=now - timedelta(minutes=10, seconds=-index),
        )
        for index in range(60)
    )
    vision_notice = WebhookDelivery.objects.create(
        webhook=quiet_hook,
        event="finished",
        payload={"event": "finished", "job": {"id": _job(world, world.vision).pk}},
        next_try_at=now - timedelta(seconds=1),
    )
    delivered = deliver_due(limit=50)
    vision_notice.refresh_from_db()
    assert vision_notice.delivered_at is not None
    assert len(quiet.hits) == 1
    # Ops got the rest of the run, and no more than the run's limit went out.
    assert delivered == 50 and len(flooded.hits) == 49
    # The next run delivers what is left of ops' flood.
    assert deliver_due(limit=50) == 11


@pytest.mark.parametrize(
    ("address", "reason"),
    [("fec0::1", "site-local"), ("fec0:1234::5", "site-local"), ("feff::1", "site-local")],
)
def test_site_local_ipv6_is_closed(address: str, reason: str) -> None:
    import ipaddress

    assert reason in (why_not_public(ipaddress.ip_address(address)) or "")


def test_registering_a_site_local_url_is_a_400(world: Any) -> None:
    before = database_state()
    response = world.client("manager").post(
        "/api/v1/webhooks/", {"team": "vision", "url": "http://[fec0::1]:8080/"}, format="json"
    )
    assert response.status_code == 400
    assert list(response.json()) == ["url"]
    assert "site-local" in response.json()["url"][0]
    assert database_state() == before
