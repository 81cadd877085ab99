"""The exits listener (manage.py watch_exits, and make run's own thread) closes a job
as its ranks exit, in its own process: no worker and no periodic pass is needed.
While it is alive the periodic passes leave it the gangs that have just ended."""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from django.core.management import call_command

from preemption.cycle import schedule_cycle
from preemption.models import Attempt, Job, JobState
from preemption.reconcile import exits, hold, listen_for_exits, passes, reconcile_jobs
from preemption.runtime import use_runtime
from preemption.runtimes import GangId
from preemption.runtimes.mimic import MimicRuntime
from tests import builders
from tests.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


@pytest.fixture
def handed_over(monkeypatch: pytest.MonkeyPatch) -> list[list[int] | None]:
    """The passes the listener hands to the worker instead of running them itself."""
    sent: list[list[int] | None] = []
    monkeypatch.setattr(exits, "send_reconcile", lambda job_ids=None: sent.append(job_ids))
    return sent


@pytest.fixture
def listening() -> Iterator[threading.Event]:
    stop = threading.Event()
    listener = threading.Thread(target=listen_for_exits, args=(stop,))
    listener.start()
    try:
        yield stop
    finally:
        stop.set()
        listener.join(timeout=10)
    assert not listener.is_alive()


def launched(world: Any, command: str) -> list[Job]:
    jobs = [
        builders.job(world, team, state=JobState.PENDING, command=command)
        for team in (world.vision, world.nlp)
    ]
    schedule_cycle()  # admits and launches them
    assert Attempt.objects.filter(job__in=jobs, launched_at__isnull=False).count() == 2
    return jobs


def test_jobs_are_closed_as_their_gangs_end(
    world: Any, mimic: MimicRuntime, handed_over: list[Any], listening: threading.Event
) -> None:
    jobs = launched(world, "sleep 0.3")
    # The states first: a job's close marks its gang to be forgotten in the same
    # transaction, so once both jobs read as succeeded, an action read after them
    # that is done is one the listener finished (read the other way round, a close
    # committed between the two reads looked finished).
    wait_until(
        lambda: (
            set(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("state", flat=True))
            == {JobState.SUCCEEDED}
            and not Attempt.objects.filter(job__in=jobs)
            .exclude(action=Attempt.Action.NONE)
            .exists()
        ),
        "both jobs closed and their gangs forgotten by the listener",
    )
    assert handed_over == []
    for job in jobs:
        attempt = Attempt.objects.get(job=job)
        assert (attempt.end_reason, attempt.action) == (
            Attempt.EndReason.SUCCEEDED,
            Attempt.Action.NONE,
        )
        assert mimic.observe(GangId(job.pk, 1)) == [], "the gang is forgotten"


def test_a_stopped_gang_is_closed_as_it_stops(
    world: Any, mimic: MimicRuntime, handed_over: list[Any], listening: threading.Event
) -> None:
    jobs = launched(world, "sleep 600")
    mimic.kill(GangId(jobs[0].pk, 1))
    wait_until(
        lambda: Attempt.objects.filter(job=jobs[0], ended_at__isnull=False).exists(),
        "the killed gang's attempt closed",
    )
    assert Attempt.objects.get(job=jobs[0]).end_reason == Attempt.EndReason.FAILED
    assert Attempt.objects.get(job=jobs[1]).ended_at is None
    assert handed_over == []


def test_a_pass_that_fails_is_handed_to_the_worker(
    world: Any,
    mimic: MimicRuntime,
    handed_over: list[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(**_: Any) -> int:
        raise RuntimeError("the database went away")

    monkeypatch.setattr(exits, "reconcile_jobs", broken)
    jobs = launched(world, "sleep 0.2")
    stop = threading.Event()
    listener = threading.Thread(target=listen_for_exits, args=(stop,))
    listener.start()
    try:
        wait_until(lambda: len(handed_over) >= 1, "the failed pass handed over")
    finally:
        stop.set()
        listener.join(timeout=10)
    assert sorted(job for ids in handed_over for job in ids) == sorted(j.pk for j in jobs)
    assert Attempt.objects.filter(job__in=jobs, ended_at__isnull=True).count() == 2


def test_a_runtime_that_cannot_tell_of_exits_is_not_listened_to(world: Any) -> None:
    use_runtime(SimpleNamespace(name="plain"))  # type: ignore[arg-type]
    try:
        assert listen_for_exits(threading.Event()) is False
        out = io.StringIO()
        call_command("watch_exits", stdout=out)
    finally:
        use_runtime(None)
    assert "does not announce exits here" in out.getvalue()


def test_the_periodic_pass_leaves_fresh_ends_to_a_live_listener(
    world: Any, mimic: MimicRuntime, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = launched(world, "sleep 0.2")
    wait_until(
        lambda: all(o.phase == "exited" for j in jobs for o in mimic.observe(GangId(j.pk, 1))),
        "both gangs' time over",
    )
    open_attempts = Attempt.objects.filter(job__in=jobs, ended_at__isnull=True)
    marker = Path(settings.VAR_DIR) / "exits.listening"
    marker.touch()  # as a live listener does
    assert hold.exits_listened()
    reconcile_jobs()
    assert open_attempts.count() == 2, "the periodic pass left them to the listener"
    # The listener's own pass is a pass of those jobs.
    reconcile_jobs(job_ids=[jobs[0].pk])
    assert list(open_attempts.values_list("job_id", flat=True)) == [jobs[1].pk]
    # An end older than the listener's settling time is the periodic pass's again.
    monkeypatch.setattr(passes, "SETTLE_SECONDS", 0.0)
    reconcile_jobs()
    assert open_attempts.count() == 0


def test_a_listener_that_stopped_beating_is_not_waited_for(
    world: Any, mimic: MimicRuntime, settings: Any
) -> None:
    jobs = launched(world, "sleep 0.2")
    wait_until(
        lambda: all(o.phase == "exited" for j in jobs for o in mimic.observe(GangId(j.pk, 1))),
        "both gangs' time over",
    )
    marker = Path(settings.VAR_DIR) / "exits.listening"
    marker.touch()
    past = time.time() - 10 * hold.LISTENER_BEAT_SECONDS
    os.utime(marker, (past, past))
    assert not hold.exits_listened()
    reconcile_jobs()
    assert not Attempt.objects.filter(job__in=jobs, ended_at__isnull=True).exists()


def test_a_listener_beats_while_it_lives_and_takes_its_marker_away(
    world: Any, mimic: MimicRuntime, settings: Any
) -> None:
    stop = threading.Event()
    listener = threading.Thread(target=listen_for_exits, args=(stop,))
    listener.start()
    try:
        wait_until(hold.exits_listened, "the listener's marker")
        first = (Path(settings.VAR_DIR) / "exits.listening").stat().st_mtime
        wait_until(
            lambda: (Path(settings.VAR_DIR) / "exits.listening").stat().st_mtime > first,
            "the listener's next beat",
        )
    finally:
        stop.set()
        listener.join(timeout=10)
    assert not listener.is_alive()
    assert not (Path(settings.VAR_DIR) / "exits.listening").exists()
    assert not hold.exits_listened()
