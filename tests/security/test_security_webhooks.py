"""Webhooks as a way into the control plane's network: every URL a manager
might register to reach something internal is one line of the table (the URL,
the status, the reason the JSON body gives), and the database is unchanged
after each refusal. Deliveries use real HTTP against real servers on
127.0.0.1, which the allow-list (QM_WEBHOOK_ALLOW_NETS) opens for these tests
only: redirects are not followed, a receiver that drips its answer is cut at
the deadline without delaying another team's notice, a destination is checked
again at every delivery, and signatures carry a timestamp.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.utils import timezone

from preemption.models import Job, Webhook, WebhookDelivery
from preemption.webhook_transport import Destination, post
from preemption.webhooks import deliver_due, signature, verify_signature, webhook_create
from quotas.models import AuditEntry

LOOPBACK_OPEN = ["127.0.0.1/32"]


@pytest.fixture(autouse=True)
def _loopback_open(settings: Any) -> None:
    # Only 127.0.0.1 is opened, for the receivers below; 127.0.0.2 stays closed.
    settings.QM_WEBHOOK_ALLOW_NETS = LOOPBACK_OPEN
    settings.QM_WEBHOOK_DEADLINE_SECONDS = 2.0


def snapshot() -> dict[str, list[dict[str, Any]]]:
    return {
        "webhooks": list(Webhook.objects.order_by("pk").values()),
        "deliveries": list(WebhookDelivery.objects.order_by("pk").values()),
        "audit": list(AuditEntry.objects.order_by("pk").values()),
    }


@dataclass
class Attack:
    url: str
    reason: str
    allow: list[str] | None = None  # the allow-list for this line, where not LOOPBACK_OPEN


ATTACKS = [
    Attack("http://169.254.169.254/latest/meta-data/iam/", "link-local"),
    # Redis on loopback, with the allow-list empty as it is by default.
    Attack("http://127.0.0.1:6379/", "loopback", allow=[]),
    # The allow-list opens only what it names.
    Attack("http://127.0.0.2:6379/", "loopback"),
    Attack("http://localhost:5432/", "loopback", allow=[]),
    Attack("http://10.0.0.5/", "private"),
    Attack("http://172.16.3.4:10250/pods", "private"),
    Attack("http://192.168.1.1/", "private"),
    Attack("http://100.100.100.200/latest/meta-data/", "not a public address"),
    Attack("http://0.0.0.0:8000/", "unspecified"),
    Attack("http://224.0.0.1/", "multicast"),
    Attack("http://240.0.0.1/", "reserved"),
    Attack("http://[::1]:6379/", "loopback"),
    Attack("http://[::ffff:127.0.0.2]/", "loopback address (inside ::ffff:7f00:2)"),
    Attack("http://[::ffff:169.254.169.254]/", "link-local"),
    Attack("http://[fe80::1]/", "link-local"),
    Attack("http://[fd00:ec2::254]/latest/meta-data/", "private"),
    Attack("http://[64:ff9b::a9fe:a9fe]/", "link-local address (where metadata"),
    Attack("http://[2002:a9fe:a9fe::1]/", "link-local"),
    Attack("http://no-such-host.invalid/", "cannot be resolved"),
    Attack("https://user:pass@93.184.215.14/", "Credentials in the URL"),
    Attack("ftp://93.184.215.14/", "Only http and https"),
]


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.url for a in ATTACKS])
def test_registering_an_internal_address_is_a_400_naming_the_url(
    world: Any, attack: Attack, settings: Any
) -> None:
    if attack.allow is not None:
        settings.QM_WEBHOOK_ALLOW_NETS = attack.allow
    before = snapshot()
    response = world.client("manager").post(
        "/api/v1/webhooks/", {"team": "vision", "url": attack.url}, format="json"
    )
    assert response.status_code == 400, response.content
    body = response.json()
    assert list(body) == ["url"], body
    assert attack.reason in body["url"][0], body
    assert snapshot() == before


# --- real receivers on 127.0.0.1 --------------------------------------------------------


@dataclass
class Hit:
    at: float
    path: str
    headers: dict[str, str]
    body: bytes


class Receiver:
    """An HTTP server on 127.0.0.1 whose answer is chosen per test."""

    def __init__(self, answer: Any) -> None:
        self.hits: list[Hit] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.hits.append(Hit(time.monotonic(), self.path, dict(self.headers), body))
                answer(self)

            def log_message(self, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.server.server_port}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def ok(handler: BaseHTTPRequestHandler) -> None:
    handler.send_response(204)
    handler.end_headers()


def drip(handler: BaseHTTPRequestHandler) -> None:
    """One byte of the answer every 0.5 s, 30 s in all if nobody hangs up."""
    try:
        for byte in b"HTTP/1.1 204 No Content\r\n" + b"X: " + b"." * 40:
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()
            time.sleep(0.5)
    except OSError:
        return


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    started: list[Receiver] = []
    yield started
    for receiver in started:
        receiver.close()


def _serve(receivers: list[Receiver], answer: Any) -> Receiver:
    receiver = Receiver(answer)
    receivers.append(receiver)
    return receiver


def _job(world: Any, team: Any) -> Job:
    return Job.objects.create(
        team=team,
        submitter=world.users["researcher"],
        priority_class=world.batch,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=1,
        command="true",
    )


def _queue(webhook: Webhook, job: Job, event: str = "finished") -> WebhookDelivery:
    return WebhookDelivery.objects.create(
        webhook=webhook,
        event=event,
        payload={"event": event, "job": {"id": job.pk}},
        next_try_at=timezone.now() - timedelta(seconds=1),
    )


def test_a_dripping_receiver_is_cut_at_the_deadline_and_delays_no_other_team(
    world: Any, receivers: list[Receiver]
) -> None:
    slow = _serve(receivers, drip)
    fast = _serve(receivers, ok)
    admin = world.users["admin"]
    slow_hook = webhook_create(actor=admin, team=world.ops, url=slow.url())
    fast_hook = webhook_create(actor=admin, team=world.vision, url=fast.url())
    # The slow team's notice is older, so it is first in line.
    slow_notice = _queue(slow_hook, _job(world, world.ops))
    fast_notice = _queue(fast_hook, _job(world, world.vision))
    WebhookDelivery.objects.filter(pk=slow_notice.pk).update(
        next_try_at=timezone.now() - timedelta(seconds=5)
    )

    started = time.monotonic()
    delivered = deliver_due()
    took = time.monotonic() - started

    assert delivered == 1
    assert took < 2.0 + 1.5, f"the run took {took:.1f} s; the deadline is 2 s"
    assert len(fast.hits) == 1 and fast.hits[0].at - started < 1.5, "the fast team waited"
    fast_notice.refresh_from_db()
    slow_notice.refresh_from_db()
    assert fast_notice.delivered_at is not None
    assert slow_notice.delivered_at is None
    assert slow_notice.last_error.startswith("timed out: no answer within 2 s")
    assert slow_notice.next_try_at > timezone.now(), "the slow receiver backs off"


def test_redirects_are_not_followed(world: Any, receivers: list[Receiver]) -> None:
    target = _serve(receivers, ok)

    def redirect(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(307)
        handler.send_header("Location", target.url("/elsewhere"))
        handler.end_headers()

    source = _serve(receivers, redirect)
    hook = webhook_create(actor=world.users["admin"], team=world.vision, url=source.url())
    notice = _queue(hook, _job(world, world.vision))
    assert deliver_due() == 0
    notice.refresh_from_db()
    assert notice.last_error == "HTTP 307" and notice.delivered_at is None
    assert len(source.hits) == 1 and target.hits == []


def test_every_delivery_checks_the_destination_again(
    world: Any, receivers: list[Receiver], settings: Any, caplog: Any
) -> None:
    """Where a URL pointed at registration proves nothing later: with the
    network closed again (as when a name is re-pointed at an internal address)
    the notice is refused and nothing reaches the receiver. A row written past
    the API (the admin, a restore) is checked the same way."""
    receiver = _serve(receivers, ok)
    secret_path = "/hook/T0KEN-in-the-path"
    hook = webhook_create(
        actor=world.users["admin"], team=world.vision, url=receiver.url(secret_path)
    )
    metadata = Webhook.objects.create(team=world.vision, url="http://169.254.169.254/latest/")
    job = _job(world, world.vision)
    notices = [_queue(hook, job), _queue(metadata, job)]
    settings.QM_WEBHOOK_ALLOW_NETS = []
    with caplog.at_level(logging.INFO, logger="preemption.webhooks"):
        assert deliver_due() == 0
    assert receiver.hits == []
    for notice in notices:
        notice.refresh_from_db()
        assert notice.last_error.startswith("refused: The host"), notice.last_error
    assert "loopback" in notices[0].last_error and "link-local" in notices[1].last_error
    # Logs name the webhook by id, scheme and host; never the path that may hold a credential.
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert f"webhook {hook.pk} (http://127.0.0.1)" in logged
    assert "T0KEN" not in logged and "/latest/" not in logged


def test_a_post_connects_to_the_checked_address_not_a_new_lookup(
    receivers: list[Receiver],
) -> None:
    """No second resolution: the host name below resolves nowhere, yet the post
    reaches the address that was checked, with the name in its Host header."""
    receiver = _serve(receivers, ok)
    destination = Destination(
        scheme="http",
        host="rebinding.invalid",
        port=receiver.server.server_port,
        target="/hook",
        address="127.0.0.1",
    )
    assert post(destination, b"{}", {"Content-Type": "application/json"}, deadline=2.0) == 204
    assert receiver.hits[0].headers["Host"] == f"rebinding.invalid:{receiver.server.server_port}"


def test_signatures_carry_a_timestamp_and_expire(world: Any, receivers: list[Receiver]) -> None:
    receiver = _serve(receivers, ok)
    hook = webhook_create(
        actor=world.users["admin"], team=world.vision, url=receiver.url(), secret="s3cret"
    )
    _queue(hook, _job(world, world.vision))
    assert deliver_due() == 1
    hit = receiver.hits[0]
    header = hit.headers["X-Quartermaster-Signature"]
    sent_at = int(header.split(",")[0].removeprefix("t="))
    assert abs(sent_at - time.time()) < 5
    assert verify_signature("s3cret", header, hit.body, now=time.time())
    # A replay after the window, a changed body, a moved timestamp, another secret: all refused.
    assert not verify_signature("s3cret", header, hit.body, now=time.time() + 301)
    assert not verify_signature("s3cret", header, hit.body + b" ", now=time.time())
    moved = header.replace(f"t={sent_at}", f"t={sent_at + 60}")
    assert not verify_signature("s3cret", moved, hit.body, now=time.time())
    assert not verify_signature("other", header, hit.body, now=time.time())
    assert json.loads(hit.body)["event"] == "finished"
    assert signature("s3cret", hit.body, at=sent_at) == header


def test_the_admin_form_refuses_what_the_api_refuses(world: Any, settings: Any) -> None:
    from django.test import Client
    from django.urls import reverse

    settings.QM_WEBHOOK_ALLOW_NETS = []
    browser = Client()
    browser.force_login(world.users["admin"])
    before = snapshot()
    page = browser.post(
        reverse("admin:preemption_webhook_add"),
        {
            "team": world.vision.pk,
            "url": "http://169.254.169.254/latest/",
            "events": "[]",
            "active": "on",
        },
    )
    assert page.status_code == 200 and b"link-local" in page.content
    assert snapshot() == before


def test_the_admin_form_reads_an_address_without_scheme_as_https(
    world: Any, receivers: list[Receiver]
) -> None:
    import warnings

    from django.test import Client
    from django.urls import reverse
    from django.utils.deprecation import RemovedInDjango60Warning

    receiver = _serve(receivers, ok)
    bare = receiver.url().removeprefix("http://")
    browser = Client()
    browser.force_login(world.users["admin"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RemovedInDjango60Warning)
        page = browser.post(
            reverse("admin:preemption_webhook_add"),
            {"team": world.vision.pk, "url": bare, "events": '["finished"]', "active": "on"},
        )
    assert page.status_code == 302, page.context["adminform"].form.errors
    assert list(Webhook.objects.values_list("url", flat=True)) == [f"https://{bare}"]


def test_https_checks_the_certificate_against_the_urls_host_on_the_pinned_address(
    receivers: list[Receiver], tmp_path: Any, monkeypatch: Any
) -> None:
    """Connecting to the checked address must not weaken TLS: the certificate
    is verified against the URL's host name, whatever address was dialled."""
    import ssl
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=receiver.test",
            "-addext",
            "subjectAltName=DNS:receiver.test",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    receiver = _serve(receivers, ok)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    receiver.server.socket = tls.wrap_socket(receiver.server.socket, server_side=True)
    port = receiver.server.server_port

    def to(host: str) -> Destination:
        return Destination("https", host, port, "/hook", "127.0.0.1")

    # Not trusted yet: refused, though the address is the right one.
    with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED"):
        post(to("receiver.test"), b"{}", {}, deadline=2.0)
    # Trusted, and named as in the certificate: delivered to the pinned address.
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    assert post(to("receiver.test"), b"{}", {}, deadline=2.0) == 204
    # Trusted, but the URL names another host: the certificate does not match.
    with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED"):
        post(to("other.test"), b"{}", {}, deadline=2.0)
    assert len(receiver.hits) == 1


