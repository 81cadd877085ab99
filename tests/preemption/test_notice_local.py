"""The checkpoint notice on the local runtime, with real processes, real gloo ranks
running as the runner user, and the real database: the control plane sends the
notice, waits for the ranks' commit while training goes on, then evicts; a
victim that does not commit is evicted at the notice deadline; a trap without the
notice is evicted at once, as before."""

from __future__ import annotations

import shlex
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from preemption.logs import read_rank_log
from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank, TrapEvent
from preemption.services import job_submit
from quotas.models import PriorityClass
from tests.preemption.conftest import state_of, train_command

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
# The ranks import this tree's trap, not whichever one the interpreter has installed.
TRAP_ENV = {"PYTHONPATH": str(ROOT / "gracetrap" / "src")}
STEPS = 300
MODEL = "--hidden 64 --layers 2"


def noticed_class(world: Any, *, grace: int = 60, notice: int = 20) -> PriorityClass:
    """The teams' preemptible class, with the grace and notice windows asked for."""
    PriorityClass.objects.filter(pk=world.batch.pk).update(
        grace_seconds=grace, notice_seconds=notice
    )
    world.batch.refresh_from_db()
    return world.batch


def submit(world: Any, team: Any, *, command: str, pc: PriorityClass, name: str) -> Job:
    return job_submit(
        submitter=world.users["researcher"],
        team=team,
        flavor=world.h100,
        ranks=3 if team == world.ops else 1,
        gpus_per_rank=8,
        command=command,
        priority_class=pc,
        name=name,
        env=TRAP_ENV,
    )


def log_lines(job: Job, attempt: int, rank: int) -> list[str]:
    chunk, _ = read_rank_log(job=job, attempt=attempt, rank=rank, offset=0, limit=1 << 22)
    return chunk.decode(errors="replace").splitlines()


def losses(job: Job, attempt: int, rank: int) -> list[tuple[int, str]]:
    """(step, loss as float.hex()) of every step a rank logged."""
    steps = []
    for line in log_lines(job, attempt, rank):
        if line.startswith("STEP "):
            parts = line.split()
            steps.append((int(parts[1]), parts[-1]))
    return steps


def started(job: Job, steps: int) -> bool:
    """Every rank reported `trap_ready` in its log, and rank 0 trained `steps` steps."""
    return len(losses(job, 1, 0)) >= steps and all(
        any("trap_ready" in line for line in log_lines(job, 1, rank)) for rank in range(3)
    )


def events(job: Job, attempt: int, name: str) -> list[TrapEvent]:
    return list(TrapEvent.objects.filter(job=job, attempt=attempt, event=name).order_by("at"))


def borrow_then_reclaim(
    world: Any, drive: Any, borrower: Job, *, steps: int = 10
) -> PreemptionEvent:
    """The borrower (ops, 3 ranks of 8 GPUs, 16 of them borrowed) trains; vision takes its GPUs back."""
    drive(lambda: state_of(borrower) == JobState.RUNNING, what="the borrower to run")
    # Until a rank of a victim's is to be told, its events come from its log when it
    # ends (no web server takes POSTs here).
    drive(lambda: started(borrower, steps), what="training steps")
    owner_command = f"{shlex.quote(sys.executable)} {shlex.quote(str(ROOT / 'examples' / 'sleeper.py'))} --seconds 1"
    owner = submit(world, world.vision, command=owner_command, pc=world.batch, name="owner")
    drive(lambda: PreemptionEvent.objects.filter(job=borrower).exists(), what="the decision")
    drive(lambda: state_of(owner) == JobState.SUCCEEDED, what="the owner's job to finish")
    return PreemptionEvent.objects.get(job=borrower)


