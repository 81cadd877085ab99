"""The portal in a real browser: editing a quota with its preview, an invalid
edit, a researcher's view of jobs, a chart holding the seeded values, no
console error and no request leaving 127.0.0.1, the gracetrap wheel installed
into a fresh virtual environment, and screenshots of the main pages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from quotas.models import AuditEntry
from tests.conftest import PASSWORD
from tests.e2e.conftest import Session
from tests.portal.pages.conftest import (
    seed_decayed_usage,
    seed_drill,
    seed_jobs,
    seed_preemption,
    seed_samples,
)

pytestmark = [
    pytest.mark.e2e,
    # Transactions, so the live server's thread sees the seeded rows; the
    # seeded priority classes of the migrations are restored after each test.
    pytest.mark.django_db(transaction=True, serialized_rollback=True),
]


def _clean(session: Session) -> None:
    assert session.console_errors == []
    assert session.foreign_requests == []


def test_manager_previews_then_saves_a_quota_and_sees_the_audit_entry(
    world: Any, browser_session: Session
) -> None:
    seed_jobs(world, 6)
    session = browser_session
    page = session.page
    session.login("manager", PASSWORD)
    session.go("/teams/ml/")
    page.click('tr[data-team="vision"] a.button')
    page.wait_for_selector("#quota-form")
    page.fill("#id_guarantee", "6")
    page.fill("#id_lend_limit", "2")
    page.wait_for_selector("#preview-result")
    page.wait_for_function(
        "document.querySelector('#preview-result').textContent.includes('8 → 6')"
    )
    preview = page.inner_text("#preview-result")
    assert "lend limit lend all → 2" in " ".join(preview.split())
    assert world.quota(world.vision).guarantee == 8  # the preview saved nothing
    session.screenshot("quota-edit-preview")
    page.click("#save-button")
    page.wait_for_url("**/teams/vision/")
    assert "Saved the h100-80gb quota of vision." in page.inner_text(".messages")
    assert page.inner_text('tr[data-flavor="h100-80gb"] td[data-field="guarantee"]') == "6"
    entry = page.inner_text(".audit-entry")
    assert "manager" in entry and "quota.set" in entry and "6" in entry
    assert world.quota(world.vision).guarantee == 6
    _clean(session)


def test_the_preview_says_when_recent_usage_lowers_a_fair_share(
    world: Any, browser_session: Session
) -> None:
    # vision used 2.0× its share of the spare GPUs last week (worked out by hand in
    # seed_decayed_usage): its fair share is 8 instead of 12, and the live preview says so.
    seed_decayed_usage(world)
    session = browser_session
    page = session.page
    session.login("manager", PASSWORD)
    session.go(f"/quotas/{world.quota(world.vision).pk}/edit/")
    page.wait_for_selector("#quota-form")
    assert "counts with strength 1.0" in " ".join(page.inner_text("#scheduling-policy").split())
    page.fill("#id_lend_limit", "0")
    page.wait_for_selector("#decayed-usage")
    assert page.inner_text('#decayed-usage li[data-team="vision"]') == (
        "Team vision used 2.0× its share of the spare h100-80gb GPUs over the last week: "
        "its fair share is 8.0 GPUs instead of 12.0."
    )
    assert world.quota(world.vision).lend_limit is None  # the preview saved nothing
    _clean(session)


def test_invalid_edit_shows_the_message_and_changes_nothing(
    world: Any, browser_session: Session
) -> None:
    session = browser_session
    page = session.page
    session.login("manager", PASSWORD)
    quota = world.quota(world.vision)
    entries = AuditEntry.objects.count()
    session.go(f"/quotas/{quota.pk}/edit/")
    page.fill("#id_guarantee", "12")
    page.wait_for_selector("#preview-errors")
    message = "Must be a whole number from 0 to 8: ml has 16 GPUs of h100-80gb and its other sub-teams hold 8 (got 12)."
    assert message in page.inner_text("#preview-errors")
    # The live preview also puts the refusal under the field it concerns.
    assert page.inner_text(".field.invalid p.error.live") == message
    page.click("#save-button")
    page.wait_for_load_state("networkidle")
    assert message in page.inner_text('[data-error-for="guarantee"]')
    session.screenshot("quota-edit-invalid")
    page.fill("#id_guarantee", "-1")
    page.wait_for_function(
        "document.querySelector('#preview-errors') &&"
        " document.querySelector('#preview-errors').textContent.includes('(got -1).')"
    )
    quota.refresh_from_db()
    assert quota.guarantee == 8
    assert AuditEntry.objects.count() == entries
    # The browser's console error for the 400 answer is expected here; nothing else.
    assert all("400" in error for error in session.console_errors)
    assert session.foreign_requests == []


def test_researcher_sees_only_their_teams_jobs(world: Any, browser_session: Session) -> None:
    jobs = seed_jobs(world, 24)
    session = browser_session
    page = session.page
    session.login("researcher", PASSWORD)
    session.go("/jobs/")
    teams = page.eval_on_selector_all("tr[data-job]", "rows => rows.map(r => r.dataset.team)")
    assert teams and set(teams) == {"vision"}
    assert len(teams) == sum(1 for job in jobs if job.team_id == world.vision.pk)
    other = next(job for job in jobs if job.team_id == world.ops.pk)
    response = session.go(f"/jobs/{other.pk}/")
    assert response.status == 404
    session.go("/jobs/?team=ops")
    teams = page.eval_on_selector_all("tr[data-job]", "rows => rows.map(r => r.dataset.team)")
    assert set(teams) == {"vision"}
    assert session.foreign_requests == []


def test_chart_holds_the_seeded_values_without_console_errors_or_foreign_requests(
    world: Any, browser_session: Session
) -> None:
    seed_samples(world)
    seed_preemption(world)
    seed_drill()
    session = browser_session
    page = session.page
    session.login("manager", PASSWORD)
    session.go("/telemetry/")
    page.wait_for_selector("#chart-utilization .main-svg")
    traces = page.evaluate(
        "() => document.getElementById('chart-utilization').data"
        ".map(t => [t.name, Array.from(t.y)])"
    )
    values = dict((name, y) for name, y in traces)
    assert values["vision used"] == [4, 5, 6, 7, 8, 9]
    assert values["nlp used"] == [2, 3, 4, 5, 6, 7]
    assert values["vision guarantee"] == [8] * 6
    assert "ops used" not in values
    rendered = page.eval_on_selector_all(
        ".plot", "plots => plots.map(p => !!p.querySelector('.main-svg'))"
    )
    assert rendered and all(rendered)
    assert "Signal reaches every rank" in page.inner_text("#mission-matrix")
    _clean(session)


def test_gracetrap_wheel_downloads_and_installs_into_a_fresh_venv(
    world: Any, browser_session: Session, tmp_path: Path
) -> None:
    session = browser_session
    page = session.page
    session.login("researcher", PASSWORD)
    session.go("/gracetrap/")
    example = page.inner_text("#usage-example")
    command = page.inner_text("#install-command").split()
    assert command[:3] == ["pip", "install", "--no-deps"]
    url = command[3]
    assert url.startswith(session.base_url + "/gracetrap/gracetrap-")
    with page.expect_download() as download_info:
        page.click("#wheel-link")
    download = download_info.value
    wheel = tmp_path / download.suggested_filename
    download.save_as(str(wheel))
    assert wheel.name.endswith("-py3-none-any.whl") and wheel.stat().st_size > 1000
    _clean(session)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = venv / "bin" / "pip"
    # Install straight from the page's command, the way a researcher's pip would.
    subprocess.run(
        [str(pip), "install", "--quiet", "--no-deps", "--no-index", url],
        check=True,
        timeout=300,
    )
    # torch is not installed again: the fresh environment borrows the project's
    # through a .pth file, listed after its own site-packages.
    site = next((venv / "lib").glob("python3*/site-packages"))
    project_site = next((Path(sys.prefix) / "lib").glob("python3*/site-packages"))
    (site / "zz-project-torch.pth").write_text(str(project_site) + "\n")
    probe = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import gracetrap; from gracetrap import Trap; print(gracetrap.__file__)",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert probe.stdout.strip().startswith(str(site))

    # The page's usage example runs as shown (shortened to 40 steps) on one rank,
    # checkpoints, and a second run resumes past the end without training again.
    script = tmp_path / "train.py"
    script.write_text(example.replace("10_000", "40").replace("% 500", "% 10"))
    env = {
        "PATH": "/usr/bin:/bin",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29517",
        "OMP_NUM_THREADS": "1",
        "QM_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "QM_GRACE_SECONDS": "30",
    }
    for _ in range(2):
        run = subprocess.run(
            [str(venv / "bin" / "python"), str(script)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "step_39" in saved, saved


def _store_simulations() -> None:
    """Two stored trace replays, as `manage.py simulate` leaves them."""
    from simulation import Report
    from telemetry.models import SimulationRun

    for policy, allocation, wait in (("static", 0.58, 5400.0), ("fairshare", 0.86, 1800.0)):
        summary = {"mean": wait / 3, "p50": wait / 4, "p99": wait}
        teams = {
            team: {
                "gpu_hours_used": used * allocation,
                "gpu_hours_borrowed": borrowed,
                "gpu_hours_lent": lent,
            }
            for team, used, borrowed, lent in (
                ("vision", 900.0, 120.0, 40.0),
                ("nlp", 700.0, 60.0, 90.0),
                ("ops", 400.0, 10.0, 150.0),
            )
        }
        report = Report(
            run={"policy": policy, "jobs": 1200, "jobs_completed": 1180},
            simulated_seconds=7 * 86400.0,
            allocation={"overall": allocation},
            completion_time_seconds=summary,
            queueing_delay_seconds=summary,
            preemptions=0 if policy == "static" else 31,
            lost_gpu_hours=0.0 if policy == "static" else 12.5,
            longest_below_guarantee_line_seconds=0.0 if policy == "static" else 48.0,
            teams=teams,
        )
        SimulationRun.objects.create(
            policy=policy, trace="openb_pod_list_default.csv", report=report.to_dict()
        )


def test_screenshots_of_the_main_pages(world: Any, browser_session: Session) -> None:
    seed_jobs(world, 40)
    story = seed_preemption(world)
    seed_samples(world, points=30)
    seed_drill()
    _store_simulations()
    session = browser_session
    page = session.page
    session.login("admin", PASSWORD)
    for name, path in (
        ("dashboard", "/"),
        ("teams", "/teams/"),
        ("team-ml", "/teams/ml/"),
        ("jobs", "/jobs/"),
        ("job-preempted", f"/jobs/{story.victim.pk}/"),
        ("telemetry", "/telemetry/"),
        ("priority-classes", "/priority-classes/"),
        ("tokens", "/tokens/"),
        ("gracetrap", "/gracetrap/"),
        ("simulations", "/telemetry/simulations/"),
    ):
        response = session.go(path)
        assert response.status == 200, path
        if name in ("telemetry", "simulations"):
            page.wait_for_selector(".plot .main-svg")
        session.screenshot(name)
    page.click("form[action='/logout/'] button")
    page.wait_for_url("**/login/")
    session.screenshot("login")
    _clean(session)
