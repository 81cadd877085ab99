"""A real browser (Debian's chromium, headless, driven by Playwright) against
pytest-django's live server. `playwright install` is never run: the browser is
the system's."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.db import connections

# Playwright's sync API runs an event loop in this thread; the ORM calls the
# tests make between browser steps are ordinary synchronous ones.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
# The live server listens on 127.0.0.1, so "no request leaves 127.0.0.1" is exact.
os.environ.setdefault("DJANGO_LIVE_TEST_SERVER_ADDRESS", "127.0.0.1")

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-gpu",
]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-output" / "screenshots"


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    """Fast hashing for the personas' passwords; these tests are about pages."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


# How long a page may take to load is the page benchmark's to say
# (`bench/bench_pages.py`), not a test's: `make test` runs its three suites at once on
# two cores, where the telemetry page's charts took longer than Playwright's default of
# 30 s to draw in two fresh-clone runs, against a few seconds on a quiet machine.
PAGE_TIMEOUT_MS = 120_000


@dataclass
class Session:
    """One browser page plus everything it did that a test checks afterwards."""

    page: Any
    base_url: str
    console_errors: list[str] = field(default_factory=list)
    foreign_requests: list[str] = field(default_factory=list)

    def go(self, path: str) -> Any:
        response = self.page.goto(self.base_url + path)
        self.page.wait_for_load_state("networkidle")
        return response

    def login(self, username: str, password: str) -> None:
        self.go("/login/")
        self.page.fill("#id_username", username)
        self.page.fill("#id_password", password)
        self.page.click("button[type=submit]")
        self.page.wait_for_load_state("networkidle")

    def another_context(self, **options: Any) -> Any:
        """Another browser context signed in as this one is (its cookies), with
        ``options`` (a viewport, a colour scheme) and the same timeout."""
        context = self.page.context.browser.new_context(
            storage_state=self.page.context.storage_state(), **options
        )
        context.set_default_timeout(PAGE_TIMEOUT_MS)
        return context

    def screenshot(self, name: str) -> None:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


@pytest.fixture(scope="module")
def _browser() -> Iterator[Any]:
    """One Chromium for the tests of a module; each test opens a context of its own
    (its own cookies, storage and cache), so no test sees what another did, while
    starting Playwright's driver and the browser, seconds of CPU, is paid once."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield browser
        finally:
            browser.close()
            # With Playwright's loop running in this thread, Django keeps the connections
            # opened meanwhile per asyncio context, apart from the thread's own, and
            # pytest-django's teardown only closes the thread's: close these here, or the
            # test database cannot be dropped at the end of the session.
            connections.close_all()


@pytest.fixture
def browser_session(live_server: Any, _browser: Any) -> Iterator[Session]:
    context = _browser.new_context(viewport={"width": 1440, "height": 900}, accept_downloads=True)
    context.set_default_timeout(PAGE_TIMEOUT_MS)
    page = context.new_page()
    session = Session(page=page, base_url=live_server.url)

    def on_console(message: Any) -> None:
        if message.type == "error":
            session.console_errors.append(message.text)

    def on_request(request: Any) -> None:
        host = urlsplit(request.url).hostname
        if request.url.startswith(("data:", "blob:", "about:")):
            return
        if host != "127.0.0.1":
            session.foreign_requests.append(request.url)

    page.on("console", on_console)
    page.on("pageerror", lambda error: session.console_errors.append(str(error)))
    page.on("request", on_request)
    try:
        yield session
    finally:
        context.close()
        # The connections this test opened while the loop ran (see `_browser`).
        connections.close_all()
