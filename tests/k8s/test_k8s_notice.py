"""The checkpoint notice on Kubernetes, where pods cannot be signalled but by their
eviction: the real kube-apiserver and our node agent run a gang of real gloo ranks
as pods; the reconciler records the notice, rank 0's trap learns of it by polling
the real events endpoint with its attempt's token, every rank commits a checkpoint
while training goes on, and only then does the eviction come."""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank, TrapEvent
from preemption.reconcile import reconcile_jobs, request_stop
from preemption.runtimes.base import GangId
from preemption.runtimes.kubernetes import KubernetesRuntime
from quotas.models import PriorityClass
from tests import builders
from tests.k8s.conftest import LOW_PRIORITY
from tools.k8s.agent_state import ANNOTATION_RUN
from tools.k8s.node_agent import NodeAgent

MakeRuntime = Callable[..., KubernetesRuntime]
ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(600)]


def reconcile_until(
    runtime: KubernetesRuntime, job: Job, condition: Callable[[], bool], what: str
) -> None:
    deadline = time.monotonic() + 180
    while not condition():
        if time.monotonic() > deadline:
            gang = GangId(job.pk, 1)
            logs = [runtime.read_log(gang, rank)[-3000:] for rank in range(2)]
            state = Job.objects.values_list("state", "failure_reason").get(pk=job.pk)
            action = Attempt.objects.values_list("action", "action_error").get(job=job, number=1)
            raise AssertionError(
                f"timed out waiting for {what}: job {state}, action {action}, "
                f"ranks {runtime.observe(gang)}, logs {logs}"
            )
        reconcile_jobs(runtime=runtime)
        time.sleep(0.2)


def test_a_polled_notice_reaches_the_ranks_and_their_commit_precedes_the_eviction(
    world: Any,
    make_runtime: MakeRuntime,
    node_agent: NodeAgent,
    live_server: Any,
    settings: Any,
) -> None:
    settings.QM_PUBLIC_URL = live_server.url
    runtime = make_runtime(pod_annotations={ANNOTATION_RUN: "process"})
    assert runtime.notice_delivery == "poll"
    # A class the test cluster knows (the pods name it), with a notice window.
    noticed = PriorityClass.objects.create(
        name=LOW_PRIORITY,
        value=100,
        preemption_policy="Never",
        grace_seconds=60,
        notice_seconds=20,
    )
    # The pods import this tree's trap (the node agent moves a path-like variable
    # into the node's own root, so it is set on the command line).
    train = f"PYTHONPATH={shlex.quote(str(ROOT / 'gracetrap' / 'src'))} " + " ".join(
        shlex.quote(part)
        for part in (
            sys.executable,
            str(ROOT / "examples" / "train_ddp.py"),
            "--steps",
            "3000",
            "--step-sleep",
            "0.05",
        )
    )
    job = builders.job(
        world,
        world.vision,
        state=JobState.ADMITTED,
        ranks=2,
        priority_class=noticed,
        command=train,
        checkpoint_dir="/checkpoints/notice",
    )
    attempt = Attempt.objects.create(job=job, number=1, admitted_at=timezone.now())
    for index in range(2):
        Rank.objects.create(attempt=attempt, index=index, node="gpu-node-0")

    # Launched; every rank announces the poll by POST to the real endpoint.
    reconcile_until(
        runtime,
        job,
        lambda: TrapEvent.objects.filter(job=job, event="trap_ready", source="post").count() == 2,
        "both ranks' trap_ready",
    )
    ready = TrapEvent.objects.filter(job=job, event="trap_ready")
    assert {e.payload["notice_poll"] for e in ready} == {True}

    event = request_stop(job=job, reason="priority", cause="a critical job needs the node")
    assert event is not None
    reconcile_until(
        runtime,
        job,
        lambda: Attempt.objects.get(pk=attempt.pk).ended_at is not None,
        "the gang to be evicted",
    )
    event.refresh_from_db()
    assert event.notice_sent_at is not None and event.notice_committed_at is not None
    assert event.notice_sent_at <= event.notice_committed_at <= event.signal_sent_at
    assert event.signal_sent_at < event.notice_deadline

    # Rank 0 asked and got the notice once it was sent and before the eviction's signal
    # (its report is stored from the POST or the log line, whichever comes first), and
    # the gang's relay passed it on to rank 1, which did not ask. How soon is a
    # benchmark's to say: on a loaded machine it took 1.2 s where it takes well under 1.
    received = TrapEvent.objects.get(job=job, event="notice_received", rank=0)
    assert event.signal_sent_at is not None
    assert event.notice_sent_at.timestamp() <= received.at <= event.signal_sent_at.timestamp()
    relayed = TrapEvent.objects.get(job=job, event="notice_received", rank=1)
    assert relayed.at >= received.at
    committed = [
        e
        for e in TrapEvent.objects.filter(job=job, event="checkpoint_committed").order_by("at")
        if e.payload["notice"]
    ]
    assert sorted(e.rank for e in committed) == [0, 1]
    assert all(e.at <= event.signal_sent_at.timestamp() for e in committed)
    # Training went on past the notice's step until the eviction stopped it.
    final = [
        e
        for e in TrapEvent.objects.filter(job=job, event="checkpoint_committed")
        if not e.payload["notice"]
    ]
    assert final and min(e.step for e in final) > committed[0].step
    assert [r.exit_code for r in Rank.objects.filter(attempt=attempt).order_by("index")] == [0, 0]
    assert event.outcome == PreemptionEvent.Outcome.GRACEFUL
    assert Job.objects.get(pk=job.pk).state == JobState.REQUEUED
