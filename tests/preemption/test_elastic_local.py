"""An elastic job on the local runtime, with real processes: admitted at a smaller
size than it asks for, it launches exactly that many ranks, each told that size as
WORLD_SIZE. The world: org/ml/{vision,nlp} and other/ops, 3 nodes × 8 h100 GPUs."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ValidationError

from preemption.logs import read_rank_log
from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank
from preemption.reconcile import request_stop
from preemption.services import job_submit
from tests.preemption.conftest import sleeper_command, state_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]


def elastic_on_8_free_gpus(world: Any, drive: Any, *, command: str) -> Job:
    """An elastic job of 2, 4 or 12 ranks submitted while nlp holds 16 of the 24 GPUs:
    12 ranks do not fit on the 8 free ones, 8 is not one of its sizes, 4 is."""
    blocker = job_submit(
        submitter=world.users["researcher"],
        team=world.nlp,
        flavor=world.h100,
        ranks=2,
        gpus_per_rank=8,
        command=sleeper_command(300),
        priority_class=world.batch,
        name="blocker",
    )
    drive(lambda: state_of(blocker) == JobState.RUNNING, what="the blocker to run")
    return job_submit(
        submitter=world.users["researcher"],
        team=world.vision,
        flavor=world.h100,
        ranks=12,
        ranks_min=2,
        rank_sizes=[2, 4, 12],
        gpus_per_rank=1,
        command=command,
        priority_class=world.batch,
        name="elastic",
    )


def test_an_elastic_job_admitted_smaller_runs_that_many_ranks(world: Any, drive: Any) -> None:
    elastic = elastic_on_8_free_gpus(
        world, drive, command='echo "RANK=$RANK WORLD_SIZE=$WORLD_SIZE"'
    )
    drive(lambda: state_of(elastic) == JobState.SUCCEEDED, what="the elastic job to finish")

    attempt = Attempt.objects.get(job=elastic)
    assert attempt.ranks == 4
    assert sum(entry["ranks"] for entry in attempt.placement) == 4
    ranks = Rank.objects.filter(attempt=attempt).order_by("index")
    assert [(rank.index, rank.exit_code) for rank in ranks] == [(i, 0) for i in range(4)]
    assert all(rank.pid for rank in ranks), "every rank was a process of its own"
    for index in range(4):
        log, _ = read_rank_log(job=elastic, attempt=1, rank=index, offset=0, limit=1 << 20)
        assert f"RANK={index} WORLD_SIZE=4\n" in log.decode()
    with pytest.raises(ValidationError, match="between 0 and 3"):
        read_rank_log(job=elastic, attempt=1, rank=4)
    elastic.refresh_from_db()
    assert (elastic.ranks, elastic.ranks_min, elastic.rank_sizes) == (12, 2, [2, 4, 12])


def test_the_work_an_elastic_job_loses_counts_the_gpus_it_ran_on(world: Any, drive: Any) -> None:
    """Preempted with no checkpoint, an elastic job admitted at 4 of its 12 ranks
    loses its run time on 4 GPUs, not on the 12 it asked for."""
    elastic = elastic_on_8_free_gpus(world, drive, command=sleeper_command(300))
    drive(lambda: state_of(elastic) == JobState.RUNNING, what="the elastic job to run")
    event = request_stop(job=elastic, reason=PreemptionEvent.Reason.PRIORITY, cause="a test")
    assert event is not None
    drive(
        lambda: PreemptionEvent.objects.get(pk=event.pk).all_exited_at is not None,
        what="the elastic job's ranks to exit",
    )
    event.refresh_from_db()
    attempt = Attempt.objects.get(pk=event.victim_attempt_id)
    assert attempt.ranks == 4
    assert attempt.launched_at is not None and event.all_exited_at is not None
    ran = (event.all_exited_at - attempt.launched_at).total_seconds()
    assert event.lost_gpu_seconds == pytest.approx(ran * 4)
