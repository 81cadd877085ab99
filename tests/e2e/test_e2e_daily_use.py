"""The pages a researcher and a manager use every day, as a browser shows them:
a rank log that follows its newest line and hides the trap's event lines, the
dashboard's team table on a phone, and the priority classes on a laptop."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from preemption.models import Attempt, Job, JobState, Rank
from tests.conftest import PASSWORD
from tests.e2e.conftest import SCREENSHOTS, Session

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True, serialized_rollback=True),
]


def _running_job_with_a_log(world: Any, settings: Any, runs: Path) -> tuple[Job, Path]:
    """A running job of the researcher's team whose rank 0 writes its log where the
    local runtime keeps it, so the page reads the real file."""
    from preemption.runtimes.records import RANK_LOG

    settings.QM_RUNS_DIR = runs
    settings.QM_RUNTIME = "local"
    job = Job.objects.create(
        name="follow-me",
        team=world.vision,
        submitter=world.users["researcher"],
        priority_class=world.batch,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=1,
        command="python train.py",
        state=JobState.RUNNING,
    )
    started = timezone.now() - timedelta(minutes=3)
    attempt = Attempt.objects.create(
        job=job, number=1, admitted_at=started, launched_at=started, placement=[]
    )
    Rank.objects.create(attempt=attempt, index=0, node="h100-node-0", state="running")
    log = runs / str(job.pk) / "1" / "0" / RANK_LOG
    log.parent.mkdir(parents=True)
    return job, log


def _training_lines(first: int, last: int) -> str:
    """Lines as a trapped training script writes them: its own, and an event per step."""
    lines = []
    for step in range(first, last):
        lines.append(f"step {step} loss {1.0 / (step + 1):.4f}\n")
        lines.append("QM_EVENT " + json.dumps({"event": "cadence", "step": step}) + "\n")
    return "".join(lines)


LAST_VISIBLE_LINE = """(() => {
  const log = document.getElementById("log");
  const lines = [...log.querySelectorAll(".line")].filter(l => l.getClientRects().length);
  const last = lines[lines.length - 1];
  const box = last.getBoundingClientRect(), frame = log.getBoundingClientRect();
  return {text: last.textContent.trim(), top: box.top, bottom: box.bottom,
          frameTop: frame.top, frameBottom: frame.bottom, viewport: window.innerHeight};
})()"""


def _in_view(where: dict[str, Any]) -> bool:
    return (
        where["top"] >= where["frameTop"] - 1
        and where["bottom"] <= where["frameBottom"] + 1
        and where["top"] >= 0
        and where["bottom"] <= where["viewport"]
    )


def test_rank_log_follows_its_newest_line_and_hides_the_trap_events(
    world: Any, browser_session: Session, settings: Any, tmp_path: Path
) -> None:
    job, log = _running_job_with_a_log(world, settings, tmp_path / "runs")
    log.write_text(_training_lines(0, 30))
    session = browser_session
    page = session.page
    session.login("researcher", PASSWORD)
    session.go(f"/jobs/{job.pk}/attempts/1/ranks/0/log/")
    assert page.is_checked("#log-follow")
    # The event lines are hidden at first: the log reads as the script's own output.
    assert not page.is_checked("#log-events")
    assert page.inner_text("#log-events-count") == "30 event lines"
    assert "QM_EVENT" not in page.inner_text("#log")
    assert page.locator("#log .qm-event").count() == 30

    # The log grows well past the height of its box while the page is open; the
    # last line is written in two parts, as a rank flushes it.
    with log.open("a") as handle:
        handle.write(_training_lines(30, 120) + "step 120 sav")
    page.wait_for_function(
        "document.getElementById('log').textContent.includes('step 119 loss')", timeout=10000
    )
    with log.open("a") as handle:
        handle.write("ed the checkpoint\n")
    page.wait_for_function(
        "document.getElementById('log').textContent.includes('step 120 saved the checkpoint')",
        timeout=10000,
    )
    assert page.evaluate("document.getElementById('log').scrollHeight") > page.evaluate(
        "document.getElementById('log').clientHeight"
    )
    where = page.evaluate(LAST_VISIBLE_LINE)
    assert where["text"] == "step 120 saved the checkpoint", where
    assert _in_view(where), where
    assert "QM_EVENT" not in page.inner_text("#log")
    assert page.inner_text("#log-events-count") == "120 event lines"
    session.screenshot("rank-log-following")

    # Shown on request, the event lines are there in full, and following goes on.
    page.check("#log-events")
    assert page.inner_text("#log").count("QM_EVENT") == 120
    with log.open("a") as handle:
        handle.write(
            "QM_EVENT " + json.dumps({"event": "checkpoint_committed", "step": 120}) + "\n"
        )
    page.wait_for_function(
        "document.getElementById('log').textContent.includes('checkpoint_committed')",
        timeout=10000,
    )
    where = page.evaluate(LAST_VISIBLE_LINE)
    assert "checkpoint_committed" in where["text"], where
    assert _in_view(where), where
    page.uncheck("#log-events")
    assert "QM_EVENT" not in page.inner_text("#log")

    # Scrolling the log up to read back stops following: new lines no longer move it.
    page.evaluate("document.getElementById('log').scrollTop = 0")
    page.wait_for_function("!document.getElementById('log-follow').checked", timeout=5000)
    assert "Paused" in page.inner_text("#log-follow-state")
    with log.open("a") as handle:
        handle.write("step 121 after the pause\n")
    page.wait_for_timeout(2500)
    assert page.evaluate("document.getElementById('log').scrollTop") == 0
    # Ticking Follow again fetches what was missed and goes to the newest line.
    page.check("#log-follow")
    page.wait_for_function(
        "document.getElementById('log').textContent.includes('step 121 after the pause')",
        timeout=10000,
    )
    where = page.evaluate(LAST_VISIBLE_LINE)
    assert where["text"] == "step 121 after the pause", where
    assert _in_view(where), where
    assert session.console_errors == []


def _phone(session: Session, width: int = 390, height: int = 844) -> Any:
    """A page of the signed-in session in a context of the given size."""
    context = session.another_context(
        viewport={"width": width, "height": height},
    )
    return context.new_page()


def test_dashboard_team_table_shows_borrowed_on_a_phone(
    world: Any, browser_session: Session
) -> None:
    from tests import builders

    # Vision borrows: 12 GPUs used against a guarantee of 8.
    builders.running_job(world, world.vision, node="h100-node-0", ranks=1, gpus_per_rank=8)
    builders.running_job(world, world.vision, node="h100-node-1", ranks=1, gpus_per_rank=4)
    session = browser_session
    session.login("manager", PASSWORD)
    page = _phone(session)
    try:
        page.goto(session.base_url + "/")
        page.wait_for_load_state("networkidle")
        page.screenshot(path=str(SCREENSHOTS / "phone-dashboard-teams.png"), full_page=True)
        head = page.locator("table.teams-usage th", has_text="Borrowed")
        box = head.bounding_box()
        assert box is not None
        assert box["x"] >= 0 and box["x"] + box["width"] <= 390, box
        cell = page.locator('tr[data-team="vision"] td[data-field="borrowed"]')
        cell_box = cell.bounding_box()
        assert cell_box["x"] + cell_box["width"] <= 390, cell_box
        assert cell.inner_text() == "4"
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
    finally:
        page.context.close()


def test_priority_classes_table_fits_a_laptop_screen(world: Any, browser_session: Session) -> None:
    from quotas.models import PriorityClass

    # A third class with a long description and an own minimum runtime, as admins write them.
    PriorityClass.objects.create(
        name="research-interactive-notebooks",
        value=50_000,
        preemption_policy="PreemptLowerPriority",
        grace_seconds=300,
        notice_seconds=120,
        min_runtime_seconds=1800,
        description="Notebooks and short interactive sessions of the research teams; "
        "they preempt batch work inside their own team but are never preempted themselves.",
    )
    session = browser_session
    session.login("admin", PASSWORD)
    page = _phone(session, width=1366, height=768)
    try:
        page.goto(session.base_url + "/priority-classes/")
        page.wait_for_load_state("networkidle")
        page.screenshot(path=str(SCREENSHOTS / "priority-classes-1366.png"), full_page=True)
        table = page.locator("#priority-classes").bounding_box()
        assert table is not None
        assert table["x"] >= 0 and table["x"] + table["width"] <= 1366, table
        for head in ("Min runtime", "Notice", "Teams", "Description"):
            box = page.locator("#priority-classes th", has_text=head).bounding_box()
            assert box["x"] + box["width"] <= 1366, (head, box)
        assert page.evaluate("document.documentElement.scrollWidth") <= 1366
        # Nothing is cut inside the card either: it does not scroll sideways.
        assert page.evaluate(
            "(() => { const card = document.querySelector('#priority-classes').parentElement;"
            " return card.scrollWidth <= card.clientWidth; })()"
        )
    finally:
        page.context.close()


def test_minimum_runtime_table_of_the_quota_editor_fits_a_laptop_screen(
    world: Any, browser_session: Session
) -> None:
    from quotas.models import PriorityClass

    # A class with minimums of its own beside ones it takes from the cluster's policy.
    PriorityClass.objects.filter(pk=world.batch.pk).update(
        priority_min_runtime_seconds=900, reclaim_min_runtime_seconds=3600
    )
    session = browser_session
    session.login("manager", PASSWORD)
    page = _phone(session, width=1366, height=768)
    try:
        page.goto(session.base_url + f"/quotas/{world.quota(world.vision).pk}/edit/")
        page.wait_for_load_state("networkidle")
        page.screenshot(path=str(SCREENSHOTS / "quota-edit-min-runtimes-1366.png"), full_page=True)
        table = page.locator("#min-runtimes")
        box = table.bounding_box()
        card = page.evaluate(
            "(() => { const card = document.querySelector('#min-runtimes').closest('.panel');"
            " const r = card.getBoundingClientRect();"
            " return {right: r.right, scroll: card.scrollWidth, client: card.clientWidth}; })()"
        )
        assert box["x"] + box["width"] <= card["right"], (box, card)
        assert card["scroll"] <= card["client"], card
        assert box["x"] + box["width"] <= 1366
        last = page.locator("#min-runtimes th").last.bounding_box()
        assert last["x"] + last["width"] <= card["right"], (last, card)
        assert page.locator('#min-runtimes tr[data-class="ai-batch-preemptible"]').is_visible()
    finally:
        page.context.close()
