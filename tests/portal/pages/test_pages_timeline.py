"""A preemption's timeline on the job page tells that preemption only.

The job below is preempted twice. Its attempts also report a regular
checkpoint before each decision, and the job's resume step has moved on by the
time the page is read. Each timeline must start at its own decision, show
its own checkpoint and the resume step recorded when it requeued the job, have
no negative offset, and show the signal sent before it was received.
"""

from __future__ import annotations

import html
import re
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from preemption.models import Attempt, Checkpoint, Job, JobState, PreemptionEvent, Rank, TrapEvent
from tests.portal.pages.conftest import page_client

pytestmark = pytest.mark.django_db


def _trap(job: Job, attempt: int, rank: int, name: str, at: datetime, step: int | None) -> None:
    payload: dict[str, Any] = {"event": name}
    if step is not None:
        payload["step"] = step
    if name == "checkpoint_committed":
        payload.update(bytes=50_000_000, seconds=2.0)
    TrapEvent.objects.create(
        job=job,
        attempt=attempt,
        rank=rank,
        event=name,
        at=at.timestamp(),
        step=step,
        payload=payload,
        fingerprint=f"{job.pk}-{attempt}-{rank}-{name}-{step}-{at.timestamp()}",
        source="post",
    )


def _job(world: Any, name: str) -> Job:
    """A running two-rank job of ops, read by other_researcher."""
    return Job.objects.create(
        name=name,
        team=world.ops,
        submitter=world.users["other_researcher"],
        priority_class=world.batch,
        flavor=world.h100,
        ranks=2,
        gpus_per_rank=4,
        command="python train.py",
        state=JobState.RUNNING,
    )


def _attempt(job: Job, number: int, admitted: datetime, ended: datetime | None) -> Attempt:
    attempt = Attempt.objects.create(
        job=job,
        number=number,
        admitted_at=admitted,
        launched_at=admitted,
        ended_at=ended,
        end_reason="preempted" if ended else "",
        placement=[{"node": "h100-node-0", "ranks": 2}],
    )
    return attempt


def _regular_checkpoint(job: Job, attempt: Attempt, step: int, at: datetime) -> None:
    """A checkpoint the training loop takes every N steps, before any decision."""
    for rank in range(2):
        _trap(job, attempt.number, rank, "checkpoint_started", at, step)
        _trap(job, attempt.number, rank, "checkpoint_committed", at + timedelta(seconds=2), step)
    Checkpoint.objects.create(
        job=job, attempt=attempt, step=step, committed_at=at + timedelta(seconds=2)
    )


def _preemption(
    world: Any,
    job: Job,
    attempt: Attempt,
    decided: datetime,
    *,
    step: int,
    resume_step: int,
) -> PreemptionEvent:
    """A reclaim of `attempt` at `decided`: signal sent at +0.2 s, received at
    +0.3 s and +0.4 s, checkpoint of `step` from +1 s to +3 s, exits at +8 s
    and +9 s, requeued at +10 s with `resume_step`."""
    for rank in range(2):
        Rank.objects.create(
            attempt=attempt,
            index=rank,
            node="h100-node-0",
            state="exited",
            exit_code=0,
            signal_sent_at=decided + timedelta(milliseconds=200),
            signal_received_at=decided + timedelta(milliseconds=300 + 100 * rank),
            exited_at=decided + timedelta(seconds=8 + rank),
        )
        _trap(job, attempt.number, rank, "signal_received", decided + timedelta(seconds=0.3), None)
        _trap(job, attempt.number, rank, "checkpoint_started", decided + timedelta(seconds=1), step)
        _trap(
            job, attempt.number, rank, "checkpoint_committed", decided + timedelta(seconds=3), step
        )
    Checkpoint.objects.create(
        job=job, attempt=attempt, step=step, committed_at=decided + timedelta(seconds=3)
    )
    return PreemptionEvent.objects.create(
        victim_attempt=attempt,
        job=job,
        reason="reclaim",
        cause="reclaimed by vision",
        decided_at=decided,
        grace_seconds=60.0,
        deadline=decided + timedelta(seconds=60),
        signal_sent_at=decided + timedelta(milliseconds=200),
        all_exited_at=decided + timedelta(seconds=9),
        checkpoint_step=step,
        checkpoint_bytes=50_000_000,
        checkpoint_seconds=2.0,
        outcome="graceful",
        requeued_at=decided + timedelta(seconds=10),
        resume_step=resume_step,
        resumed_at=decided + timedelta(seconds=35),
    )


