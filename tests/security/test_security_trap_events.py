"""Forged trap events: every attack is one line of the table (who sends what,
the status, the reason the JSON body gives), and after each refusal the rows
the endpoint could touch are exactly as before.

The world: job `train` of vision (2 ranks) was preempted in attempt 1 after a
checkpoint at step 100 and runs again in attempt 2; job `done` of vision has
succeeded; job `other` of ops is running. Tokens are per attempt.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from preemption.event_tokens import attempt_events_token
from preemption.ingest import ingest_trap_event
from preemption.models import Attempt, Checkpoint, Job, JobState, PreemptionEvent, Rank, TrapEvent
from preemption.reconcile.steps import gang_spec

YEAR_5107 = 98_000_000_000.0  # a Unix time in the year 5107


@dataclass
class Jobs:
    train: Job
    first: Attempt
    second: Attempt
    done: Job
    done_attempt: Attempt
    other: Job
    other_attempt: Attempt


def _job(world: Any, team: Any, name: str, state: str, ranks: int = 2) -> Job:
    job = Job.objects.create(
        name=name,
        team=team,
        submitter=world.users["researcher"],
        priority_class=world.batch,
        flavor=world.h100,
        ranks=ranks,
        gpus_per_rank=1,
        command="python train.py",
        state=state,
    )
    job.checkpoint_dir = f"/var/qm/checkpoints/job-{job.pk}"
    job.save(update_fields=["checkpoint_dir"])
    return job


def _attempt(job: Job, number: int, *, started: float, ended: bool, reason: str = "") -> Attempt:
    now = timezone.now()
    attempt = Attempt.objects.create(
        job=job,
        number=number,
        placement=[{"node": "h100-node-0", "ranks": job.ranks}],
        admitted_at=now - timedelta(seconds=started),
        launched_at=now - timedelta(seconds=started),
        ended_at=now - timedelta(seconds=started / 2) if ended else None,
        end_reason=reason,
    )
    for index in range(job.ranks):
        Rank.objects.create(
            attempt=attempt,
            index=index,
            node="h100-node-0",
            state="exited" if ended else "running",
            exit_code=0 if ended else None,
        )
    return attempt


@pytest.fixture
def jobs(world: Any) -> Jobs:
    train = _job(world, world.vision, "train", JobState.RUNNING)
    first = _attempt(train, 1, started=600, ended=True, reason="preempted")
    Checkpoint.objects.create(
        job=train,
        attempt=first,
        step=100,
        path=f"{train.checkpoint_dir}/step_100",
        committed_at=timezone.now() - timedelta(seconds=400),
    )
    Job.objects.filter(pk=train.pk).update(resume_step=101)
    train.refresh_from_db()
    second = _attempt(train, 2, started=60, ended=False)
    done = _job(world, world.vision, "done", JobState.SUCCEEDED)
    done_attempt = _attempt(done, 1, started=300, ended=True, reason="succeeded")
    other = _job(world, world.ops, "other", JobState.RUNNING)
    other_attempt = _attempt(other, 1, started=60, ended=False)
    return Jobs(train, first, second, done, done_attempt, other, other_attempt)


def snapshot() -> dict[str, list[dict[str, Any]]]:
    """Every row an event could add or change."""
    return {
        "trap_events": list(TrapEvent.objects.order_by("pk").values()),
        "checkpoints": list(Checkpoint.objects.order_by("pk").values()),
        "jobs": list(Job.objects.order_by("pk").values()),
        "attempts": list(Attempt.objects.order_by("pk").values()),
        "ranks": list(Rank.objects.order_by("pk").values()),
        "preemptions": list(PreemptionEvent.objects.order_by("pk").values()),
    }


def event(name: str = "checkpoint_committed", **fields: Any) -> Callable[[Jobs], dict[str, Any]]:
    def build(j: Jobs) -> dict[str, Any]:
        body: dict[str, Any] = {
            "event": name,
            "job_id": j.train.pk,
            "attempt": 2,
            "rank": 0,
            "at": time.time(),
        }
        if name in ("checkpoint_committed", "checkpoint_started", "resumed"):
            body.update(step=150, bytes=4096, seconds=1.5)
        body.update(fields)
        return body

    return build


def token_of(pick: Callable[[Jobs], Attempt]) -> Callable[[Jobs], str]:
    return lambda j: attempt_events_token(pick(j))


OPEN = token_of(lambda j: j.second)


@dataclass
class Attack:
    name: str
    body: Callable[[Jobs], Any]
    status: int
    reason: str
    token: Callable[[Jobs], str | None] = OPEN
    job: Callable[[Jobs], Job] = lambda j: j.train
    settings: dict[str, Any] = field(default_factory=dict)


ATTACKS = [
    # Tokens: per attempt, only while it is open, only on their own job.
    Attack(
        "succeeded job's token",
        lambda j: {**event()(j), "job_id": j.done.pk, "attempt": 1},
        403,
        "which has ended",
        token=token_of(lambda j: j.done_attempt),
        job=lambda j: j.done,
    ),
    Attack(
        "ended attempt's token",
        event(attempt=1),
        403,
        "which has ended",
        token=token_of(lambda j: j.first),
    ),
    Attack(
        "another job's token",
        event(),
        403,
        "needs the open attempt's events token",
        token=token_of(lambda j: j.other_attempt),
    ),
    Attack("no token", event(), 403, "needs the open attempt's events token", token=lambda j: None),
    Attack(
        "a made-up token",
        event(),
        403,
        "needs the open attempt's events token",
        token=lambda j: "0" * 64,
    ),
    Attack(
        "a user's session is no token",
        event(),
        403,
        "needs the open attempt's events token",
        token=lambda j: "session",
    ),
    # The event must be of this attempt, this job and one of its ranks.
    Attack("event of an ended attempt", event(attempt=1), 400, "This token is for attempt 2"),
    Attack("event of a future attempt", event(attempt=3), 400, "This token is for attempt 2"),
    Attack("rank beyond the gang", event(rank=2), 400, "has ranks 0 to 1"),
    Attack("rank 10^9", event(rank=10**9), 400, "has ranks 0 to 1"),
    Attack("negative rank", event(rank=-1), 400, "Must be a whole number from 0"),
    Attack(
        "another job's id",
        lambda j: {**event()(j), "job_id": j.other.pk},
        400,
        "takes events of job",
    ),
    # Steps are bounded, and a checkpoint cannot leap ahead of what was trained.
    Attack("step 10^9", event(step=10**9), 400, "is too far ahead"),
    Attack("step beyond 32 bits", event(step=2**31), 400, "Must be a whole number from 0 to"),
    Attack("negative step", event(step=-5), 400, "Must be a whole number from 0 to"),
    Attack("boolean step", event(step=True), 400, "Must be a whole number"),
    Attack("commit without a step", event(step=None), 400, "needs the step"),
    Attack("absurd byte count", event(bytes=2**60), 400, "Must be a whole number from 0 to"),
    Attack("absurd duration", event(seconds=1e12), 400, "Must be a duration in seconds"),
    Attack("time that is no number", event(at="5107-01-01"), 400, "Must be a Unix time"),
    # A batch is all or nothing: a bad event refuses the good one beside it.
    Attack(
        "good event beside a forged one",
        lambda j: [event(step=120)(j), event(step=10**9)(j)],
        400,
        "is too far ahead",
    ),
    # Each rank of an attempt stores at most QM_TRAP_EVENTS_PER_RANK events.
    Attack(
        "over the per-rank cap",
        event("exiting", code=0),
        429,
        "QM_TRAP_EVENTS_PER_RANK",
        settings={"QM_TRAP_EVENTS_PER_RANK": 1},
    ),
]


def _post(j: Jobs, attack: Attack) -> Any:
    client = APIClient()
    token = attack.token(j)
    if token == "session":
        client.force_authenticate(get_user_model().objects.get(username="researcher"))
        token = None
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    url = f"/api/v1/jobs/{attack.job(j).pk}/events/"
    return client.post(url, attack.body(j), format="json", **headers)


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_a_forged_event_is_refused_with_its_reason_and_changes_nothing(
    jobs: Jobs, attack: Attack, settings: Any
) -> None:
    for name, value in attack.settings.items():
        setattr(settings, name, value)
    if attack.status == 429:
        # Fill the rank's allowance with one real event first.
        first = _post(jobs, Attack("", event("signal_received"), 202, ""))
        assert first.status_code == 202, first.content
    before = snapshot()
    response = _post(jobs, attack)
    assert response.status_code == attack.status, response.content
    assert attack.reason in str(response.json()), response.json()
    assert snapshot() == before


def test_a_forged_checkpoint_is_recorded_with_the_servers_time_path_and_a_bounded_step(
    jobs: Jobs,
) -> None:
    """The finding as reported: a checkpoint dated 5107 at /etc/shadow. Within
    bounds the step is taken, but the date and the path are the server's."""
    before_post = time.time()
    forged = event(at=YEAR_5107, path="/etc/shadow", step=150, extra={"x": "y" * 100})(jobs)
    response = _post(jobs, Attack("", lambda j: forged, 202, ""))
    assert response.status_code == 202 and response.json() == {"accepted": 1, "duplicates": 0}
    checkpoint = Checkpoint.objects.get(job=jobs.train, step=150)
    assert checkpoint.path == (
        f"{jobs.train.checkpoint_dir}/step_150.attempt_{checkpoint.attempt.number}"
    )
    assert before_post <= checkpoint.committed_at.timestamp() <= time.time()
    stored = TrapEvent.objects.get(job=jobs.train, step=150)
    assert stored.at <= time.time() and "path" not in stored.payload
    assert "extra" not in stored.payload
    jobs.train.refresh_from_db()
    assert jobs.train.resume_step == 151

    # The same event with `at` moved by 1e-9 (or any other free field changed) is a duplicate.
    before = snapshot()
    for nudged in (
        {**forged, "at": YEAR_5107 + 1e-9},
        {**forged, "at": forged["at"] - 1e-9, "bytes": 1},
    ):
        again = _post(jobs, Attack("", lambda j, body=nudged: body, 202, ""))
        assert again.json() == {"accepted": 0, "duplicates": 1}
    assert snapshot() == before


