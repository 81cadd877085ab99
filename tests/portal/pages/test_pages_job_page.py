"""One job's page as a researcher reads it: the story of a forced kill in the order
things happened, a cadence card that agrees with the stop under way, a cancel told
as a cancel, the attempts card in words, the command as typed, and the last lines
of the rank whose failure ended the job, read from the end of its real log."""

from __future__ import annotations

import html
import re
import shlex
import sys
from datetime import timedelta
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from preemption import risk
from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank, RankLogTail
from preemption.runtimes import GangId
from preemption.services import job_cancel, job_submit
from tests import builders
from tests.portal.pages.conftest import page_client
from tests.preemption.conftest import (  # noqa: F401  (fixtures used by name)
    drive,
    local_runtime,
    state_of,
)

BORROWING = (
    "team vision holds 16 h100-80gb GPUs, 8 beyond its guarantee of 8; no owner waits for it now"
)


def _page(world: Any, job: Job, persona: str = "researcher") -> str:
    response = page_client(world, persona).get(reverse("job-detail", args=[job.pk]))
    assert response.status_code == 200
    return response.content.decode()


def _steps(body: str) -> list[str]:
    """The timeline's step titles in the order the page shows them."""
    timeline = body[body.index('class="timeline"') : body.index("</ol>")]
    return re.findall(r"<strong>([^<]+)</strong>", timeline)


def _preempted(
    world: Any, job: Job, attempt: Attempt, *, decided_ago: float, outcome: str = "", **fields: Any
) -> PreemptionEvent:
    """A reclaim of `attempt` by a vision job, decided `decided_ago` seconds ago."""
    owner = builders.job(world, world.vision, ranks=1, gpus_per_rank=8, name="owner")
    decided = timezone.now() - timedelta(seconds=decided_ago)
    fields.setdefault("reason", PreemptionEvent.Reason.RECLAIM)
    return PreemptionEvent.objects.create(
        victim_attempt=attempt,
        job=job,
        preemptor=owner,
        decided_at=decided,
        grace_seconds=60,
        deadline=decided + timedelta(seconds=60),
        outcome=outcome,
        **fields,
    )


@pytest.mark.django_db
def test_the_page_title_names_the_job_without_markup(world: Any) -> None:
    named = builders.job(world, world.vision, name="resnet-sweep")
    unnamed = builders.job(world, world.vision)
    title = re.compile(r"<title>(.*?)</title>", re.S)
    assert title.search(_page(world, named))[1] == f"Job #{named.pk} resnet-sweep · Quartermaster"
    assert title.search(_page(world, unnamed))[1] == f"Job #{unnamed.pk} · Quartermaster"


@pytest.mark.django_db
def test_a_kill_at_the_deadline_comes_before_the_exits_it_caused(world: Any) -> None:
    # The runtime stamps the kill once its call returned (+60.27 s), after the keepers
    # recorded the exits it caused (+60.26 s): the page must still tell the kill first.
    job = builders.job(world, world.vision, ranks=2, state=JobState.REQUEUED)
    attempt = builders.attempt(job, ended_at=timezone.now(), end_reason="preempted")
    event = _preempted(world, job, attempt, decided_ago=120, outcome="killed")
    decided = event.decided_at
    exited = decided + timedelta(seconds=60.26)
    builders.ranks(
        attempt,
        state=Rank.State.EXITED,
        exit_code=137,
        signal_sent_at=decided + timedelta(seconds=0.01),
        exited_at=exited,
    )
    PreemptionEvent.objects.filter(pk=event.pk).update(
        signal_sent_at=decided + timedelta(seconds=0.01),
        killed_at=decided + timedelta(seconds=60.27),
        all_exited_at=exited,
        requeued_at=decided + timedelta(seconds=60.3),
    )
    body = _page(world, job)
    steps = _steps(body)
    assert steps.index("Deadline passed: remaining ranks killed") < steps.index("Every rank exited")
    assert steps[-2:] == ["Every rank exited", "Requeued"]
    # Both at the last exit: no step claims a moment after one it caused.
    timeline = body[body.index('class="timeline"') :]
    kill = timeline[: timeline.index("Deadline passed")]
    assert kill[kill.rindex('class="at"') :].startswith('class="at">+60.26 s')


