"""Live pages: the dashboard, the job list, the job page and the log view
mark the regions that refresh themselves, say how old their figures are,
count down to a stop's deadline and follow a log, all from endpoints scoped
exactly as the pages are. The browser side is tested in tests/e2e."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.staticfiles import finders
from django.urls import reverse
from django.utils import timezone

from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank
from tests.portal.pages.conftest import page_client

pytestmark = pytest.mark.django_db

FETCH = {"HTTP_X_REQUESTED_WITH": "fetch"}


def _running(world: Any, team: Any, submitter: str, *, state: str = JobState.RUNNING) -> Job:
    job = Job.objects.create(
        name="live",
        team=team,
        submitter=world.users[submitter],
        priority_class=world.batch,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=1,
        command="python train.py",
        state=state,
    )
    started = timezone.now() - timedelta(minutes=3)
    attempt = Attempt.objects.create(
        job=job, number=1, admitted_at=started, launched_at=started, placement=[]
    )
    Rank.objects.create(attempt=attempt, index=0, node="h100-node-0", state="running")
    return job


@pytest.mark.parametrize(
    ("url", "region"),
    [
        ("dashboard", "dashboard"),
        ("job-list", "jobs-table"),
    ],
)
def test_pages_mark_live_regions_and_say_how_old_they_are(
    world: Any, url: str, region: str
) -> None:
    body = page_client(world, "researcher").get(reverse(url)).content.decode()
    assert f'data-live="{region}"' in body
    assert "data-live-status" in body
    assert "updated <span data-updated-ago>0 seconds</span> ago" in body
    assert re.search(r'<script src="/static/portal/live\.js[^"]*" defer>', body)
    # The script is a static file of the project, served by whitenoise, never a CDN.
    assert finders.find("portal/live.js")
    assert all(src.startswith("/") for src in re.findall(r'<script src="([^"]+)"', body))


def test_job_page_of_another_team_is_404_to_the_poller(world: Any) -> None:
    job = _running(world, world.ops, "other_researcher")
    client = page_client(world, "researcher")
    assert client.get(reverse("job-detail", args=[job.pk]), **FETCH).status_code == 404
    raw = client.get(reverse("rank-log", args=[job.pk, 1, 0]), {"raw": 1, "offset": 0})
    assert raw.status_code == 404
    assert "X-Next-Offset" not in raw
    # Its own team reads both.
    own = page_client(world, "other_researcher")
    assert own.get(reverse("job-detail", args=[job.pk]), **FETCH).status_code == 200


def test_preempting_job_counts_down_to_its_deadline(world: Any) -> None:
    job = _running(world, world.vision, "researcher", state=JobState.PREEMPTING)
    attempt = job.attempts.get()
    now = timezone.now()
    deadline = (now + timedelta(seconds=45)).replace(microsecond=0)
    PreemptionEvent.objects.create(
        job=job,
        victim_attempt=attempt,
        reason=PreemptionEvent.Reason.PRIORITY,
        decided_at=now,
        signal_sent_at=now,
        grace_seconds=45,
        deadline=deadline,
    )
    body = (
        page_client(world, "researcher").get(reverse("job-detail", args=[job.pk])).content.decode()
    )
    match = re.search(r'<strong data-countdown="([^"]+)">(\d+) s left</strong>', body)
    assert match
    assert match.group(1) == deadline.isoformat()
    # Rendered within a second or two of `now`: 45 s minus the time the request took.
    assert 42 <= int(match.group(2)) <= 45
    assert f"Must stop by {deadline:%H:%M:%S} UTC" in body


def test_running_job_without_a_stop_shows_no_countdown(world: Any) -> None:
    job = _running(world, world.vision, "researcher")
    body = (
        page_client(world, "researcher").get(reverse("job-detail", args=[job.pk])).content.decode()
    )
    assert "data-countdown" not in body
    assert 'data-live="job"' in body
    assert "data-live-status" in body


def test_finished_job_page_does_not_poll(world: Any) -> None:
    job = _running(world, world.vision, "researcher", state=JobState.SUCCEEDED)
    body = (
        page_client(world, "researcher").get(reverse("job-detail", args=[job.pk])).content.decode()
    )
    assert "data-live-status" not in body


def test_log_view_follows_from_the_last_offset_while_the_attempt_is_open(
    world: Any, settings: Any, tmp_path: Any
) -> None:
    from preemption.runtimes.records import RANK_LOG

    settings.QM_RUNS_DIR = tmp_path
    settings.QM_RUNTIME = "local"
    job = _running(world, world.vision, "researcher")
    log = tmp_path / str(job.pk) / "1" / "0" / RANK_LOG
    log.parent.mkdir(parents=True)
    log.write_text("step 1\n")
    client = page_client(world, "researcher")
    url = reverse("rank-log", args=[job.pk, 1, 0])
    body = client.get(url).content.decode()
    assert f'id="log-follow" data-url="{url}" data-offset="7" checked' in body
    assert 'data-live-status data-live-seconds="2"' in body
    # The log grows; the follower asks from offset 7 and gets only the new line.
    with log.open("a") as handle:
        handle.write("step 2\n")
    raw = client.get(url, {"raw": 1, "offset": 7})
    assert raw.content.decode() == "step 2\n"
    assert raw["X-Next-Offset"] == "14"
    assert raw["X-Attempt-Open"] == "1"
    # The attempt ends: the follower is told the log is complete.
    Attempt.objects.filter(job=job).update(ended_at=timezone.now(), end_reason="succeeded")
    done = client.get(url, {"raw": 1, "offset": 14})
    assert (done.content, done["X-Attempt-Open"]) == (b"", "0")
    ended = client.get(url).content.decode()
    assert "The attempt has ended; the log is complete." in ended
    assert "data-live-status" not in ended


def test_researchers_own_waiting_jobs_come_first_on_the_dashboard(world: Any) -> None:
    # Three waiting jobs of vision, oldest first: the manager's, the researcher's, the manager's.
    jobs = []
    for index, submitter in enumerate(["manager", "researcher", "manager"]):
        job = Job.objects.create(
            name=f"wait-{index}",
            team=world.vision,
            submitter=world.users[submitter],
            priority_class=world.batch,
            flavor=world.h100,
            ranks=1,
            gpus_per_rank=1,
            command="python train.py",
            state=JobState.PENDING,
        )
        Job.objects.filter(pk=job.pk).update(
            submitted_at=timezone.now() - timedelta(minutes=10 - index)
        )
        jobs.append(job)
    body = page_client(world, "researcher").get(reverse("dashboard")).content.decode()
    waiting = body[body.index('class="table compact pending"') :]
    shown = [int(pk) for pk in re.findall(r'<tr data-job="(\d+)"', waiting)]
    assert shown == [jobs[1].pk, jobs[0].pk, jobs[2].pk]
    # The manager's view puts the manager's own jobs first.
    body = page_client(world, "manager").get(reverse("dashboard")).content.decode()
    waiting = body[body.index('class="table compact pending"') :]
    shown = [int(pk) for pk in re.findall(r'<tr data-job="(\d+)"', waiting)]
    assert shown == [jobs[0].pk, jobs[2].pk, jobs[1].pk]