def test_notice_commit_while_training_then_eviction_then_bit_exact_resume(
    world: Any, drive: Any, runner_tmp_path: Path
) -> None:
    pc = noticed_class(world)
    dumps = runner_tmp_path / "dumps"
    dumps.mkdir(mode=0o777)
    dumps.chmod(0o777)
    dump = f"--dump {shlex.quote(str(dumps))}/{{kind}}-{{{{rank}}}}.pt"
    reference = submit(
        world,
        world.ops,
        command=train_command(STEPS, step_sleep=0.0, extra=f"{MODEL} {dump.format(kind='ref')}"),
        pc=pc,
        name="reference",
    )
    drive(lambda: state_of(reference) == JobState.SUCCEEDED, timeout=300, what="the reference")

    borrower = submit(
        world,
        world.ops,
        command="QM_ASYNC_SAVES=1 "
        + train_command(STEPS, step_sleep=0.05, extra=f"{MODEL} {dump.format(kind='run')}"),
        pc=pc,
        name="borrower",
    )
    event = borrow_then_reclaim(world, drive, borrower)
    drive(lambda: state_of(borrower) != JobState.PREEMPTING, what="the eviction to finish")
    event.refresh_from_db()

    # The notice came first, the ranks committed after it, then the eviction.
    assert event.notice_sent_at is not None and event.notice_deadline is not None
    assert event.notice_deadline <= event.deadline
    assert event.notice_committed_at is not None
    assert event.decided_at <= event.notice_sent_at <= event.notice_committed_at
    assert event.notice_committed_at <= event.signal_sent_at < event.notice_deadline
    # Every rank is sent the notice, and the first to take it tells the others at the
    # next step's all-reduce; a rank whose own copy arrives after the ranks answered
    # the notice takes it for a copy of that one (gracetrap's coalescing) and reports
    # no notice_received of its own. So at least one rank reports it, each report
    # comes within a second of the sending, and every rank saves the notice's step.
    received = events(borrower, 1, "notice_received")
    assert received and {e.rank for e in received} <= {0, 1, 2}
    assert all(e.at >= event.notice_sent_at.timestamp() for e in received)
    assert max(e.at for e in received) - event.notice_sent_at.timestamp() < 1.0
    committed = [e for e in events(borrower, 1, "checkpoint_committed") if e.payload["notice"]]
    assert sorted(e.rank for e in committed) == [0, 1, 2]
    notice_step = committed[0].step
    assert committed[0].payload["background"] is True
    # Training went on after the notice's step and before the eviction stopped it.
    stop_step = max(step for step, _ in losses(borrower, 1, 0))
    assert stop_step > notice_step
    ranks = list(Rank.objects.filter(attempt=event.victim_attempt).order_by("index"))
    assert [r.exit_code for r in ranks] == [0, 0, 0]
    assert all(r.signal_received_at >= event.notice_committed_at for r in ranks)
    assert event.outcome == "graceful" and event.killed_at is None
    assert event.checkpoint_step == stop_step

    # Requeued through the control plane, it resumes bit-exactly and finishes.
    drive(lambda: state_of(borrower) == JobState.SUCCEEDED, timeout=300, what="the resumed run")
    assert Attempt.objects.filter(job=borrower).count() == 2
    assert [e.step for e in events(borrower, 2, "resumed")] == [stop_step + 1] * 3
    for rank in (0, 1, 2):
        first = [s for s in losses(borrower, 1, rank) if s[0] <= stop_step]
        assert first + losses(borrower, 2, rank) == losses(reference, 1, rank)
        mine = torch.load(dumps / f"run-{rank}.pt", weights_only=False)
        theirs = torch.load(dumps / f"ref-{rank}.pt", weights_only=False)
        assert mine["loss_hex"] == theirs["loss_hex"]
        for name, tensor in theirs["model"].items():
            assert torch.equal(tensor, mine["model"][name]), name
        for index, moments in theirs["optimizer"]["state"].items():
            for key, value in moments.items():
                assert torch.equal(value, mine["optimizer"]["state"][index][key]), (index, key)
        assert mine["rng"]["python"] == theirs["rng"]["python"]
        assert torch.equal(mine["rng"]["torch"], theirs["rng"]["torch"])


