"""The researcher's view of a preemption, live, in a real browser: their job goes
pending → running → preempting (with a countdown) → requeued → running while
the page stays open, and the timeline names the checkpoint step the preemption
recorded. Real rank processes on the local runtime: a trap-using trainer that
borrows GPUs, reclaimed by another team's job; the scheduling cycle and the
reconciler are driven from the test, as the flow tests do."""

from __future__ import annotations

from typing import Any

import pytest

from preemption.logs import read_rank_log
from preemption.models import Job, JobState, PreemptionEvent
from preemption.services import job_cancel, job_submit
from tests.conftest import PASSWORD
from tests.e2e.conftest import Session
from tests.preemption.conftest import (  # noqa: F401  (fixtures used by name)
    drive,
    local_runtime,
    sleeper_command,
    state_of,
    train_command,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True, serialized_rollback=True),
    pytest.mark.timeout(300),
]

STATE_PILL = ".pagehead .pill"


def _submit(world: Any, team: Any, user: str, *, ranks: int, command: str, name: str) -> Job:
    return job_submit(
        submitter=world.users[user],
        team=team,
        flavor=world.h100,
        ranks=ranks,
        gpus_per_rank=8,
        command=command,
        priority_class=world.batch,
        name=name,
    )


def _trained(job: Job) -> bool:
    """Rank 0 has logged a few steps: its trap is installed and training."""
    chunk, _ = read_rank_log(job=job, attempt=1, rank=0, offset=0, limit=1 << 20)
    return sum(1 for line in chunk.decode().splitlines() if line.startswith("STEP ")) >= 5


def _shows_state(page: Any, label: str) -> None:
    """Wait until the open page's own refresh shows the job in `label`."""
    page.wait_for_function(
        f"document.querySelector({STATE_PILL!r}).textContent.trim() === {label!r}",
        timeout=20000,
    )


def test_researcher_watches_a_reclaim_and_reads_its_checkpoint_step(
    world: Any,
    browser_session: Session,
    drive: Any,  # noqa: F811
) -> None:
    # nlp fills one node within its guarantee, so the only GPUs lent are ops's.
    filler = _submit(world, world.nlp, "admin", ranks=1, command=sleeper_command(600), name="fill")
    drive(lambda: state_of(filler) == JobState.RUNNING, what="the filler to run")
    # ops (guarantee 8) runs two ranks of 8: 8 GPUs borrowed from org.
    job = _submit(
        world,
        world.ops,
        "other_researcher",
        ranks=2,
        command=train_command(4000, step_sleep=0.05),
        name="borrower",
    )
    session = browser_session
    page = session.page
    session.login("other_researcher", PASSWORD)
    session.go(f"/jobs/{job.pk}/")
    assert page.inner_text(STATE_PILL) == "Pending"
    # A mark on the window survives only if the page is never reloaded.
    page.evaluate("window.__notReloaded = true")

    drive(lambda: state_of(job) == JobState.RUNNING, what="the borrower to run")
    _shows_state(page, "Running")
    drive(lambda: _trained(job), what="training steps")

    # vision claims its guarantee back: the borrower is signalled, and the
    # reconciler is left alone while the page shows the stop counting down.
    owner = _submit(
        world, world.vision, "researcher", ranks=1, command=sleeper_command(600), name="owner"
    )
    drive(
        lambda: PreemptionEvent.objects.filter(job=job, signal_sent_at__isnull=False).exists(),
        what="the reclaim's signal",
    )
    _shows_state(page, "Preempting")
    countdown = page.inner_text("[data-countdown]")
    assert countdown.endswith("seconds left"), countdown

    drive(lambda: state_of(job) == JobState.REQUEUED, what="the borrower to be requeued")
    _shows_state(page, "Requeued")

    # The owner's job ends; the borrower gets its GPUs back and resumes.
    job_cancel(actor=None, job=owner)
    drive(lambda: state_of(job) == JobState.RUNNING, what="the borrower to run again")
    _shows_state(page, "Running")

    event = PreemptionEvent.objects.get(job=job)
    assert event.reason == "reclaim" and event.checkpoint_step is not None
    # The checkpoint it resumes from is the last one the timeline shows committed:
    # the eviction's own save, or the notice's when the eviction came at the very
    # step the notice saved (the eviction's save is then skipped as already done).
    lines = page.locator(f'section[data-preemption="{event.pk}"] li.step').all_inner_texts()
    committed = [line for line in lines if "checkpoint committed" in line.lower()]
    assert committed, lines
    # The detail line reads "step N, its size in MB in its seconds".
    detail = committed[-1].splitlines()[-1]
    assert detail.split(",")[0] == f"step {event.checkpoint_step}", lines
    assert page.evaluate("window.__notReloaded") is True
    assert session.console_errors == []
    assert session.foreign_requests == []
