"""One job's page in a real browser, as a researcher sees it: the tab's title names
the job, the command reads as typed, a cancelled job reads "Cancelling", a forced
kill comes before the exits it caused, and "Cancel job" stays red in dark mode."""

from __future__ import annotations

import re
import shlex
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from preemption.models import JobState, PreemptionEvent, Rank
from preemption.services import job_cancel
from tests import builders
from tests.conftest import PASSWORD
from tests.e2e.conftest import SCREENSHOTS, Session

pytestmark = [
    pytest.mark.e2e,
    # Transactions, so the live server's thread sees the rows written here.
    pytest.mark.django_db(transaction=True, serialized_rollback=True),
]


def _rgb(colour: str) -> tuple[int, int, int]:
    found = re.fullmatch(r"rgba?\((\d+), (\d+), (\d+)(?:, [\d.]+)?\)", colour)
    assert found is not None, colour
    red, green, blue = (int(part) for part in found.groups())
    return red, green, blue


def _reddish(colour: str) -> bool:
    red, green, blue = _rgb(colour)
    return red >= 180 and red - max(green, blue) >= 60


def test_a_job_page_reads_as_the_researcher_typed_and_did(
    world: Any, browser_session: Session
) -> None:
    command = shlex.join(["python", "-c", "print('a b')"])
    job = builders.running_job(
        world, world.vision, name="resnet-sweep", command=command, ranks=2, rank_fields={}
    )
    job_cancel(actor=world.users["researcher"], job=job)
    # A reclaimed job of the same researcher whose ranks were killed at the deadline.
    killed = builders.job(world, world.vision, ranks=2, state=JobState.REQUEUED, name="killed")
    attempt = builders.attempt(killed, ended_at=timezone.now(), end_reason="preempted")
    decided = timezone.now() - timedelta(minutes=3)
    builders.ranks(
        attempt,
        state=Rank.State.EXITED,
        exit_code=137,
        exited_at=decided + timedelta(seconds=60.26),
    )
    PreemptionEvent.objects.create(
        victim_attempt=attempt,
        job=killed,
        reason=PreemptionEvent.Reason.RECLAIM,
        cause="reclaimed by nlp, 8 GPUs under its guarantee",
        decided_at=decided,
        grace_seconds=60,
        deadline=decided + timedelta(seconds=60),
        signal_sent_at=decided + timedelta(seconds=0.01),
        killed_at=decided + timedelta(seconds=60.27),
        all_exited_at=decided + timedelta(seconds=60.26),
        outcome="killed",
    )
    session = browser_session
    page = session.page
    session.login("researcher", PASSWORD)

    session.go(f"/jobs/{job.pk}/")
    assert page.title() == f"Job #{job.pk} resnet-sweep · Quartermaster"
    assert page.inner_text("pre.command") == """python -c "print('a b')\""""
    assert page.inner_text('h1 [data-field="state"]') == "Cancelling"
    assert page.inner_text('[data-field="state-card"]') == "Cancelling"
    assert page.inner_text('[data-field="attempt-rules"]') == (
        "a preemption always requeues it · a failure is not retried · "
        "a lost rank is retried until the job has had 5 attempts"
    )
    session.screenshot("job-page-cancelling")

    session.go(f"/jobs/{killed.pk}/")
    titles = page.locator(".timeline .step strong").all_inner_texts()
    assert titles.index("Deadline passed: remaining ranks killed") < titles.index(
        "Every rank exited"
    )
    session.screenshot("job-page-killed-at-the-deadline")
    session.go("/jobs/")
    assert page.inner_text(f'tr[data-job="{job.pk}"] .pill') == "Cancelling"
    assert session.console_errors == [] and session.foreign_requests == []


def test_cancel_job_stays_red_in_dark_mode(world: Any, browser_session: Session) -> None:
    job = builders.running_job(world, world.vision, name="dark", rank_fields={})
    session = browser_session
    session.login("researcher", PASSWORD)
    session.go(f"/jobs/{job.pk}/")
    light = session.page.evaluate(
        "getComputedStyle(document.querySelector('#cancel-form button.danger')).color"
    )
    assert _reddish(light), light
    dark = session.another_context(
        viewport={"width": 1440, "height": 900},
        color_scheme="dark",
    )
    try:
        page = dark.new_page()
        page.goto(f"{session.base_url}/jobs/{job.pk}/")
        page.wait_for_load_state("networkidle")
        button = page.locator("#cancel-form button.danger")
        assert button.inner_text() == "Cancel job"
        assert page.evaluate("matchMedia('(prefers-color-scheme: dark)').matches")
        colour = button.evaluate("element => getComputedStyle(element).color")
        background = button.evaluate("element => getComputedStyle(element).backgroundColor")
        assert _reddish(colour), colour
        assert sum(_rgb(background)) < 150, background  # still the dark field behind it
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        button.screenshot(path=str(SCREENSHOTS / "job-page-dark-cancel-button.png"))
        page.screenshot(path=str(SCREENSHOTS / "job-page-dark.png"), full_page=True)
    finally:
        dark.close()