# A trap that announces the notice signal but never answers it: it reports
# `trap_ready` as gracetrap does, catches SIGUSR2 and does nothing, and exits 0 on
# SIGTERM.
NEVER_COMMITS = """
import json, os, signal, sys, time
signal.signal(signal.SIGUSR2, lambda *_: print("NOTICE", flush=True))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
ready = {"event": "trap_ready", "job_id": int(os.environ["QM_JOB_ID"]),
         "attempt": int(os.environ["QM_ATTEMPT"]), "rank": int(os.environ["RANK"]),
         "at": time.time(), "protocol": 1, "notice_signal": "SIGUSR2"}
print("QM_EVENT " + json.dumps(ready), flush=True)
while True:
    time.sleep(0.05)
"""


def test_a_notice_never_answered_is_followed_by_the_eviction_at_the_notice_deadline(
    world: Any, drive: Any
) -> None:
    pc = noticed_class(world, grace=30, notice=3)
    command = f"{shlex.quote(sys.executable)} -c {shlex.quote(NEVER_COMMITS)}"
    borrower = submit(world, world.ops, command=command, pc=pc, name="silent")
    event = borrow_then_reclaim(world, drive, borrower, steps=0)
    event.refresh_from_db()
    assert event.notice_sent_at is not None
    assert event.notice_committed_at is None
    # Nobody committed: the eviction waited for the notice deadline, and no longer.
    assert event.signal_sent_at >= event.notice_deadline
    assert (event.signal_sent_at - event.notice_deadline).total_seconds() < 5
    # The 3-s window runs from the moment the reconcile pass sends the notice: never
    # shorter than 3 s from the decision, never longer than 3 s after the notice was
    # sent (a pass that comes late on a loaded machine starts the window late).
    window = timedelta(seconds=3)
    assert event.decided_at + window <= event.notice_deadline <= event.notice_sent_at + window
    for rank in (0, 1, 2):
        assert "NOTICE" in log_lines(borrower, 1, rank)
    assert event.outcome == "graceful" and event.killed_at is None
    assert [r.exit_code for r in Rank.objects.filter(attempt=event.victim_attempt)] == [0, 0, 0]


def test_a_trap_without_the_notice_is_evicted_at_once_as_before(world: Any, drive: Any) -> None:
    pc = noticed_class(world)
    borrower = submit(
        world,
        world.ops,
        command="QM_NOTICE_SIGNAL=off " + train_command(400, step_sleep=0.05),
        pc=pc,
        name="no-notice",
    )
    event = borrow_then_reclaim(world, drive, borrower)
    drive(lambda: state_of(borrower) != JobState.PREEMPTING, what="the eviction to finish")
    event.refresh_from_db()
    ready = [e.payload.get("notice_signal") for e in events(borrower, 1, "trap_ready")]
    assert ready == [None, None, None]
    assert event.notice_deadline is None and event.notice_sent_at is None
    # Signalled without waiting for the class's 20 s notice window: well inside it,
    # however loaded the machine (a pass here has taken 2.6 s beside the suite).
    assert (event.signal_sent_at - event.decided_at).total_seconds() < pc.notice_seconds / 2
    assert not events(borrower, 1, "notice_received")
    assert event.outcome == "graceful"


def test_a_class_without_a_notice_window_sends_none(world: Any, drive: Any) -> None:
    pc = noticed_class(world, notice=0)
    borrower = submit(
        world, world.ops, command=train_command(400, step_sleep=0.05), pc=pc, name="zero"
    )
    event = borrow_then_reclaim(world, drive, borrower)
    event.refresh_from_db()
    ready = [e.payload.get("notice_signal") for e in events(borrower, 1, "trap_ready")]
    assert ready == ["SIGUSR2"] * 3
    assert event.notice_deadline is None and event.notice_sent_at is None
    # Signalled at once, not after a notice window (the other classes here give 20 s):
    # well inside one, however loaded the machine (a pass has taken 2.6 s beside the suite).
    assert (event.signal_sent_at - event.decided_at).total_seconds() < 10