@pytest.mark.django_db
def test_a_kill_long_before_the_last_exit_is_told_at_its_own_moment(world: Any) -> None:
    job = builders.job(world, world.vision, ranks=1, state=JobState.REQUEUED)
    attempt = builders.attempt(job, ended_at=timezone.now(), end_reason="preempted")
    event = _preempted(world, job, attempt, decided_ago=120, outcome="killed")
    decided = event.decided_at
    builders.ranks(
        attempt,
        state=Rank.State.EXITED,
        exit_code=137,
        exited_at=decided + timedelta(seconds=62),
    )
    PreemptionEvent.objects.filter(pk=event.pk).update(
        killed_at=decided + timedelta(seconds=60.5), all_exited_at=decided + timedelta(seconds=62)
    )
    body = _page(world, job)
    assert 'class="at">+60.50 s' in body and 'class="at">+62.00 s' in body
    steps = _steps(body)
    assert steps.index("Deadline passed: remaining ranks killed") < steps.index("Every rank exited")


def _borrowing_job(world: Any) -> tuple[Job, Attempt]:
    """A running job whose open attempt's stored estimate says no owner waits."""
    job = builders.job(world, world.vision, ranks=2, gpus_per_rank=4)
    attempt = builders.attempt(
        job,
        borrowed_gpus=8,
        preemption_mtbp_seconds=risk.BORROWING,
        preemption_risk_reasons=[BORROWING],
        preemption_risk_at=timezone.now() - timedelta(minutes=5),
    )
    builders.ranks(attempt)
    return job, attempt


def _cadence(body: str) -> str:
    card = body[body.index("data-cadence") :]
    return html.unescape(re.sub(r"<[^>]+>", "", card[: card.index("</section>")]))


@pytest.mark.django_db
def test_the_cadence_card_of_a_job_being_reclaimed_does_not_say_no_owner_waits(
    world: Any,
) -> None:
    job, attempt = _borrowing_job(world)
    _preempted(world, job, attempt, decided_ago=79)
    Job.objects.filter(pk=job.pk).update(state=JobState.PREEMPTING)
    card = _cadence(_page(world, job))
    assert "no owner waits" not in card
    assert "This attempt is being stopped now (decided 79 s ago)" in card
    assert "reclaimed by vision, 8 GPUs under its guarantee" in card
    assert "its next attempt resumes from it" in card
    assert "Before this stop, the risk of preemption was about one every 4 h 0 min" in card
    assert "it is being stopped now: reclaimed by vision" in card


@pytest.mark.django_db
def test_the_cadence_card_after_a_recent_reclaim_says_when_it_was_reclaimed(world: Any) -> None:
    job, second = _borrowing_job(world)
    Attempt.objects.filter(pk=second.pk).update(number=2)
    first = builders.attempt(job, number=1, ended_at=timezone.now(), end_reason="preempted")
    _preempted(world, job, first, decided_ago=79, outcome="graceful")
    card = _cadence(_page(world, job))
    assert "no owner waits" not in card
    assert "Attempt 1 was stopped 79 s ago: reclaimed by vision" in card
    assert (
        "8 beyond its guarantee of 8; attempt 1 was stopped 79 s ago: reclaimed by vision, "
        "8 GPUs under its guarantee"
    ) in card
    assert "Risk of preemption: about one every 4 h 0 min" in card


@pytest.mark.django_db
def test_the_cadence_card_long_after_a_reclaim_keeps_the_estimate_as_it_is(world: Any) -> None:
    job, second = _borrowing_job(world)
    Attempt.objects.filter(pk=second.pk).update(number=2)
    first = builders.attempt(job, number=1, ended_at=timezone.now(), end_reason="preempted")
    _preempted(world, job, first, decided_ago=2 * 3600, outcome="graceful")
    card = _cadence(_page(world, job))
    assert BORROWING in card
    assert "was stopped" not in card


