"""The whole flow on the local runtime, with real processes and signals:
lending and reclaim, priority preemption, deadlines, the gang guard, cancel,
logs and webhooks. The world fixture: org/ml/{vision,nlp} and other/ops,
3 nodes × 8 h100 GPUs; vision and nlp are guaranteed 8 each, ops 8."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest
from django.utils import timezone

from preemption.logs import read_rank_log
from preemption.models import (
    Attempt,
    Checkpoint,
    Job,
    JobState,
    PreemptionEvent,
    Rank,
    TrapEvent,
    Webhook,
    WebhookDelivery,
)
from preemption.services import job_cancel, job_submit
from preemption.webhooks import deliver_due
from quotas.models import PriorityClass
from tests.preemption.conftest import (
    ignore_sigterm_command,
    sleeper_command,
    state_of,
    train_command,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]


def submit(
    world: Any, team: Any, *, ranks: int, gpus: int, command: str, pc: PriorityClass, name: str
) -> Job:
    return job_submit(
        submitter=world.users["researcher"],
        team=team,
        flavor=world.h100,
        ranks=ranks,
        gpus_per_rank=gpus,
        command=command,
        priority_class=pc,
        name=name,
    )


def steps_logged(job: Job, attempt: int) -> int:
    chunk, _ = read_rank_log(job=job, attempt=attempt, rank=0, offset=0, limit=1 << 20)
    return sum(1 for line in chunk.decode().splitlines() if line.startswith("STEP "))


def test_lending_then_reclaim_checkpoints_requeues_and_resumes(world: Any, drive: Any) -> None:
    # ops (guarantee 8) borrows 16 GPUs of org's idle 16: two ranks of 8.
    borrower = submit(
        world,
        world.ops,
        ranks=3,
        gpus=8,
        command=train_command(400, step_sleep=0.05),
        pc=world.batch,
        name="borrower",
    )
    drive(lambda: state_of(borrower) == JobState.RUNNING, what="the borrower to run")
    attempt = Attempt.objects.get(job=borrower, number=1)
    assert attempt.borrowed_gpus == 16
    drive(lambda: steps_logged(borrower, 1) >= 5, what="training steps")

    owner = submit(
        world,
        world.vision,
        ranks=1,
        gpus=8,
        command=sleeper_command(2),
        pc=world.batch,
        name="owner",
    )
    drive(
        lambda: PreemptionEvent.objects.filter(job=borrower).exists(), what="the reclaim decision"
    )
    event = PreemptionEvent.objects.get(job=borrower)
    assert event.reason == "reclaim"
    assert event.preemptor_id == owner.pk
    assert "reclaimed by vision" in event.cause

    drive(lambda: state_of(owner) == JobState.SUCCEEDED, what="the owner's job to finish")
    event.refresh_from_db()
    ranks = list(Rank.objects.filter(attempt=attempt))
    assert [r.exit_code for r in ranks] == [0, 0, 0]
    assert all(r.signal_received_at is not None for r in ranks)
    # The signal is recorded as sent before any rank received it.
    assert event.signal_sent_at is not None
    assert event.signal_sent_at <= min(r.signal_received_at for r in ranks)
    assert all(r.signal_sent_at <= r.signal_received_at for r in ranks)
    assert event.outcome == "graceful"
    assert event.checkpoint_step is not None
    # The requeue recorded where this preemption's job resumes.
    assert event.resume_step == event.checkpoint_step + 1
    assert event.lost_gpu_seconds == 0.0
    assert Attempt.objects.get(pk=attempt.pk).end_reason == "preempted"
    assert Attempt.objects.get(pk=attempt.pk).orphaned_ports == []
    assert Checkpoint.objects.filter(job=borrower, step=event.checkpoint_step).exists()

    drive(
        lambda: state_of(borrower) in (JobState.RUNNING, JobState.SUCCEEDED),
        what="the borrower to come back",
    )
    drive(
        lambda: TrapEvent.objects.filter(job=borrower, event="resumed", attempt=2).exists(),
        what="resumed",
    )
    resumed = TrapEvent.objects.filter(job=borrower, event="resumed", attempt=2).first()
    assert resumed.step == event.checkpoint_step + 1
    assert Job.objects.get(pk=borrower.pk).resume_step == event.checkpoint_step + 1
    event.refresh_from_db()
    assert event.resumed_at is not None


def test_priority_preemption_inside_one_team(world: Any, drive: Any) -> None:
    low = submit(
        world,
        world.vision,
        ranks=1,
        gpus=8,
        command=train_command(2000),
        pc=world.batch,
        name="low",
    )
    drive(lambda: state_of(low) == JobState.RUNNING, what="the low job to run")
    # Fill the rest of the cluster, each team inside its guarantee, so only
    # preemption inside vision can make room.
    filler = submit(
        world,
        world.nlp,
        ranks=1,
        gpus=8,
        command=sleeper_command(600),
        pc=world.batch,
        name="filler",
    )
    ops = submit(
        world, world.ops, ranks=1, gpus=8, command=sleeper_command(600), pc=world.batch, name="ops"
    )
    drive(
        lambda: state_of(filler) == JobState.RUNNING and state_of(ops) == JobState.RUNNING,
        what="the fillers",
    )
    high = submit(
        world,
        world.vision,
        ranks=1,
        gpus=8,
        command=sleeper_command(1),
        pc=world.critical,
        name="high",
    )
    drive(lambda: PreemptionEvent.objects.filter(job=low).exists(), what="the priority decision")
    event = PreemptionEvent.objects.get(job=low)
    assert event.reason == "priority"
    assert event.preemptor_id == high.pk
    drive(lambda: state_of(high) == JobState.SUCCEEDED, what="the high job to finish")
    assert not PreemptionEvent.objects.filter(job__in=[filler, ops]).exists()
    for job in (filler, ops, low):
        job_cancel(actor=None, job=job)
    drive(
        lambda: all(state_of(j) == JobState.CANCELLED for j in (filler, ops, low)),
        what="the clean-up",
    )


def test_deadline_kills_a_workload_that_ignores_sigterm(world: Any, drive: Any) -> None:
    quick = PriorityClass.objects.create(name="quick", value=10, preemptible=True, grace_seconds=1)
    world.org.priority_classes.add(quick)  # a new class is nobody's until a team is given it
    stubborn = submit(
        world,
        world.vision,
        ranks=2,
        gpus=4,
        command=ignore_sigterm_command(),
        pc=quick,
        name="stubborn",
    )
    drive(
        lambda: (
            state_of(stubborn) == JobState.RUNNING
            and Rank.objects.filter(attempt__job=stubborn, pid__isnull=False).count() == 2
        ),
        what="the stubborn job to run",
    )
    job_cancel(actor=world.users["researcher"], job=stubborn)
    drive(
        lambda: state_of(stubborn) == JobState.CANCELLED,
        what="the kill at the deadline",
        timeout=60,
    )
    event = PreemptionEvent.objects.get(job=stubborn)
    assert event.reason == "manual"
    assert event.outcome == "killed"
    assert event.killed_at >= event.deadline
    assert sorted(
        Rank.objects.filter(attempt__job=stubborn).values_list("exit_code", flat=True)
    ) == [137, 137]


def test_gang_guard_stops_the_rest_and_retries_then_fails(
    world: Any, drive: Any, local_runtime: Any
) -> None:
    import os
    import signal

    job = submit(
        world,
        world.vision,
        ranks=3,
        gpus=2,
        command=sleeper_command(600),
        pc=world.batch,
        name="gang",
    )
    # A rank killed by someone else is a failure of the job's own, so the job
    # asks for retries; the attempts run out first.
    Job.objects.filter(pk=job.pk).update(max_attempts=2, retries=5)
    for attempt_number in (1, 2):
        drive(
            lambda n=attempt_number: (
                Attempt.objects.filter(job=job, number=n).exists()
                and Rank.objects.filter(
                    attempt__job=job, attempt__number=n, state="running"
                ).count()
                == 3
            ),
            what=f"attempt {attempt_number} to run",
        )
        victim = Rank.objects.get(attempt__job=job, attempt__number=attempt_number, index=1)
        os.killpg(os.getpgid(victim.pid), signal.SIGKILL)
        drive(
            lambda n=attempt_number: Attempt.objects.filter(
                job=job, number=n, ended_at__isnull=False
            ).exists(),
            what=f"attempt {attempt_number} to end",
        )
        event = PreemptionEvent.objects.get(
            victim_attempt__job=job, victim_attempt__number=attempt_number
        )
        assert event.reason == "gang-guard"
        assert "rank 1" in event.cause
        codes = dict(
            Rank.objects.filter(attempt=event.victim_attempt).values_list("index", "exit_code")
        )
        assert codes == {0: 0, 1: 137, 2: 0}, (
            "the other ranks stop gracefully (sleeper exits 0 on SIGTERM)"
        )
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert "gave up after 2 attempts" in job.failure_reason


def test_cancel_stops_gracefully_and_logs_are_readable(world: Any, drive: Any) -> None:
    job = submit(
        world,
        world.nlp,
        ranks=2,
        gpus=4,
        command=train_command(5000, step_sleep=0.05),
        pc=world.batch,
        name="c",
    )
    drive(
        lambda: state_of(job) == JobState.RUNNING and steps_logged(job, 1) >= 3,
        what="training steps",
    )
    first, offset = read_rank_log(job=job, attempt=1, rank=1, offset=0, limit=1 << 20)
    assert b"RANK 1 LOSS" in first
    job_cancel(actor=world.users["researcher"], job=job)
    drive(lambda: state_of(job) == JobState.CANCELLED, what="the cancel")
    event = PreemptionEvent.objects.get(job=job)
    assert event.outcome == "graceful"
    assert list(Rank.objects.filter(attempt__job=job).values_list("exit_code", flat=True)) == [0, 0]
    rest, end = read_rank_log(job=job, attempt=1, rank=1, offset=offset, limit=1 << 20)
    assert end == offset + len(rest)
    assert b"QM_EVENT" in first + rest


def test_webhook_receives_preempted_requeued_and_finished_with_retries(
    world: Any, drive: Any, settings: Any
) -> None:
    import os
    import signal
    from datetime import timedelta

    from django.utils import timezone

    received: list[dict[str, Any]] = []
    answers = [500]  # the first try fails; the retry must deliver it

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            status = answers.pop(0) if answers else 204
            if status < 300:
                received.append(
                    {"event": self.headers["X-Quartermaster-Event"], **json.loads(body)}
                )
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            return

    # The receiver is on loopback, which webhooks reach only where an admin opens it.
    settings.QM_WEBHOOK_ALLOW_NETS = ["127.0.0.1/32"]
    server = HTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        Webhook.objects.create(
            team=world.vision, url=f"http://127.0.0.1:{server.server_port}/hook", events=[]
        )
        job = submit(
            world,
            world.vision,
            ranks=2,
            gpus=4,
            command=sleeper_command(600),
            pc=world.batch,
            name="w",
        )
        # The killed rank below is a failure of the job's own: it is retried only if asked.
        Job.objects.filter(pk=job.pk).update(retries=1)
        drive(
            lambda: (
                Rank.objects.filter(attempt__job=job, state="running", pid__isnull=False).count()
                == 2
            ),
            what="the job to run",
        )
        victim = Rank.objects.get(attempt__job=job, index=1)
        os.killpg(os.getpgid(victim.pid), signal.SIGKILL)
        drive(lambda: state_of(job) == JobState.REQUEUED, what="the gang guard to requeue")
        job_cancel(actor=None, job=job)
        drive(lambda: state_of(job) == JobState.CANCELLED, what="the cancel")
        deliver_due()
        failed = WebhookDelivery.objects.get(event="preempted")
        assert failed.delivered_at is None and failed.tries == 1 and failed.last_error == "HTTP 500"
        assert failed.next_try_at > timezone.now(), "a failed delivery waits for its backoff"
        WebhookDelivery.objects.filter(pk=failed.pk).update(
            next_try_at=timezone.now() - timedelta(seconds=1)
        )
        deliver_due()
        assert sorted(r["event"] for r in received) == ["finished", "preempted", "requeued"]
        assert next(r for r in received if r["event"] == "finished")["state"] == "cancelled"
        assert WebhookDelivery.objects.filter(delivered_at__isnull=True).count() == 0
    finally:
        server.shutdown()


def test_consolidation_moves_a_small_job_which_resumes_on_another_node(
    world: Any, drive: Any
) -> None:
    # Fill the nodes one job at a time (best fit): node 0 holds ops 6 + ops 2, node 1
    # nlp 4 + nlp 4, node 2 ops 4 (borrowed while ops holds 8).
    layout = [
        ("ops-6", world.ops, 6, sleeper_command(600)),
        ("nlp-4a", world.nlp, 4, sleeper_command(600)),
        ("nlp-4b", world.nlp, 4, sleeper_command(600)),
        ("ops-2", world.ops, 2, train_command(1200, step_sleep=0.05)),
        ("ops-4", world.ops, 4, sleeper_command(600)),
    ]
    jobs = {}
    for name, team, gpus, command in layout:
        jobs[name] = submit(
            world, team, ranks=1, gpus=gpus, command=command, pc=world.batch, name=name
        )
        drive(lambda job=jobs[name]: state_of(job) == JobState.RUNNING, what=f"{name} to run")
    nodes = {name: Rank.objects.get(attempt__job=job).node for name, job in jobs.items()}
    assert nodes["ops-2"] == nodes["ops-6"] != nodes["ops-4"]
    small = jobs["ops-2"]
    drive(lambda: steps_logged(small, 1) >= 5, what="training steps of the small job")
    # Every job has run for an hour; the 6-GPU job ends, leaving 6 free on its node
    # and 4 on the last one: 10 GPUs free, never 8 together, nobody above its guarantee.
    Attempt.objects.update(admitted_at=timezone.now() - timedelta(hours=1))
    job_cancel(actor=world.users["admin"], job=jobs["ops-6"])
    drive(lambda: state_of(jobs["ops-6"]) == JobState.CANCELLED, what="the cancel")

    gang = submit(
        world, world.vision, ranks=1, gpus=8, command=sleeper_command(1), pc=world.batch,
        name="gang",
    )  # fmt: skip
    drive(lambda: PreemptionEvent.objects.filter(job=small).exists(), what="the move")
    event = PreemptionEvent.objects.get(job=small)
    assert event.reason == "consolidate" and event.preemptor_id == gang.pk
    drive(lambda: state_of(gang) == JobState.SUCCEEDED, what="the gang to run and finish")
    assert Rank.objects.get(attempt__job=gang).node == nodes["ops-6"]

    # Its events come in from its log once it ends (no portal receives POSTs here).
    drive(lambda: state_of(small) == JobState.SUCCEEDED, timeout=180, what="the moved job")
    event.refresh_from_db()
    assert event.outcome == "graceful" and event.lost_gpu_seconds == 0.0
    assert Rank.objects.get(attempt__job=small, attempt__number=1).exit_code == 0
    moved_to = Rank.objects.get(attempt__job=small, attempt__number=2).node
    assert moved_to == nodes["ops-4"]
    resumed = TrapEvent.objects.get(job=small, event="resumed", attempt=2)
    assert resumed.step == event.checkpoint_step + 1
    # Only the small job moved.
    assert PreemptionEvent.objects.exclude(job=jobs["ops-6"]).count() == 1
