"""Live pages and the narrow, dark layout in a real browser: the manager
edits a quota in one tab and the dashboard open in another shows the new
guarantee without a reload; at 390 px in dark mode the navigation folds, no
page scrolls sideways, focus is visible and a stopping job counts down."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from preemption.models import Attempt, Job, JobState, PreemptionEvent
from tests.conftest import PASSWORD
from tests.e2e.conftest import SCREENSHOTS, Session
from tests.portal.pages.conftest import seed_jobs

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True, serialized_rollback=True),
]

GUARANTEE_CELL = 'tr[data-team="vision"][data-flavor="h100-80gb"] td[data-field="guarantee"]'


def test_manager_edits_a_quota_and_the_open_dashboard_follows(
    world: Any, browser_session: Session
) -> None:
    session = browser_session
    dashboard = session.page
    session.login("manager", PASSWORD)
    session.go("/")
    assert dashboard.inner_text(GUARANTEE_CELL) == "8"
    # A mark on the window survives only if the page is never reloaded.
    dashboard.evaluate("window.__notReloaded = true")
    editor = dashboard.context.new_page()
    editor.goto(session.base_url + f"/quotas/{world.quota(world.vision).pk}/edit/")
    editor.fill("#id_guarantee", "6")
    editor.click("#save-button")
    editor.wait_for_url("**/teams/vision/")
    editor.close()
    dashboard.wait_for_function(
        f"document.querySelector({GUARANTEE_CELL!r}).textContent.trim() === '6'", timeout=20000
    )
    assert dashboard.evaluate("window.__notReloaded") is True
    assert "updated" in dashboard.inner_text("[data-live-status]")
    assert session.console_errors == []
    assert session.foreign_requests == []


def _preempting_job(world: Any) -> Job:
    job = Job.objects.create(
        name="stopping",
        team=world.vision,
        submitter=world.users["researcher"],
        priority_class=world.batch,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=8,
        command="python train.py",
        state=JobState.PREEMPTING,
    )
    now = timezone.now()
    attempt = Attempt.objects.create(job=job, number=1, admitted_at=now - timedelta(minutes=5))
    PreemptionEvent.objects.create(
        job=job,
        victim_attempt=attempt,
        reason=PreemptionEvent.Reason.PRIORITY,
        decided_at=now,
        signal_sent_at=now,
        grace_seconds=120,
        deadline=now + timedelta(seconds=120),
    )
    return job


def test_phone_width_in_dark_mode(world: Any, browser_session: Session) -> None:
    seed_jobs(world, 12, teams=[world.vision])
    job = _preempting_job(world)
    session = browser_session
    session.login("researcher", PASSWORD)
    # The signed-in cookies carry over to a phone-sized, dark context.
    phone = session.another_context(
        viewport={"width": 390, "height": 844},
        color_scheme="dark",
    )
    page = phone.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        for name, path in (
            ("dashboard", "/"),
            ("jobs", "/jobs/"),
            ("telemetry", "/telemetry/"),
            # The job page comes last: its countdown is checked below.
            ("job", f"/jobs/{job.pk}/"),
        ):
            page.goto(session.base_url + path)
            page.wait_for_load_state("networkidle")
            if name == "telemetry":
                page.wait_for_selector(".plot .main-svg")
                paper = page.evaluate(
                    "getComputedStyle(document.querySelector('.plot .main-svg')).backgroundColor"
                )
                assert paper == "rgb(17, 24, 39)", paper
            wide = page.evaluate(
                "[...document.querySelectorAll('body *')].filter(e => e.getBoundingClientRect().right > 391).slice(0, 8).map(e => e.tagName + '.' + e.className + ' ' + Math.round(e.getBoundingClientRect().right))"
            )
            assert page.evaluate("document.documentElement.scrollWidth") <= 390, (name, wide)
            assert not page.is_visible("#mainnav"), name
            assert page.is_visible(".navtoggle"), name
            background = page.evaluate("getComputedStyle(document.body).backgroundColor")
            assert background == "rgb(11, 18, 32)", (name, background)
            page.screenshot(path=str(SCREENSHOTS / f"phone-dark-{name}.png"), full_page=True)
        # The job page counts down to the stop's deadline by itself.
        first = page.inner_text("[data-countdown]")
        page.wait_for_function(
            f"document.querySelector('[data-countdown]').textContent !== {first!r}",
            timeout=5000,
        )
        assert page.inner_text("[data-countdown]").endswith("seconds left")
        # The menu opens the navigation, still within the screen's width.
        page.click(".navtoggle")
        assert page.is_visible("#mainnav")
        assert page.get_attribute(".navtoggle", "aria-expanded") == "true"
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        page.screenshot(path=str(SCREENSHOTS / "phone-dark-menu.png"))
        # Keyboard focus is drawn.
        page.keyboard.press("Tab")
        outline = page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
        assert outline == "solid"
        assert errors == []
    finally:
        phone.close()
