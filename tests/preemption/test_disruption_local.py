"""A stop signal the control plane did not send, on the local runtime, with real ranks.

A host that shuts down (or a person with ``kill``) sends SIGTERM to every rank of a
gang. Each rank's trap catches it, commits a checkpoint and exits 0, so every rank
ends as a finished job's would. The control plane knows from its database that it
ordered no stop (no preemption event, no signal recorded as sent), and the traps
reported the signal they received: the job is requeued from its checkpoint as
disrupted, and resumes there, never recorded as succeeded. A gang whose ranks all
exit 0 with no signal at all is still a success.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from preemption.models import (
    Attempt,
    Checkpoint,
    Job,
    JobState,
    PreemptionEvent,
    Rank,
    TrapEvent,
)
from preemption.reasons import disruption_words
from preemption.reconcile import reconcile_jobs
from tests.preemption.conftest import state_of, train_command
from tests.preemption.test_flow_local import steps_logged, submit

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]


def _reconcile_until_ended(attempt: Attempt, runtime: Any, timeout: float = 60) -> None:
    """Reconcile alone (no scheduling cycle), so the requeued job is seen before the
    cycle admits it again."""
    deadline = time.monotonic() + timeout
    while not Attempt.objects.filter(pk=attempt.pk, ended_at__isnull=False).exists():
        assert time.monotonic() < deadline, "the attempt never ended"
        reconcile_jobs(runtime=runtime)
        time.sleep(0.1)


def test_an_outside_sigterm_to_every_rank_requeues_from_the_checkpoint_and_resumes(
    world: Any, drive: Any, local_runtime: Any
) -> None:
    job = submit(
        world,
        world.vision,
        ranks=2,
        gpus=2,
        command=train_command(200, step_sleep=0.05),
        pc=world.batch,
        name="disrupted",
    )
    drive(lambda: state_of(job) == JobState.RUNNING, what="the job to run")
    drive(lambda: steps_logged(job, 1) >= 5, what="training steps")
    attempt = Attempt.objects.get(job=job, number=1)
    ranks = list(Rank.objects.filter(attempt=attempt).order_by("index"))
    assert len(ranks) == 2 and all(rank.pid for rank in ranks)

    # The host shuts down: SIGTERM to every rank, from outside the control plane.
    for rank in ranks:
        os.killpg(os.getpgid(rank.pid), signal.SIGTERM)
    _reconcile_until_ended(attempt, local_runtime)

    attempt.refresh_from_db()
    ended = list(Rank.objects.filter(attempt=attempt).order_by("index"))
    assert [rank.exit_code for rank in ended] == [0, 0], "the traps checkpointed and exited 0"
    assert all(rank.signal_received_at is not None for rank in ended)
    assert all(rank.signal_sent_at is None for rank in ended)
    assert attempt.end_reason == Attempt.EndReason.PREEMPTED, attempt.end_reason
    assert not PreemptionEvent.objects.filter(job=job).exists()
    job.refresh_from_db()
    assert job.state == JobState.REQUEUED, job.state
    assert job.finished_at is None and job.retries_used == 0
    checkpoint = Checkpoint.objects.filter(job=job).order_by("-step").first()
    assert checkpoint is not None, "the traps committed no checkpoint"
    used = sorted({rank.node for rank in ended})
    where = f"node {used[0]}" if len(used) == 1 else f"nodes {used[0]} and {used[1]}"
    assert job.waiting_reason == (
        f"disrupted: ranks 0, 1 on {where} got a stop signal that Quartermaster did not "
        f"send; requeued from its checkpoint at step {checkpoint.step}"
    ), job.waiting_reason
    assert job.resume_step == checkpoint.step + 1

    # The second attempt resumes at the step after the checkpoint and does the rest of
    # the work; only then is the job done.
    drive(lambda: state_of(job) == JobState.SUCCEEDED, what="the job to resume and finish")
    resumed = TrapEvent.objects.filter(job=job, event="resumed", attempt=2).get(rank=0)
    assert resumed.step == checkpoint.step + 1
    assert Attempt.objects.get(job=job, number=2).end_reason == Attempt.EndReason.SUCCEEDED


def test_every_rank_exiting_0_with_no_signal_is_still_a_success(
    world: Any, drive: Any, local_runtime: Any
) -> None:
    job = submit(
        world,
        world.vision,
        ranks=2,
        gpus=2,
        command=train_command(5, step_sleep=0.01),
        pc=world.batch,
        name="done",
    )
    drive(lambda: state_of(job) == JobState.SUCCEEDED, what="the job to finish")
    attempt = Attempt.objects.get(job=job, number=1)
    assert attempt.end_reason == Attempt.EndReason.SUCCEEDED
    assert not Rank.objects.filter(attempt=attempt, signal_received_at__isnull=False).exists()
    assert Job.objects.get(pk=job.pk).waiting_reason == ""


ONE_NODE = {0: "h100-node-2", 1: "h100-node-2"}
TWO_NODES = {0: "h100-node-2", 1: "h100-node-3"}


@pytest.mark.parametrize(
    ("nodes", "taken", "received", "words"),
    [
        pytest.param(
            ONE_NODE,
            {0: "EvictionByEvictionAPI", 1: "EvictionByEvictionAPI"},
            [0, 1],
            "disrupted: node h100-node-2 was drained",
            id="a drain of the node of every rank",
        ),
        pytest.param(
            TWO_NODES,
            {1: "EvictionByEvictionAPI"},
            [],
            "disrupted: node h100-node-3 was drained",
            id="a drain of one rank's node",
        ),
        pytest.param(
            TWO_NODES,
            {0: "PreemptionByScheduler"},
            [],
            "disrupted: node h100-node-2 gave a rank's GPUs to a higher-priority pod",
            id="kube-scheduler's preemption",
        ),
        pytest.param(
            TWO_NODES,
            {0: "Evicted: The node was low on resource: memory."},
            [],
            "disrupted: node h100-node-2 evicted rank 0: The node was low on resource: memory.",
            id="a kubelet's eviction under node pressure",
        ),
        pytest.param(
            TWO_NODES,
            {0: "EvictionByEvictionAPI", 1: "EvictionByEvictionAPI"},
            [],
            "disrupted: nodes h100-node-2 and h100-node-3 were drained",
            id="a drain of the nodes of every rank",
        ),
        pytest.param(
            TWO_NODES,
            {},
            [1],
            "disrupted: rank 1 on node h100-node-3 got a stop signal that Quartermaster "
            "did not send",
            id="a signal from outside to one rank",
        ),
    ],
)
def test_disruption_words(
    nodes: dict[int, str], taken: dict[int, str], received: list[int], words: str
) -> None:
    assert disruption_words(nodes=nodes, taken=taken, received=received) == words