def _resumed(job: Job, attempt: Attempt, step: int, at: datetime) -> None:
    for rank in range(2):
        _trap(job, attempt.number, rank, "resumed", at, step)


def _timelines(body: str) -> dict[int, list[tuple[str, str, str]]]:
    """Per preempted attempt, the timeline's lines: (offset, title, detail)."""
    found = {}
    for number, panel in re.findall(
        r"<h2>Preemption of attempt (\d+) .*?<ol class=\"timeline\">(.*?)</ol>", body, re.S
    ):
        lines = []
        for at, title, detail in re.findall(
            r'<span class="at">([^<]*)</span>.*?<strong>([^<]*)</strong>'
            r'(?:<div class="muted small">([^<]*)</div>)?',
            panel,
            re.S,
        ):
            lines.append((html.unescape(at), html.unescape(title), html.unescape(detail)))
        found[int(number)] = lines
    return found


def test_each_timeline_tells_its_own_preemption(world: Any) -> None:
    start = timezone.now() - timedelta(hours=2)
    job = _job(world, "twice")
    # Attempt 1: a regular checkpoint of step 19, then the first reclaim at
    # step 45, requeued to resume from 46.
    first = _attempt(job, 1, start, start + timedelta(seconds=209))
    _regular_checkpoint(job, first, 19, start + timedelta(seconds=100))
    first_decided = start + timedelta(seconds=200)
    _preemption(world, job, first, first_decided, step=45, resume_step=46)
    # Attempt 2 resumes from 46, checkpoints step 577 regularly, and is
    # reclaimed at step 639, requeued to resume from 640.
    second = _attempt(
        job, 2, first_decided + timedelta(seconds=30), start + timedelta(seconds=1209)
    )
    _resumed(job, second, 46, first_decided + timedelta(seconds=35))
    _regular_checkpoint(job, second, 577, start + timedelta(seconds=1100))
    second_decided = start + timedelta(seconds=1200)
    _preemption(world, job, second, second_decided, step=639, resume_step=640)
    # Attempt 3 resumes from 640 and has checkpointed further since.
    third = _attempt(job, 3, second_decided + timedelta(seconds=30), None)
    _resumed(job, third, 640, second_decided + timedelta(seconds=35))
    _regular_checkpoint(job, third, 700, second_decided + timedelta(seconds=300))
    Job.objects.filter(pk=job.pk).update(resume_step=701)

    body = (
        page_client(world, "other_researcher")
        .get(reverse("job-detail", args=[job.pk]))
        .content.decode()
    )
    timelines = _timelines(body)
    assert sorted(timelines) == [1, 2]
    for number, step, resume in ((1, 45, 46), (2, 639, 640)):
        lines = timelines[number]
        assert lines[0][:2] == ("+0.00 s", "Preemption decided")
        assert lines[1:] == [
            ("+0.20 s", "Signal sent to all 2 ranks", ""),
            (
                "+0.40 s",
                "Every rank received the signal (2 of 2)",
                "first after 0.30 s, spread 0.10 s",
            ),
            ("+1.00 s", "Checkpoint started", f"step {step}"),
            ("+3.00 s", "Checkpoint committed", f"step {step}, 50.0 MB in 2.00 s"),
            ("+9.00 s", "Every rank exited", "exit codes 0; outcome graceful"),
            ("+10.00 s", "Requeued", f"resumes from step {resume}"),
            ("+35.00 s", "Resumed", f"attempt {number + 1}, from step {resume}"),
        ], number
    # The ranks' table: signal sent before received, nothing before the decision.
    offsets = [float(x) for x in re.findall(r"\+(-?[\d.]+) s", body)]
    assert offsets and min(offsets) >= 0.0
    assert "+-" not in body


def _event(job: Job, rank: int, name: str, at: datetime, step: int | None, **extra: Any) -> None:
    TrapEvent.objects.create(
        job=job,
        attempt=1,
        rank=rank,
        event=name,
        at=at.timestamp(),
        step=step,
        payload={"event": name, "step": step, **extra},
        fingerprint=f"{job.pk}-{rank}-{name}-{step}-{at.timestamp()}",
        source="post",
    )


