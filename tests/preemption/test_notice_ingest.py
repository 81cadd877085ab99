"""The ranks' answers to a checkpoint notice arrive in concurrent requests: the last
one to commit asks for the eviction at once, whatever order the requests end in."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import close_old_connections, transaction
from django.utils import timezone

from preemption import ingest
from preemption.ingest import ingest_trap_event
from preemption.models import Attempt, PreemptionEvent
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
def sent(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """When a reconcile pass was asked for (the broker's own sending is Celery's)."""
    calls: list[float] = []
    monkeypatch.setattr(ingest, "send_reconcile", lambda: calls.append(time.time()))
    return calls


def test_two_answers_stored_at_the_same_time_still_ask_for_the_eviction(
    world: Any, sent: list[float]
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
            close_old_connections()

    threads = [threading.Thread(target=answer, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert len(sent) >= 1


def test_an_answer_while_other_ranks_have_not_answered_asks_for_nothing(
    world: Any, sent: list[float]
) -> None:
    attempt = _noticed_victim(world, ranks=2)
    assert ingest_trap_event(attempt=attempt, event=_commit(0), source="post")
    assert sent == []
    # A regular commit of the other rank does not answer the notice either.
    assert ingest_trap_event(
        attempt=attempt, event=_commit(1, step=11, notice=False), source="post"
    )
    assert sent == []
    assert ingest_trap_event(attempt=attempt, event=_commit(1), source="post")
    assert len(sent) == 1


def test_an_answer_after_the_eviction_was_sent_asks_for_nothing(
    world: Any, sent: list[float]
) -> None:
    attempt = _noticed_victim(world, ranks=1)
    PreemptionEvent.objects.filter(victim_attempt=attempt).update(signal_sent_at=timezone.now())
    assert ingest_trap_event(attempt=attempt, event=_commit(0), source="post")
    assert sent == []