def test_an_event_before_the_attempt_began_is_dated_at_its_start(jobs: Jobs) -> None:
    response = _post(jobs, Attack("", event("signal_received", at=1.0, rank=1), 202, ""))
    assert response.status_code == 202
    rank = Rank.objects.get(attempt=jobs.second, index=1)
    assert rank.signal_received_at == jobs.second.admitted_at


def test_the_duplicate_key_is_per_job_and_attempt(jobs: Jobs) -> None:
    """The same event of another attempt is a new event, not a duplicate."""
    ops = event("signal_received", job_id=None, attempt=1)(jobs)
    ops["job_id"] = jobs.other.pk
    mine = event("signal_received")(jobs)
    assert _post(jobs, Attack("", lambda j: mine, 202, "")).json()["accepted"] == 1
    other = _post(
        jobs,
        Attack(
            "",
            lambda j: ops,
            202,
            "",
            token=token_of(lambda j: j.other_attempt),
            job=lambda j: j.other,
        ),
    )
    assert other.json() == {"accepted": 1, "duplicates": 0}


def test_a_token_expires_when_its_attempt_ends(jobs: Jobs) -> None:
    signal = event("signal_received")
    assert _post(jobs, Attack("", signal, 202, "")).status_code == 202
    Attempt.objects.filter(pk=jobs.second.pk).update(
        ended_at=timezone.now(), end_reason="succeeded"
    )
    Job.objects.filter(pk=jobs.train.pk).update(state=JobState.SUCCEEDED)
    before = snapshot()
    late = _post(jobs, Attack("", event(step=150), 403, ""))
    assert late.status_code == 403 and "has ended" in late.json()["detail"]
    assert snapshot() == before


