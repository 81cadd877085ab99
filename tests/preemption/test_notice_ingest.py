"""The ranks' answers to a checkpoint notice arrive in concurrent requests: the first
commit asks for the eviction at once, once, whatever order the requests end in; a
request that cannot get its rank's row in time is told to send again."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction
from django.utils import timezone
from rest_framework.test import APIClient

from preemption import ingest
from preemption.event_tokens import attempt_events_token
from preemption.ingest import ingest_trap_event
from preemption.models import Attempt, Checkpoint, Job, PreemptionEvent, Rank, TrapEvent
from preemption.reconcile import act
from preemption.reconcile.steps import Step
from tests import builders

pytestmark = [pytest.mark.django_db(transaction=True)]


def _noticed_victim(world: Any, ranks: int) -> Attempt:
    job = builders.job(world, world.vision, ranks=ranks, checkpoint_dir="")
    attempt = builders.attempt(job)
    builders.ranks(attempt)
    now = timezone.now()
    PreemptionEvent.objects.create(
        job=job,
        victim_attempt=attempt,
        reason=PreemptionEvent.Reason.RECLAIM,
        decided_at=now - timedelta(seconds=1),
        grace_seconds=60,
        deadline=now + timedelta(seconds=59),
        notice_deadline=now + timedelta(seconds=29),
        notice_sent_at=now - timedelta(seconds=1),
    )
    return attempt


def _commit(rank: int, *, step: int = 12, notice: bool = True) -> dict[str, Any]:
    return {
        "event": "checkpoint_committed",
        "attempt": 1,
        "rank": rank,
        "at": time.time(),
        "step": step,
        "notice": notice,
        "background": True,
    }


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, list[int]]]:
    """When a reconcile pass was asked for, and of which jobs (the broker's own
    sending is Celery's)."""
    calls: list[tuple[float, list[int]]] = []
    monkeypatch.setattr(
        ingest, "send_reconcile", lambda job_ids: calls.append((time.time(), job_ids))
    )
    return calls


def test_two_answers_stored_at_the_same_time_still_ask_for_the_eviction(
    world: Any, sent: list[tuple[float, list[int]]]
) -> None:
    attempt = _noticed_victim(world, ranks=2)
    # Rank 0's request stores its commit and holds its transaction open while rank
    # 1's request stores its own: neither transaction sees the other's row.
    first_stored = threading.Event()
    errors: list[BaseException] = []

    def answer(rank: int) -> None:
        try:
            if rank == 1:
                assert first_stored.wait(timeout=30)
            with transaction.atomic():
                assert ingest_trap_event(attempt=attempt, event=_commit(rank), source="post")
                if rank == 0:
                    first_stored.set()
                    time.sleep(0.5)
        except BaseException as error:
            errors.append(error)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=answer, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert len(sent) >= 1


def test_the_first_answer_asks_for_the_eviction_once_and_records_the_commit(
    world: Any, sent: list[tuple[float, list[int]]]
) -> None:
    """The ranks of a gang commit together, so the first rank's report is the gang's:
    it records the commit on the preemption and asks for one pass; the other ranks'
    reports ask for nothing more."""
    attempt = _noticed_victim(world, ranks=2)
    # A regular commit does not answer the notice.
    assert ingest_trap_event(
        attempt=attempt, event=_commit(1, step=11, notice=False), source="post"
    )
    assert sent == []
    answer = _commit(0)
    assert ingest_trap_event(attempt=attempt, event=answer, source="post")
    assert [job_ids for _, job_ids in sent] == [[attempt.job_id]]
    event = PreemptionEvent.objects.get(victim_attempt=attempt)
    assert event.notice_committed_at is not None
    assert event.notice_committed_at.timestamp() == pytest.approx(answer["at"], abs=1e-6)
    assert ingest_trap_event(attempt=attempt, event=_commit(1), source="post")
    assert len(sent) == 1
    assert PreemptionEvent.objects.get(pk=event.pk).notice_committed_at == event.notice_committed_at


def test_an_answer_after_the_eviction_was_sent_asks_for_nothing(
    world: Any, sent: list[tuple[float, list[int]]]
) -> None:
    attempt = _noticed_victim(world, ranks=1)
    PreemptionEvent.objects.filter(victim_attempt=attempt).update(signal_sent_at=timezone.now())
    assert ingest_trap_event(attempt=attempt, event=_commit(0), source="post")
    assert sent == []


@pytest.mark.parametrize("held", ["rank", "job"])
def test_a_post_that_finds_its_rows_locked_past_the_timeout_is_told_to_retry(
    world: Any, settings: Any, held: str
) -> None:
    """The reconciler holds a rank's row, or the job's that a checkpoint updates (a
    long pass): the event POST waits at most the lock timeout, answers 503 with
    Retry-After, stores nothing, and the same POST succeeds once the row is free."""
    settings.QM_TRAP_EVENT_LOCK_TIMEOUT_SECONDS = 0.2
    attempt = _noticed_victim(world, ranks=1)
    url = f"/api/v1/jobs/{attempt.job_id}/events/"
    headers = {"HTTP_AUTHORIZATION": f"Bearer {attempt_events_token(attempt)}"}
    body = _commit(0)
    locked = threading.Event()
    release = threading.Event()

    def hold_the_rank() -> None:
        try:
            with transaction.atomic():
                if held == "rank":
                    list(Rank.objects.select_for_update().filter(attempt=attempt, index=0))
                else:
                    rows = Job.objects.select_for_update(no_key=True).filter(pk=attempt.job_id)
                    list(rows.values_list("pk"))
                locked.set()
                release.wait(timeout=30)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold_the_rank)
    holder.start()
    try:
        assert locked.wait(timeout=30)
        busy = APIClient().post(url, body, format="json", **headers)
    finally:
        release.set()
        holder.join(timeout=30)
    assert busy.status_code == 503, busy.content
    assert busy["Retry-After"] == "1"
    assert "send them again" in busy.json()["detail"]
    assert not TrapEvent.objects.filter(job_id=attempt.job_id).exists()

    stored = APIClient().post(url, body, format="json", **headers)
    assert stored.status_code == 202, stored.content
    assert stored.json() == {"accepted": 1, "duplicates": 0}


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's deadlock detector")
def test_a_post_that_loses_a_deadlock_is_run_again_and_stored(world: Any) -> None:
    """The POST takes rank 0's row, then waits for rank 1's, which another transaction
    holds and then asks for rank 0's at once. PostgreSQL's detector runs in the session
    that has waited deadlock_timeout first, the POST's, and aborts it; the POST runs
    again once the other transaction has committed. Should the other transaction be
    the one aborted (its wait began too late on a busy machine), the round is played
    again, since only the POST losing shows the retry."""
    for _ in range(3):
        attempt = _noticed_victim(world, ranks=2)
        url = f"/api/v1/jobs/{attempt.job_id}/events/"
        headers = {"HTTP_AUTHORIZATION": f"Bearer {attempt_events_token(attempt)}"}
        answers: list[Any] = []

        def post(
            url: str = url, headers: dict[str, str] = headers, answers: list[Any] = answers
        ) -> None:
            body = [_commit(0, notice=False), _commit(1, notice=False)]
            try:
                answers.append(APIClient().post(url, body, format="json", **headers))
            finally:
                connections.close_all()

        poster = threading.Thread(target=post)
        try:
            with transaction.atomic():
                list(Rank.objects.select_for_update().filter(attempt=attempt, index=1))
                poster.start()
                _wait_for_a_lock_wait()
                list(Rank.objects.select_for_update().filter(attempt=attempt, index=0))
        except OperationalError as error:
            assert "deadlock" in str(error)
            poster.join(timeout=60)
            continue
        poster.join(timeout=60)
        [answer] = answers
        assert answer.status_code == 202, answer.content
        assert answer.json() == {"accepted": 2, "duplicates": 0}
        assert TrapEvent.objects.filter(job_id=attempt.job_id).count() == 2
        return
    pytest.fail("the other transaction lost the deadlock three times in a row")


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's row locks")
def test_a_checkpoint_posted_while_a_pass_holds_its_job_waits_for_it_without_a_deadlock(
    world: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reconcile's decide step locks a job and then its ranks. A checkpoint POST that
    arrives in between waits for the job before it takes its rank, so the pass gets
    the rank at once and commits, and the POST is then stored on its first try: no
    deadlock for the database to break, no pass undone, no POST run again."""
    attempt = _noticed_victim(world, ranks=2)
    url = f"/api/v1/jobs/{attempt.job_id}/events/"
    headers = {"HTTP_AUTHORIZATION": f"Bearer {attempt_events_token(attempt)}"}
    tries: list[int] = []
    once = ingest._ingest_once

    def counted(**kwargs: Any) -> tuple[int, int]:
        tries.append(1)
        return once(**kwargs)

    monkeypatch.setattr(ingest, "_ingest_once", counted)
    answers: list[Any] = []

    def post() -> None:
        body = [{**_commit(0, notice=False), "event": "signal_received"}, _commit(0, notice=False)]
        try:
            answers.append(APIClient().post(url, body, format="json", **headers))
        finally:
            connections.close_all()

    poster = threading.Thread(target=post)
    with transaction.atomic():
        list(Job.objects.select_for_update(no_key=True).filter(pk=attempt.job_id).values_list("pk"))
        poster.start()
        _wait_for_a_lock_wait()
        ranks = list(Rank.objects.select_for_update().filter(attempt=attempt).order_by("index"))
        assert [rank.index for rank in ranks] == [0, 1]
        Rank.objects.filter(attempt=attempt, index=1).update(exit_code=0)
    poster.join(timeout=60)
    [answer] = answers
    assert answer.status_code == 202, answer.content
    assert answer.json() == {"accepted": 2, "duplicates": 0}
    assert tries == [1]
    assert Job.objects.get(pk=attempt.job_id).resume_step == 13
    assert Rank.objects.get(attempt=attempt, index=1).exit_code == 0


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's row locks")
def test_a_checkpoint_posted_while_a_pass_holds_its_attempt_is_stored_at_once(
    world: Any, settings: Any
) -> None:
    """A reconcile pass holds the attempts whose signals it records, from its claim
    until it has taken their ranks. A checkpoint's POST holds its rank and inserts a
    checkpoint that names the attempt, which takes a key-share lock on the attempt's
    row. Held FOR UPDATE, the attempt would make each wait for the other, a deadlock
    the database breaks by undoing the pass; held FOR NO KEY UPDATE, as the pass holds
    it, the POST goes through at once (well within its lock timeout) and the pass
    then records its signals."""
    settings.QM_TRAP_EVENT_LOCK_TIMEOUT_SECONDS = 0.5
    attempt = _noticed_victim(world, ranks=2)
    Attempt.objects.filter(pk=attempt.pk).update(action=Attempt.Action.SIGNAL)
    attempt.refresh_from_db()
    event = PreemptionEvent.objects.get(victim_attempt=attempt)
    url = f"/api/v1/jobs/{attempt.job_id}/events/"
    headers = {"HTTP_AUTHORIZATION": f"Bearer {attempt_events_token(attempt)}"}
    answers: list[Any] = []

    def post() -> None:
        try:
            answers.append(
                APIClient().post(url, _commit(1, notice=False), format="json", **headers)
            )
        finally:
            connections.close_all()

    with transaction.atomic():
        claim, claimed = act._claim(
            [Step(Attempt.Action.SIGNAL, attempt, event=event, alive=[0, 1])]
        )
        assert [step.attempt.pk for step in claimed] == [attempt.pk]
        poster = threading.Thread(target=post)
        poster.start()
        poster.join(timeout=60)
        [answer] = answers
        assert answer.status_code == 202, answer.content
        assert act._record_plain_outcomes(claimed, claim) == {attempt.pk}
    assert Checkpoint.objects.filter(attempt=attempt, step=12).exists()
    assert not Rank.objects.filter(attempt=attempt, signal_sent_at__isnull=True).exists()
    assert Attempt.objects.get(pk=attempt.pk).action == Attempt.Action.NONE


def _wait_for_a_lock_wait(timeout: float = 30) -> None:
    """Until another session waits for a lock (pg_locks is read live, unlike
    pg_stat_activity, whose values stay as first read in a transaction)."""
    deadline = time.monotonic() + timeout
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")
            if cursor.fetchone()[0]:
                return
            time.sleep(0.005)
    raise AssertionError("the POST never waited for rank 1's row")