@pytest.mark.django_db
def test_a_cancelled_running_job_reads_cancelling_on_its_page_and_in_the_jobs_list(
    world: Any,
) -> None:
    job = builders.running_job(world, world.vision, name="to-cancel", rank_fields={})
    job = job_cancel(actor=world.users["researcher"], job=job)
    job.refresh_from_db()
    assert job.state == JobState.PREEMPTING  # the model keeps its one stopping state
    body = _page(world, job)
    assert re.search(r'data-field="state">Cancelling</span>', body)
    assert re.search(r'data-field="state-card">Cancelling</p>', body)
    assert ">Preempting<" not in body
    listing = page_client(world, "researcher").get(reverse("job-list")).content.decode()
    row = listing[listing.index(f'data-job="{job.pk}"') :]
    row = row[: row.index("</tr>")]
    assert ">Cancelling</span>" in row and "Preempting" not in row
    # The researcher's own jobs on the dashboard, and the team's jobs on its page.
    for where in (reverse("dashboard"), reverse("team-detail", args=["vision"])):
        other = page_client(world, "researcher").get(where).content.decode()
        row = other[other.index(f"#{job.pk}</a>") :]
        row = row[: row.index("</tr>")]
        assert ">Cancelling</span>" in row and ">preempting<" not in row.lower(), where
    # A job the engine preempts still reads as preempted.
    victim = builders.running_job(world, world.vision, name="victim", rank_fields={})
    _preempted(world, victim, victim.attempts.get(), decided_ago=5)
    Job.objects.filter(pk=victim.pk).update(state=JobState.PREEMPTING)
    assert 'data-field="state">Preempting</span>' in _page(world, victim)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("reason", "shown"),
    [
        (PreemptionEvent.Reason.GANG_GUARD, "Stopping"),
        (PreemptionEvent.Reason.SHUTDOWN, "Stopping"),
        (PreemptionEvent.Reason.RECLAIM, "Preempting"),
    ],
)
def test_the_jobs_list_words_a_stopping_job_as_its_page_does(
    world: Any, reason: str, shown: str
) -> None:
    job = builders.running_job(world, world.vision, name="stopping", rank_fields={})
    _preempted(world, job, job.attempts.get(), decided_ago=5, reason=reason)
    Job.objects.filter(pk=job.pk).update(state=JobState.PREEMPTING)
    assert f'data-field="state">{shown}</span>' in _page(world, job)
    listing = page_client(world, "researcher").get(reverse("job-list")).content.decode()
    row = listing[listing.index(f'data-job="{job.pk}"') :]
    row = row[: row.index("</tr>")]
    assert f">{shown}</span>" in row
    # The researcher's own jobs on the dashboard, and the team's jobs on its page.
    for where in (reverse("dashboard"), reverse("team-detail", args=["vision"])):
        other = page_client(world, "researcher").get(where).content.decode()
        row = other[other.index(f"#{job.pk}</a>") :]
        row = row[: row.index("</tr>")]
        assert f">{shown}</span>" in row, where


@pytest.mark.django_db
def test_the_attempts_card_says_what_its_numbers_count(world: Any) -> None:
    job = builders.job(world, world.vision, max_attempts=5)
    card = re.search(r'data-field="attempt-rules">(.*?)</p>', _page(world, job))
    assert card is not None
    assert re.sub(r"<[^>]+>", "", card[1]) == (
        "a preemption always requeues it · a failure is not retried · "
        "a lost rank is retried until the job has had 5 attempts"
    )
    fixed = builders.job(world, world.vision, priority_class=world.critical, max_attempts=1)
    card = re.search(r'data-field="attempt-rules">(.*?)</p>', _page(world, fixed))
    assert card is not None
    assert re.sub(r"<[^>]+>", "", card[1]) == (
        "a failure is not retried · a lost rank is retried until the job has had 1 attempt"
    )


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("stored", "shown"),
    [
        # `qm submit -- python -c "print('a b')"`: the CLI joins the words for sh.
        (shlex.join(["python", "-c", "print('a b')"]), """python -c "print('a b')\""""),
        (shlex.join(["echo", "it's", "$HOME"]), """echo "it's" '$HOME'"""),
        # A word sh would expand inside double quotes keeps its single quotes.
        (
            shlex.join(["sh", "-c", 'echo "it\'s" $HOME']),
            shlex.join(["sh", "-c", 'echo "it\'s" $HOME']),
        ),
        # Typed as one string (the job form, `--command`): shown exactly as stored.
        (
            """python train.py --note "a b" | tee out.log""",
            """python train.py --note "a b" | tee out.log""",
        ),
    ],
)
def test_the_command_is_shown_as_typed_and_run_as_stored(
    world: Any, stored: str, shown: str
) -> None:
    job = builders.job(world, world.vision, command=stored)
    body = _page(world, job)
    command = re.search(r'<pre class="command">(.*?)</pre>', body, re.S)
    assert command is not None and html.unescape(command[1]) == shown
    assert shlex.split(shown) == shlex.split(stored)  # the same words to sh
    job.refresh_from_db()
    assert job.command == stored
    api = world.client("researcher").get(f"/api/v1/jobs/{job.pk}/").json()
    assert api["command"] == stored