def test_log_lines_obey_the_same_rules(jobs: Jobs) -> None:
    """A rank writes its own log, so a QM_EVENT line there is checked like a POST."""
    before = snapshot()
    with pytest.raises(Exception, match="too far ahead"):
        ingest_trap_event(attempt=jobs.second, event=event(step=10**9)(jobs), source="log")
    with pytest.raises(PermissionDenied, match="has ended"):
        ingest_trap_event(attempt=jobs.first, event=event(attempt=1)(jobs), source="log")
    assert snapshot() == before


def test_every_attempt_hands_its_ranks_its_own_token(jobs: Jobs) -> None:
    """The runtimes get the token through the gang's environment (the local
    runtime sets it for each rank, Kubernetes puts it in the attempt's Secret)."""
    ranks = list(Rank.objects.filter(attempt=jobs.second))
    env = gang_spec(jobs.train, jobs.second, ranks).env
    assert env["QM_EVENTS_TOKEN"] == attempt_events_token(jobs.second)
    tokens = {attempt_events_token(a) for a in (jobs.first, jobs.second, jobs.other_attempt)}
    assert len(tokens) == 3
    # Derived, not drawn: a launch tried twice hands out the same token.
    assert (
        gang_spec(jobs.train, jobs.second, ranks).env["QM_EVENTS_TOKEN"] == env["QM_EVENTS_TOKEN"]
    )