def _noticed(world: Any, decided: datetime, *, answered: int, final: int = 93) -> Job:
    """A reclaim with a checkpoint notice at +0.1 s (window until +30 s). `answered`
    ranks commit step 90 in the background (+2.3 s and +2.4 s); the signal follows
    at +2.6 s when they answered, else at +30.1 s; the final save of step `final`
    runs from 0.4 s to 0.9 s after the signal, or, when `final` is the notice's step
    90, is skipped 0.4 s after it; the ranks exit 2.4 s and 3.4 s after it. A
    regular save of step 85, begun before the decision, commits at +0.2 s."""
    job = _job(world, "noticed")
    signal = decided + timedelta(seconds=2.6 if answered else 30.1)
    attempt = _attempt(job, 1, decided - timedelta(hours=1), signal + timedelta(seconds=4))
    for rank in range(2):
        Rank.objects.create(
            attempt=attempt,
            index=rank,
            node="h100-node-0",
            state="exited",
            exit_code=0,
            signal_sent_at=signal,
            signal_received_at=signal + timedelta(milliseconds=100 + 100 * rank),
            exited_at=signal + timedelta(seconds=2.4 + rank),
        )
        _event(job, rank, "checkpoint_started", decided - timedelta(seconds=0.5), 85)
        _event(
            job,
            rank,
            "checkpoint_committed",
            decided + timedelta(seconds=0.2),
            85,
            bytes=50_000_000,
            seconds=0.7,
            background=True,
            notice=False,
        )
        _event(job, rank, "notice_received", decided + timedelta(seconds=0.1), None)
        _event(job, rank, "checkpoint_started", decided + timedelta(seconds=0.3), 90)
        if rank < answered:
            _event(
                job,
                rank,
                "checkpoint_committed",
                decided + timedelta(seconds=2.3 + 0.1 * rank),
                90,
                bytes=50_000_000,
                seconds=2.0,
                background=True,
                notice=True,
            )
        if final == 90:
            _event(
                job,
                rank,
                "checkpoint_skipped",
                signal + timedelta(seconds=0.4),
                90,
                reason="step 90 is already checkpointed",
            )
            continue
        _event(job, rank, "checkpoint_started", signal + timedelta(seconds=0.4), final)
        _event(
            job,
            rank,
            "checkpoint_committed",
            signal + timedelta(seconds=0.9),
            final,
            bytes=50_000_000,
            seconds=0.5,
            background=False,
            notice=False,
        )
    PreemptionEvent.objects.create(
        victim_attempt=attempt,
        job=job,
        reason="reclaim",
        cause="reclaimed by vision",
        decided_at=decided,
        grace_seconds=60.0,
        deadline=decided + timedelta(seconds=60),
        notice_deadline=decided + timedelta(seconds=30),
        notice_sent_at=decided + timedelta(seconds=0.1),
        notice_committed_at=decided + timedelta(seconds=2.3) if answered else None,
        signal_sent_at=signal,
        all_exited_at=signal + timedelta(seconds=3.4),
        checkpoint_step=final,
        outcome="graceful",
        requeued_at=signal + timedelta(seconds=4.4),
        resume_step=final + 1,
    )
    return job


def test_a_noticed_preemption_shows_the_notice_apart_from_the_final_save(world: Any) -> None:
    decided = timezone.now() - timedelta(hours=1)
    job = _noticed(world, decided, answered=2)
    body = (
        page_client(world, "other_researcher")
        .get(reverse("job-detail", args=[job.pk]))
        .content.decode()
    )
    window = f"{decided + timedelta(seconds=30):%H:%M:%S}"
    assert _timelines(body)[1][1:] == [
        (
            "+0.10 s",
            "Checkpoint notice sent to all 2 ranks",
            "they checkpoint while training goes on; the eviction follows their commit, "
            f"at the latest at {window}",
        ),
        (
            "+2.30 s",
            "The notice's checkpoint committed",
            "step 90, 50.0 MB in 2.00 s, written in the background",
        ),
        ("+2.60 s", "Signal sent to all 2 ranks", ""),
        (
            "+2.80 s",
            "Every rank received the signal (2 of 2)",
            "first after 2.70 s, spread 0.10 s",
        ),
        ("+3.00 s", "Checkpoint started", "step 93"),
        ("+3.50 s", "Checkpoint committed", "step 93, 50.0 MB in 0.50 s"),
        ("+6.00 s", "Every rank exited", "exit codes 0; outcome graceful"),
        ("+7.00 s", "Requeued", "resumes from step 94"),
    ]


