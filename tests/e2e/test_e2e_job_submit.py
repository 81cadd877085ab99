"""The job form in a real browser: a researcher opens it from the navigation,
types a job, is refused with the API's reason under the field (nothing queued),
mends it, submits and lands on the new job's page; a manager of two teams sees
the priority classes follow the team chosen. Screenshots of the form and of
the refusal."""

from __future__ import annotations

import re
from typing import Any

import pytest

from preemption.models import Job
from tests.conftest import PASSWORD
from tests.e2e.conftest import Session

pytestmark = [
    pytest.mark.e2e,
    # Transactions, so the live server's thread sees the seeded rows; the
    # seeded priority classes of the migrations are restored after each test.
    pytest.mark.django_db(transaction=True, serialized_rollback=True),
]


def test_a_researcher_fills_the_form_is_refused_mends_it_and_lands_on_the_job(
    world: Any, browser_session: Session
) -> None:
    session = browser_session
    page = session.page
    session.login("researcher", PASSWORD)
    session.go("/jobs/")
    page.click("#mainnav >> text=Submit a job")
    page.wait_for_selector("#job-submit-form")
    assert page.title().startswith("Submit a job")
    # The researcher's one team, and its default class, are already chosen.
    assert page.input_value("#id_team") == "vision"
    assert page.input_value("#id_priority_class") == world.batch.name
    page.select_option("#id_flavor", world.h100.name)
    page.fill("#id_name", "resnet-e2e")
    page.fill("#id_gpus_per_rank", "8")
    # The page adds the ranks up as they are typed, for an elastic job at each size.
    for typed, words in (
        ("2:8", "= 16 to 64 GPUs"),
        ("1,2,4", "= 8, 16 or 32 GPUs"),
        ("2:", ""),
        ("4", "= 32 GPUs"),
    ):
        page.fill("#id_ranks", typed)
        assert page.inner_text("#gpu-total") == words, typed
    page.fill("#id_image", "registry.example.org/vision/trainer:1.4")
    page.fill("#id_command", "python train.py --epochs 3")
    page.fill("#id_env", "BATCH=64\nLR=0.1")
    page.fill("#id_retries", "1")
    page.select_option("#id_topology_level", "rack")
    page.check("#id_topology_required_1")
    # The top of the page, not where the last click scrolled it, in the screenshot.
    page.evaluate("window.scrollTo(0, 0)")
    session.screenshot("job-submit-form")

    # 32 GPUs of h100 is more than the cluster has: refused in the API's words.
    page.click("#submit-button")
    page.wait_for_load_state("networkidle")
    error = page.inner_text('[data-error-for="ranks"]')
    assert error == "Needs 32 h100-80gb GPUs (4 × 8); the cluster has 24."
    assert Job.objects.count() == 0
    # What was typed is still there to mend; the refused field is marked.
    assert page.input_value("#id_command") == "python train.py --epochs 3"
    assert page.input_value("#id_env") == "BATCH=64\nLR=0.1"
    assert "invalid" in (page.get_attribute(".field-ranks", "class") or "")
    page.evaluate("window.scrollTo(0, 0)")
    session.screenshot("job-submit-error")

    page.fill("#id_ranks", "2")
    page.click("#submit-button")
    page.wait_for_url(re.compile(r".*/jobs/\d+/$"))
    job = Job.objects.get()
    assert page.url.endswith(f"/jobs/{job.pk}/")
    assert f"Queued job #{job.pk}." in page.inner_text(".messages")
    assert "resnet-e2e" in page.inner_text("h1")
    assert (job.team, job.ranks, job.gpus_per_rank, job.retries) == (world.vision, 2, 8, 1)
    assert job.env == {"BATCH": "64", "LR": "0.1"}
    assert (job.topology_level, job.topology_required) == ("rack", False)
    # The refused form was answered 400, which the browser logs; nothing else went wrong.
    assert len(session.console_errors) == 1 and "400" in session.console_errors[0]
    assert session.foreign_requests == []


def test_the_priority_classes_follow_the_team_chosen(world: Any, browser_session: Session) -> None:
    # vision may use both classes and defaults to critical; nlp only batch.
    world.vision.default_priority_class = world.critical
    world.vision.save(update_fields=["default_priority_class"])
    world.nlp.priority_classes.set([world.batch])
    session = browser_session
    page = session.page
    session.login("manager", PASSWORD)
    session.go("/jobs/new/")

    def offered() -> list[str]:
        return page.eval_on_selector_all("#id_priority_class option", "os => os.map(o => o.value)")

    assert page.input_value("#id_team") == "nlp"
    assert offered() == [world.batch.name]
    page.select_option("#id_team", "vision")
    assert offered() == [world.critical.name, world.batch.name]
    assert page.input_value("#id_priority_class") == world.critical.name
    page.select_option("#id_team", "nlp")
    assert offered() == [world.batch.name]
    assert session.console_errors == [] and session.foreign_requests == []