def test_a_failing_receiver_keeps_its_other_notices_without_spending_their_tries(
    world: Any, receivers: list[Receiver]
) -> None:
    def broken(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(500)
        handler.end_headers()

    receiver = _serve(receivers, broken)
    hook = webhook_create(actor=world.users["admin"], team=world.vision, url=receiver.url())
    job = _job(world, world.vision)
    first, second = _queue(hook, job, "preempted"), _queue(hook, job, "requeued")
    assert deliver_due() == 0
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.tries, first.last_error) == (1, "HTTP 500")
    assert (second.tries, second.last_error) == (0, "") and second.next_try_at <= timezone.now()
    assert len(receiver.hits) == 1


def test_the_admin_never_shows_the_signing_secret_and_keeps_it_unless_told(
    world: Any, receivers: list[Receiver]
) -> None:
    from django.test import Client
    from django.urls import reverse

    receiver = _serve(receivers, ok)
    hook = webhook_create(
        actor=world.users["admin"], team=world.vision, url=receiver.url(), secret="kept-s3cret"
    )
    browser = Client()
    browser.force_login(world.users["admin"])
    change = reverse("admin:preemption_webhook_change", args=[hook.pk])
    listing = browser.get(reverse("admin:preemption_webhook_changelist"))
    page = browser.get(change)
    assert page.status_code == 200 and listing.status_code == 200
    assert b"kept-s3cret" not in page.content and b"kept-s3cret" not in listing.content
    form = {"team": world.vision.pk, "url": hook.url, "events": '["finished"]', "active": "on"}

    # A blank secret field keeps the secret; the edit of another field goes through.
    kept = browser.post(change, {**form, "secret": ""})
    assert kept.status_code == 302, kept.context["adminform"].form.errors
    hook.refresh_from_db()
    assert hook.secret == "kept-s3cret"
    # A new secret and its removal at once: refused, nothing changed.
    page = browser.post(change, {**form, "secret": "new", "remove_secret": "on"})
    assert page.status_code == 200 and b"not both" in page.content
    hook.refresh_from_db()
    assert hook.secret == "kept-s3cret"
    # A new secret replaces it; removal clears it.
    assert browser.post(change, {**form, "secret": "rotated"}).status_code == 302
    hook.refresh_from_db()
    assert hook.secret == "rotated"
    assert browser.post(change, {**form, "remove_secret": "on"}).status_code == 302
    hook.refresh_from_db()
    assert hook.secret == ""
