"""One reconcile pass: what it reads and the stages it runs in turn.

`reconcile_jobs` reads the open attempts and what the runtime observes of them,
leaves alone those that are steady (and, while an exits listener lives, the
gangs that ended a moment ago), reads the logs of victims whose eviction waits,
then has the decide step decide for the rest in one short transaction and `act`
carry out what it decided: the act step makes the runtime calls, the finish step
closes the attempts whose ranks all exited. `launch_admitted` goes straight to
the act step for the attempts a scheduling cycle has just admitted.

The stages are imported from here, never the other way: the exits listener and
the portal's shutdown use this module's entry points.
"""

from __future__ import annotations

import fcntl
import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from django.conf import settings
from django.db import OperationalError
from django.db.models import Q
from django.utils import timezone

from fairshare import collector_paused
from preemption.ingest import sqlstate
from preemption.models import ACTIVE_STATES, Attempt, JobState
from preemption.reconcile.act import carry_out
from preemption.reconcile.decide import decide_pending
from preemption.reconcile.finish import finish
from preemption.reconcile.hold import SETTLE_SECONDS, exits_listened
from preemption.reconcile.logs import read_victims_logs
from preemption.reconcile.observe import read_open_attempts, steady
from preemption.reconcile.steps import ACTION_LEASE, FINISH, Step, among, gang_spec, loaded
from preemption.runtime import get_runtime
from preemption.runtimes.base import (
    GangId,
    RankObservation,
    Runtime,
    RuntimePermanentError,
    RuntimeTemporaryError,
)

logger = logging.getLogger(__name__)


def reconcile_jobs(*, job_ids: list[int] | None = None, runtime: Runtime | None = None) -> int:
    """Reconcile every open attempt of active jobs (or only those of `job_ids`).
    Returns how many attempts were looked at.

    Runtime calls happen only between the short transactions, never inside one.
    A pass over every attempt while another such pass of this installation is
    still running does nothing: the next one starts a moment later anyway.

    The cyclic garbage collector is paused for the pass, as for a scheduling cycle
    (fairshare.collector_paused): a first pass over a large cluster builds tens of
    thousands of rows and observations that reference counting frees, and the full
    collections they set off walked every object of the worker (0.37 s of a 1.3 s
    pass over 2,400 gangs in bench/bench_cycle.py). The few reference cycles a pass
    leaves (prefetched ranks point back at their attempt) are freed by the first
    young collection after it."""
    with collector_paused():
        if job_ids is None:
            with _only_pass() as mine:
                return _reconcile(None, runtime or get_runtime()) if mine else 0
        return _reconcile(job_ids, runtime or get_runtime())


def launch_admitted(job_ids: list[int], runtime: Runtime | None = None) -> None:
    """Launch the attempts a scheduling cycle has just admitted.

    The cycle records each with the launch as its action, in the transaction that
    admits it, so there is nothing to observe or decide yet: this goes straight to
    the act step. An attempt stopped since (a cancel) or already claimed is left to
    the next pass, and a launch cut short is carried out by the next pass's decide
    step, as any recorded action is."""
    attempts = (
        Attempt.objects.filter(
            job_id__in=job_ids,
            job__state=JobState.ADMITTED,
            ended_at__isnull=True,
            launched_at__isnull=True,
            action=Attempt.Action.LAUNCH,
            preemption__isnull=True,
        )
        .select_related("job", "job__team", "job__priority_class", "job__flavor")
        .prefetch_related("rank_set")
        .order_by("job_id")
    )
    steps = [
        Step(
            Attempt.Action.LAUNCH,
            attempt,
            spec=gang_spec(attempt.job, attempt, attempt.rank_set.all()),
        )
        for attempt in attempts
    ]
    if steps:
        act(steps, runtime or get_runtime())