def test_an_eviction_at_the_notice_step_resumes_from_the_notice_checkpoint(world: Any) -> None:
    """The signal came before the ranks ran another step after the notice's commit:
    the eviction's save is skipped, the job resumes from the notice's checkpoint,
    and the regular save that committed after the decision is not shown as the
    eviction's."""
    decided = timezone.now() - timedelta(hours=1)
    job = _noticed(world, decided, answered=2, final=90)
    body = (
        page_client(world, "other_researcher")
        .get(reverse("job-detail", args=[job.pk]))
        .content.decode()
    )
    assert [line[:2] for line in _timelines(body)[1][1:]] == [
        ("+0.10 s", "Checkpoint notice sent to all 2 ranks"),
        ("+2.30 s", "The notice's checkpoint committed"),
        ("+2.60 s", "Signal sent to all 2 ranks"),
        ("+2.80 s", "Every rank received the signal (2 of 2)"),
        ("+3.00 s", "Checkpoint skipped"),
        ("+6.00 s", "Every rank exited"),
        ("+7.00 s", "Requeued"),
    ]
    lines = dict((line[1], line[2]) for line in _timelines(body)[1])
    assert lines["The notice's checkpoint committed"].startswith("step 90, 50.0 MB")
    assert lines["Checkpoint skipped"] == "step 90 is already checkpointed"
    assert lines["Requeued"] == "resumes from step 91"
    assert "step 85" not in body


def test_a_notice_no_rank_answered_says_the_window_ran_out(world: Any) -> None:
    decided = timezone.now() - timedelta(hours=1)
    job = _noticed(world, decided, answered=0)
    body = (
        page_client(world, "other_researcher")
        .get(reverse("job-detail", args=[job.pk]))
        .content.decode()
    )
    lines = _timelines(body)[1]
    assert lines[1][:2] == ("+0.10 s", "Checkpoint notice sent to all 2 ranks")
    assert lines[2] == (
        "+30.00 s",
        "Notice window over: no rank had committed a checkpoint",
        "the eviction went ahead as without a notice",
    )
    assert lines[3] == ("+30.10 s", "Signal sent to all 2 ranks", "")
    # The eviction's own save, not the notice's, is the checkpoint the timeline shows.
    assert ("+30.50 s", "Checkpoint started", "step 93") in lines
    assert ("+31.00 s", "Checkpoint committed", "step 93, 50.0 MB in 0.50 s") in lines


def test_a_rank_told_by_the_relay_before_its_own_signal_is_shown_as_such(world: Any) -> None:
    start = timezone.now() - timedelta(hours=1)
    job = _job(world, "relayed")
    attempt = _attempt(job, 1, start, start + timedelta(seconds=209))
    decided = start + timedelta(seconds=200)
    _preemption(world, job, attempt, decided, step=45, resume_step=46)
    # Rank 1's own signal never came: rank 0's reached it through the gang's relay.
    Rank.objects.filter(attempt=attempt, index=1).update(signal_received_at=None)
    TrapEvent.objects.filter(job=job, rank=1, event="signal_received").delete()
    TrapEvent.objects.create(
        job=job,
        attempt=1,
        rank=1,
        event="stop_heard",
        at=(decided + timedelta(milliseconds=301)).timestamp(),
        payload={"event": "stop_heard", "from_rank": 0, "signalled_at": 0.0},
        fingerprint=f"{job.pk}-heard",
        source="post",
    )

    body = (
        page_client(world, "other_researcher")
        .get(reverse("job-detail", args=[job.pk]))
        .content.decode()
    )
    lines = _timelines(body)[1]
    assert ("+0.30 s", "1 of 2 ranks received the signal", "first after 0.30 s, spread 0.00 s") in (
        lines
    )
    assert (
        "+0.30 s",
        "Every rank knew of the stop (2 of 2)",
        "1 heard of rank 0's signal through the gang's relay; the last knew after 0.30 s",
    ) in lines
    detail = re.search(r'<details class="ranks-detail".*?</details>', body, re.S)
    assert detail is not None
    rows = re.findall(r"<tr><td class=\"num\">(\d)</td>(.*?)</tr>", detail.group(0), re.S)
    heard = {int(index): row for index, row in rows}
    assert "+0.301 s" in heard[1] and "from rank 0" in heard[1]
    assert "from rank" not in heard[0]