def test_the_admin_never_shows_an_events_token(jobs: Jobs, world: Any) -> None:
    browser = Client()
    browser.force_login(world.users["admin"])
    token = attempt_events_token(jobs.second)
    pages = [
        reverse("admin:preemption_attempt_change", args=[jobs.second.pk]),
        reverse("admin:preemption_job_change", args=[jobs.train.pk]),
        reverse("admin:preemption_attempt_changelist"),
    ]
    for url in pages:
        page = browser.get(url)
        assert page.status_code == 200, url
        assert token.encode() not in page.content, url
        assert jobs.second.events_key.encode() not in page.content, url


def test_the_trap_posts_with_its_attempts_token_and_is_refused_once_the_attempt_ends(
    jobs: Jobs, live_server: Any
) -> None:
    """The trap's own reporter, over real HTTP, against the running portal: its
    protocol is unchanged, only the token it is given is the attempt's."""
    import io

    from gracetrap.events import EventReporter

    def reporter() -> EventReporter:
        return EventReporter(
            job_id=jobs.train.pk,
            attempt=2,
            rank=lambda: 1,
            events_url=f"{live_server.url}/api/v1/jobs/{jobs.train.pk}/events/",
            events_token=attempt_events_token(jobs.second),
            stream=io.StringIO(),
        )

    trap = reporter()
    trap.emit("signal_received")
    trap.emit("checkpoint_committed", step=130, bytes=2048, seconds=0.5)
    trap.flush(10)
    assert (trap.posts_sent, trap.posts_failed) == (2, 0)
    assert TrapEvent.objects.filter(job=jobs.train, attempt=2, rank=1, source="post").count() == 2
    assert Job.objects.get(pk=jobs.train.pk).resume_step == 131

    Attempt.objects.filter(pk=jobs.second.pk).update(
        ended_at=timezone.now(), end_reason="preempted"
    )
    before = snapshot()
    late = reporter()
    late.emit("exiting", code=0)
    late.flush(10)
    assert (late.posts_sent, late.posts_failed) == (0, 1)
    assert snapshot() == before
