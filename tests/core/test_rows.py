"""`update_rows` writes each row's own values in one statement per batch, as
`bulk_update` does: only the rows given, only the fields named, NULLs and time
stamps included, on PostgreSQL and on the embedded default's SQLite."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import FieldDoesNotExist
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from core.rows import row_values, update_rows
from preemption.models import Attempt, Job, JobState, Rank
from tests import builders

pytestmark = pytest.mark.django_db


def ranks_of(world: Any, count: int) -> list[Rank]:
    ranks = []
    for _ in range(count):
        job = builders.job(world, world.vision, state=JobState.RUNNING, ranks=1)
        ranks += builders.ranks(builders.attempt(job), pid=7)
    return ranks


def test_each_row_gets_its_own_values_and_nothing_else_changes(world: Any) -> None:
    ranks = ranks_of(world, 5)
    untouched = ranks_of(world, 1)[0]
    start = timezone.now().replace(microsecond=0)
    for i, rank in enumerate(ranks):
        rank.state = Rank.State.EXITED
        rank.exit_code = i if i % 2 else None
        rank.exited_at = start + timedelta(seconds=i, microseconds=250)
        rank.pid = 99  # changed here, but not among the fields written
    with CaptureQueriesContext(connection) as captured:
        matched = update_rows(ranks, ["state", "exit_code", "exited_at"], batch_size=2)
    assert matched == 5
    assert len(captured) == 3, "one statement per batch of two"
    rows = {
        row["pk"]: row
        for row in Rank.objects.values("pk", "state", "exit_code", "exited_at", "pid")
    }
    for i, rank in enumerate(ranks):
        assert rows[rank.pk] == {
            "pk": rank.pk,
            "state": Rank.State.EXITED,
            "exit_code": i if i % 2 else None,
            "exited_at": start + timedelta(seconds=i, microseconds=250),
            "pid": 7,
        }
    assert rows[untouched.pk]["state"] == Rank.State.RUNNING
    assert rows[untouched.pk]["exited_at"] is None


def test_a_text_field_and_a_json_field_keep_what_each_row_holds(world: Any) -> None:
    jobs = [builders.job(world, world.vision, state=JobState.PENDING) for _ in range(3)]
    attempts = [builders.attempt(job) for job in jobs]
    for i, job in enumerate(jobs):
        job.waiting_reason = f"it's {i} o'clock; -- ; DROP TABLE x" if i else ""
        job.protected_until = None
    update_rows(jobs, ["waiting_reason", "protected_until"])
    assert [Job.objects.get(pk=job.pk).waiting_reason for job in jobs] == [
        "",
        "it's 1 o'clock; -- ; DROP TABLE x",
        "it's 2 o'clock; -- ; DROP TABLE x",
    ]
    for i, attempt in enumerate(attempts):
        attempt.placement = [{"node": f"node-{i}", "ranks": i + 1}]
    update_rows(attempts, ["placement"])
    assert [Attempt.objects.get(pk=a.pk).placement for a in attempts] == [
        [{"node": f"node-{i}", "ranks": i + 1}] for i in range(3)
    ]


def test_only_the_rows_that_still_hold_one_of_the_values_named_are_written(world: Any) -> None:
    jobs = [builders.job(world, world.vision, state=JobState.PENDING) for _ in range(4)]
    # Cancelled after its new values were computed: it keeps its own.
    Job.objects.filter(pk=jobs[1].pk).update(state=JobState.CANCELLED, waiting_reason="")
    for i, job in enumerate(jobs):
        job.waiting_reason = f"reason {i}"
    with CaptureQueriesContext(connection) as captured:
        matched = update_rows(
            jobs,
            ["waiting_reason"],
            batch_size=3,
            only={"state": [JobState.PENDING, JobState.REQUEUED]},
        )
    assert matched == 3
    assert len(captured) == 2, "one statement per batch of three"
    assert [Job.objects.get(pk=job.pk).waiting_reason for job in jobs] == [
        "reason 0",
        "",
        "reason 2",
        "reason 3",
    ]


def test_nothing_to_write_is_no_statement(world: Any) -> None:
    ranks = ranks_of(world, 1)
    with CaptureQueriesContext(connection) as captured:
        assert update_rows([], ["state"]) == 0
        assert update_rows(ranks, []) == 0
    assert len(captured) == 0


def test_what_it_cannot_write_is_refused_before_any_write(world: Any) -> None:
    rank = ranks_of(world, 1)[0]
    job = rank.attempt.job
    rank.state = Rank.State.EXITED
    with pytest.raises(TypeError, match="one model"):
        update_rows([rank, job], ["state"])
    with pytest.raises(ValueError, match="not a column"):
        update_rows([rank], ["id"])
    with pytest.raises(FieldDoesNotExist):
        update_rows([rank], ["no_such_field"])
    with pytest.raises(FieldDoesNotExist):
        update_rows([rank], ["state"], only={"no_such_field": [1]})
    with pytest.raises(ValueError, match="cannot restrict"):
        update_rows([rank], ["state"], only={"state": []})
    assert Rank.objects.get(pk=rank.pk).state == Rank.State.RUNNING


def test_rows_known_by_their_key_alone_write_only_the_values_given(world: Any) -> None:
    ranks = ranks_of(world, 3)
    sent = timezone.now().replace(microsecond=0)
    stand_ins = [
        row_values(Rank, rank.pk, signal_sent_at=sent + timedelta(seconds=i))
        for i, rank in enumerate(ranks[:2])
    ]
    assert [obj.pk for obj in stand_ins] == [rank.pk for rank in ranks[:2]]
    assert update_rows(stand_ins, ["signal_sent_at"]) == 2
    rows = {row["pk"]: row for row in Rank.objects.values("pk", "signal_sent_at", "state", "pid")}
    for i, rank in enumerate(ranks):
        assert rows[rank.pk] == {
            "pk": rank.pk,
            "signal_sent_at": sent + timedelta(seconds=i) if i < 2 else None,
            "state": Rank.State.RUNNING,
            "pid": 7,
        }
