"""The 403, 404 and 500 pages: the portal's layout (navigation where the user is
known) and the reason, never settings, URL patterns or tracebacks; a refusal
leaves one log line. These run with DEBUG off, as `make run` serves."""

from __future__ import annotations

import http.client
import io
import logging
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.test import Client
from django.urls import include, path, reverse

from portal.errors import OneLineRefusals
from portal.processes import web_command
from tests.portal.pages.conftest import page_client

# This module doubles as a URLconf (see `test_a_server_error_*`): the portal's
# routes plus one view that fails.


def _boom(request: HttpRequest) -> HttpResponse:
    raise RuntimeError("the work queue went away")


urlpatterns = [path("boom/", _boom), path("", include("portal.urls"))]
handler403 = "portal.errors.permission_denied"
handler404 = "portal.errors.page_not_found"
handler500 = "portal.errors.server_error"


def _secrets() -> list[str]:
    """What no error page may show: settings with passwords, and Django's debug page."""
    return [
        settings.SECRET_KEY,
        settings.DATABASE_URL,
        settings.CELERY_BROKER_URL,
        "DATABASE_URL",
        "SECRET_KEY",
        "Using the URLconf",
        "urlpatterns",
        "api/v1/ ",
        "Traceback",
        "Resolver404",
    ]


def _assert_portal_page(body: str, *, reason: str, signed_in_as: str | None) -> None:
    assert 'class="topbar"' in body and 'id="error"' in body
    assert f'id="reason">{reason}<' in body
    if signed_in_as:
        assert 'class="mainnav"' in body and f'class="user">{signed_in_as}<' in body
    else:
        assert 'class="mainnav"' not in body
    for secret in _secrets():
        assert secret not in body, secret


def test_debug_is_off_and_static_files_are_still_served(world: Any) -> None:
    assert settings.DEBUG is False
    response = Client().get("/static/portal/portal.css")
    assert response.status_code == 200
    assert b".topbar" in b"".join(response.streaming_content)


@pytest.mark.parametrize("persona", ["researcher", "anonymous"])
def test_a_missing_page_is_a_portal_page_that_lists_no_routes(world: Any, persona: str) -> None:
    response = page_client(world, persona).get("/no/such/page/")
    assert response.status_code == 404
    _assert_portal_page(
        response.content.decode(),
        reason="There is no page at /no/such/page/.",
        signed_in_as=None if persona == "anonymous" else persona,
    )


def test_a_missing_row_says_which(world: Any) -> None:
    response = page_client(world, "researcher").get(reverse("job-detail", args=[999_999]))
    assert response.status_code == 404
    _assert_portal_page(
        response.content.decode(),
        reason="No Job matches the given query.",
        signed_in_as="researcher",
    )


def test_a_refusal_is_a_portal_page_with_the_reason(world: Any) -> None:
    quota = world.quota(world.vision)
    response = page_client(world, "researcher").get(reverse("quota-edit", args=[quota.pk]))
    assert response.status_code == 403
    _assert_portal_page(
        response.content.decode(),
        reason="A team&#x27;s own quota belongs to a manager above it.",
        signed_in_as="researcher",
    )


def test_an_unknown_api_path_answers_json(world: Any) -> None:
    response = page_client(world, "researcher").get("/api/no-such-thing/")
    assert response.status_code == 404
    assert response.json() == {"detail": "There is no page at /api/no-such-thing/."}


@pytest.mark.urls(__name__)
def test_a_server_error_is_a_portal_page_that_shows_no_settings(world: Any) -> None:
    client = page_client(world, "researcher")
    client.raise_request_exception = False
    response = client.get("/boom/")
    assert response.status_code == 500
    _assert_portal_page(
        response.content.decode(),
        reason="Something went wrong on the server. It has been logged; please try again.",
        signed_in_as="researcher",
    )


@pytest.mark.urls(__name__)
def test_even_the_debug_page_hides_the_database_and_broker_urls(world: Any, settings: Any) -> None:
    settings.DEBUG = True  # as with QM_DEBUG=1, which production refuses
    client = page_client(world, "researcher")
    client.raise_request_exception = False
    body = client.get("/boom/").content.decode()
    assert "the work queue went away" in body  # Django's debug page, as asked for
    assert "DATABASE_URL" in body and "CELERY_BROKER_URL" in body  # named, but hidden:
    assert settings.DATABASE_URL not in body and settings.CELERY_BROKER_URL not in body
    assert settings.SECRET_KEY not in body


@pytest.fixture
def console() -> Iterator[io.StringIO]:
    """What the portal's console handler (settings.LOGGING) prints, meanwhile."""
    handler = next(
        h
        for h in logging.getLogger().handlers
        if any(isinstance(f, OneLineRefusals) for f in h.filters)
    )
    assert isinstance(handler, logging.StreamHandler)
    captured = io.StringIO()
    previous = handler.setStream(captured)
    try:
        yield captured
    finally:
        handler.setStream(previous)


def test_a_refusal_is_logged_as_one_line_with_its_reason(world: Any, console: io.StringIO) -> None:
    quota = world.quota(world.vision)
    url = reverse("quota-edit", args=[quota.pk])
    assert page_client(world, "researcher").get(url).status_code == 403
    lines = [line for line in console.getvalue().splitlines() if "django.request" in line]
    assert len(lines) == 1, console.getvalue()
    assert f"Forbidden (Permission denied): {url}: A team's own quota belongs" in lines[0]
    assert "Traceback" not in console.getvalue()


@pytest.mark.urls(__name__)
def test_a_server_error_keeps_its_traceback_in_the_log(world: Any, console: io.StringIO) -> None:
    client = page_client(world, "researcher")
    client.raise_request_exception = False
    assert client.get("/boom/").status_code == 500
    assert console.getvalue().count("Traceback") == 1


def test_the_embedded_web_server_serves_static_files_and_plain_404s_with_debug_off() -> None:
    """The web process `make run` starts (serve_embedded's gunicorn command line),
    with no QM_DEBUG: static files come from WhiteNoise, a 404 is the portal's page."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in {"QM_DEBUG", "DEBUG"}}
    root = Path(__file__).resolve().parents[3]
    server = subprocess.Popen(
        web_command(bind=f"127.0.0.1:{port}", workers=1),
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/static/portal/portal.css"
                ) as css:
                    assert css.status == 200 and b".topbar" in css.read()
                break
            except (ConnectionError, urllib.error.URLError):
                assert time.monotonic() < deadline, "the web server did not start"
                time.sleep(0.3)
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/no/such/page/")
        body = missing.value.read().decode()
        assert missing.value.code == 404
        assert 'id="reason">There is no page at /no/such/page/.<' in body
        for secret in _secrets():
            assert secret not in body, secret
        # One request per connection, though the client would keep it: the next
        # request goes to whichever web process is free (processes.web_command).
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("GET", "/static/portal/portal.css")
        answer = connection.getresponse()
        answer.read()
        assert answer.status == 200
        assert answer.getheader("Connection") == "close"
        connection.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