@contextmanager
def _only_pass() -> Iterator[bool]:
    folder = Path(settings.VAR_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "reconcile.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _reconcile(job_ids: list[int] | None, runtime: Runtime) -> int:
    _forget_finished(job_ids, runtime)
    open_attempts = read_open_attempts(job_ids)
    if not open_attempts:
        return 0
    observed: dict[tuple[int, int], list[RankObservation]] = defaultdict(list)
    try:
        if job_ids is not None and len(open_attempts) <= 4:
            for row in open_attempts:
                for obs in runtime.observe(GangId(row.job_id, row.number)):
                    observed[(obs.job_id, obs.attempt)].append(obs)
        else:
            for obs in runtime.observe(None):
                observed[(obs.job_id, obs.attempt)].append(obs)
    except (RuntimeTemporaryError, RuntimePermanentError):
        logger.warning("runtime observation failed; retrying next cycle", exc_info=True)
        return 0
    # Runtimes that can tell a rank was taken away (kube-scheduler preemption,
    # node loss) even when it exited 0 name those gangs themselves.
    taken: set[tuple[int, int]] = set()
    guard = runtime.gang_guard
    if guard is not None:
        try:
            # Over the pass's own observation: observing again would only repeat its
            # API calls, between the decision and the stops this pass is here to make.
            seen = [obs for gang in observed.values() for obs in gang]
            taken = {(gang.job_id, gang.attempt) for gang in guard.guard_victims(seen)}
        except (RuntimeTemporaryError, RuntimePermanentError):
            logger.warning("gang-guard observation failed; retrying next cycle", exc_info=True)
    # An exits listener closes the gangs that end; a pass over every job leaves it
    # those that ended a moment ago, rather than meeting it on their rows.
    left_since = time.time() - SETTLE_SECONDS if job_ids is None and exits_listened() else None
    to_decide = []
    for row in open_attempts:
        key = (row.job_id, row.number)
        observations = observed.get(key, [])
        if steady(row, observations, key in taken):
            continue
        if left_since is not None and _ended_since(observations, left_since):
            continue
        to_decide.append(row.pk)
    if not to_decide:
        return len(open_attempts)
    attempts = loaded(
        Attempt.objects.filter(
            pk__in=among(to_decide), ended_at__isnull=True, job__state__in=ACTIVE_STATES
        )
        # Without their ranks: the decisions read them afresh under lock (_lock_rows),
        # and only a victim whose logs are due reads them before (read_victims_logs).
        # In the order of their jobs' ids, the order in which the scheduling cycle locks
        # jobs too: two transactions that lock the same jobs in one order cannot deadlock.
        .order_by("job_id", "id"),
        "job",
        "job__team",
        "job__priority_class",
        "job__flavor",
        "preemption",
    )
    # Gangs the runtime shows nothing of although they were launched are observed
    # once more first: the pass's observation may predate their launch.
    pending: list[tuple[Attempt, list[RankObservation], bool]] = []
    for attempt in attempts:
        key = (attempt.job_id, attempt.number)
        observations = observed.get(key, [])
        if not observations and attempt.launched_at is not None:
            try:
                observations = runtime.observe(GangId(*key))
            except (RuntimeTemporaryError, RuntimePermanentError):
                logger.warning("observing %s failed; retrying next cycle", attempt, exc_info=True)
                continue
        pending.append((attempt, observations, key in taken))
    delivery = notice_delivery(runtime)
    if delivery is not None:
        read_victims_logs([attempt for attempt, _, _ in pending], runtime)
    try:
        steps = decide_pending(pending, delivery)
    except OperationalError as error:
        if sqlstate(error) not in LOCK_CONFLICTS:
            raise
        # The pass's locks met another writer's in the opposite order and the
        # database chose this pass to undo: nothing of it was kept, and the next
        # pass decides again. The project's own writers lock a job before its
        # ranks (the cycle, this pass, a checkpoint's ingestion); this is the
        # safety net for any that does not.
        logger.warning("the reconcile pass met a lock conflict; retrying next pass: %s", error)
        return 0
    act(steps, runtime)
    return len(open_attempts)


# A deadlock the database broke by undoing this transaction, and a lock not granted.
LOCK_CONFLICTS = {"40P01", "55P03"}


def notice_delivery(runtime: Runtime) -> str | None:
    """How the runtime delivers a checkpoint notice ("signal" or "poll"), or None."""
    delivery = getattr(runtime, "notice_delivery", None)
    return delivery if delivery in ("signal", "poll") else None


def _ended_since(observations: list[RankObservation], moment: float) -> bool:
    """Whether every rank observed has exited, the last of them after `moment`."""
    return bool(observations) and all(
        obs.phase == "exited" and obs.exited_at is not None and obs.exited_at > moment
        for obs in observations
    )


def act(steps: list[Step], runtime: Runtime) -> None:
    """Carry out what the decide step recorded, with no transaction open.

    Each action is claimed first, so a second worker with the same decision does
    nothing; the runtime calls of one pass go out side by side, and their
    outcomes are recorded together in one short transaction."""
    carry_out([step for step in steps if step.action != FINISH], runtime)
    finishing = [step for step in steps if step.action == FINISH]
    if finishing:
        finish(finishing, runtime)


def _forget_finished(job_ids: list[int] | None, runtime: Runtime) -> None:
    """Forget the gangs of finished attempts whose forget failed for a while."""
    now = timezone.now()
    attempts = Attempt.objects.filter(
        Q(action_claimed_at__isnull=True) | Q(action_claimed_at__lt=now - ACTION_LEASE),
        Q(action_not_before__isnull=True) | Q(action_not_before__lte=now),
        ended_at__isnull=False,
        action=Attempt.Action.FORGET,
    ).select_related("job")
    if job_ids is not None:
        attempts = attempts.filter(job_id__in=job_ids)
    steps = [Step(Attempt.Action.FORGET, attempt) for attempt in attempts[:100]]
    if steps:
        act(steps, runtime)