FAILING = f"{shlex.quote(sys.executable)} -c " + shlex.quote(
    "import sys\n"
    "for i in range(200): print(f'line {i}', flush=True)\n"
    "print('Traceback: CUDA out of memory', flush=True)\n"
    "sys.exit(3)"
)


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(180)
def test_a_failed_job_shows_the_last_lines_of_its_failing_rank(
    world: Any,
    drive: Any,  # noqa: F811
    local_runtime: Any,  # noqa: F811
) -> None:
    job = job_submit(
        submitter=world.users["researcher"],
        team=world.vision,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=8,
        command=FAILING,
        priority_class=world.batch,
        name="oom",
    )
    drive(lambda: state_of(job) == JobState.FAILED, what="the job to fail")
    # The page reads the log from its end: no forward read of its bytes at all.
    forward: list[int] = []
    read_log = local_runtime.read_log

    def counted(gang: Any, rank: int, offset: int = 0, limit: int = 1 << 20) -> bytes:
        forward.append(limit)
        return read_log(gang, rank, offset, limit)

    local_runtime.read_log = counted
    body = _page(world, job)
    panel = body[body.index("data-failed-log") :]
    panel = panel[: panel.index("</section>")]
    assert "Last lines of rank 0" in panel and "exit code 3" in panel
    lines = html.unescape(re.search(r'<pre class="command log-tail">(.*?)</pre>', panel, re.S)[1])
    assert lines.splitlines() == [f"line {i}" for i in range(181, 200)] + [
        "Traceback: CUDA out of memory"
    ]
    assert sum(forward) == 0
    assert reverse("rank-log", args=[job.pk, 1, 0]) in panel
    # `qm show` reads the same end through the API, also from the end.
    api = world.client("researcher").get(
        f"/api/v1/jobs/{job.pk}/logs/", {"attempt": 1, "rank": 0, "tail": 40}
    )
    assert api.status_code == 200
    assert sum(forward) == 0
    whole = read_log(GangId(job.pk, 1), 0, 0, 1 << 20)
    assert api.json()["text"] == whole[-40:].decode()
    assert (api.json()["offset"], api.json()["next_offset"]) == (len(whole) - 40, len(whole))


def _failed_job(world: Any) -> tuple[Job, Attempt]:
    """A failed two-rank job: rank 1 exited 1 first, then rank 0 was stopped (143)."""
    job = builders.job(
        world, world.vision, ranks=2, state=JobState.FAILED, failure_reason="rank 1 exited 1"
    )
    attempt = builders.attempt(job, ended_at=timezone.now(), end_reason="failed")
    now = timezone.now()
    Rank.objects.create(
        attempt=attempt, index=0, node="h100-node-0", state="exited", exit_code=143, exited_at=now
    )
    Rank.objects.create(
        attempt=attempt,
        index=1,
        node="h100-node-0",
        state="exited",
        exit_code=1,
        exited_at=now - timedelta(seconds=2),
    )
    return job, attempt


@pytest.mark.django_db
def test_a_failed_job_shows_the_saved_end_of_its_failing_ranks_log(world: Any) -> None:
    # Where logs go with their pods, the attempt's end kept each rank's tail: the
    # page shows whole lines of the rank that failed first, not of the one stopped.
    job, attempt = _failed_job(world)
    kept = b"ial line\n" + b"".join(b"step %d\n" % i for i in range(30)) + b"Killed\n"
    RankLogTail.objects.create(attempt=attempt, rank=1, first_byte=5000, content=kept)
    RankLogTail.objects.create(attempt=attempt, rank=0, first_byte=0, content=b"rank 0 fine\n")
    body = _page(world, job)
    panel = body[body.index("data-failed-log") :]
    panel = panel[: panel.index("</section>")]
    assert "Last lines of rank 1" in panel and "exit code 1" in panel
    lines = html.unescape(re.search(r'<pre class="command log-tail">(.*?)</pre>', panel, re.S)[1])
    assert lines.splitlines() == [f"step {i}" for i in range(11, 30)] + ["Killed"]


@pytest.mark.django_db
def test_a_failed_job_whose_log_is_gone_says_so(world: Any, tmp_path: Any, settings: Any) -> None:
    settings.QM_RUNS_DIR = tmp_path / "runs"
    job, _ = _failed_job(world)
    body = _page(world, job)
    panel = body[body.index("data-failed-log") :]
    panel = panel[: panel.index("</section>")]
    assert "Last lines of rank 1" in panel
    assert "The log cannot be read: gang" in panel and "has no rank 1 on this runtime" in panel


@pytest.mark.django_db
def test_a_job_that_did_not_fail_shows_no_failing_rank(world: Any) -> None:
    job = builders.job(world, world.vision, state=JobState.SUCCEEDED)
    attempt = builders.attempt(job, ended_at=timezone.now(), end_reason="succeeded")
    builders.ranks(attempt, state=Rank.State.EXITED, exit_code=0)
    assert "data-failed-log" not in _page(world, job)
