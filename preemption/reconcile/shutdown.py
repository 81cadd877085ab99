"""Stopping every rank the runtime runs because the portal that owns them stops
(`RankShutdown`, `runtime_shutdown`), and counting them (`live_rank_count`).

Stands apart from the pass: it records each stop with `request_stop`, signals and
kills the gangs itself, and closes their attempts with `reconcile_jobs`.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

from django.utils import timezone

from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank
from preemption.reconcile.decide import request_stop
from preemption.reconcile.passes import reconcile_jobs
from preemption.reconcile.steps import TERMINAL_PHASES
from preemption.runtime import get_runtime
from preemption.runtimes.base import GangId, RankObservation, Runtime

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShutdownReport:
    """What stopping the runtime's ranks with the portal did, and where each job
    requeued by it resumes (its `resume_step`; None to start over)."""

    jobs: int
    ranks: int
    killed: int
    resumes: dict[int, int | None] = field(default_factory=dict)


def _live_ranks(runtime: Runtime) -> dict[GangId, list[RankObservation]]:
    live: dict[GangId, list[RankObservation]] = defaultdict(list)
    for obs in runtime.observe(None):
        if obs.phase not in TERMINAL_PHASES:
            live[GangId(obs.job_id, obs.attempt)].append(obs)
    return dict(live)


def live_rank_count(*, runtime: Runtime | None = None) -> tuple[int, int]:
    """(jobs, ranks) the runtime runs now."""
    live = _live_ranks(runtime or get_runtime())
    return len(live), sum(len(ranks) for ranks in live.values())


# How often the shutdown's close looks again at jobs still stopping, and how long apart.
# `RankShutdown._close_stopped`: passes until the stopped jobs are closed, for at most
# this long (a loaded machine's keepers may record their ranks' ends late).
CLOSE_PASSES_SECONDS = 30.0
CLOSE_PASS_SECONDS = 0.25


class RankShutdown:
    """Stopping every rank the runtime runs because the portal that owns them stops.

    Two steps, so that the ranks hear of the stop at once while the worker still
    finishes its tasks: a supervisor that kills the portal a few seconds after its
    SIGTERM (container runtimes and service managers do) then still leaves ranks
    that were told and checkpoint and exit on their own.

    - `signal_live` records a `shutdown` stop on each live gang's open attempt (so
      the next start requeues the job to resume from its checkpoint instead of
      taking the ranks' clean exit for success) and sends every gang the signal at
      once;
    - `finish`, called once the worker and beat have exited and nothing launches any
      more, does the same for a gang launched meanwhile, waits for each gang's grace
      (counted from its own signal), kills what is left, closes the stopped attempts
      (`_close_stopped`), and reports.
    """

    def __init__(self, *, grace_seconds: float, runtime: Runtime | None = None) -> None:
        self.grace_seconds = grace_seconds
        self.runtime = runtime or get_runtime()
        # Each gang signalled: its rank count then, and when its grace ends (monotonic).
        self.signalled: dict[GangId, tuple[int, float]] = {}

    def signal_live(self) -> tuple[int, int]:
        """Record a stop on every live gang not signalled yet and signal each;
        (jobs, ranks) signalled by this call."""
        live = {
            gang: ranks
            for gang, ranks in _live_ranks(self.runtime).items()
            if gang not in self.signalled
        }
        now = timezone.now()
        for gang in live:
            attempt = Attempt.objects.filter(
                job_id=gang.job_id, number=gang.attempt, ended_at__isnull=True
            ).first()
            if attempt is None:
                continue
            job = Job.objects.select_related("priority_class").get(pk=gang.job_id)
            request_stop(
                job=job,
                reason=PreemptionEvent.Reason.SHUTDOWN,
                cause=(
                    "the portal was stopped; the job resumes from its checkpoint at the next start"
                ),
                grace_seconds=self.grace_seconds,
            )
            PreemptionEvent.objects.filter(
                victim_attempt=attempt, signal_sent_at__isnull=True
            ).update(signal_sent_at=now)
            Rank.objects.filter(attempt=attempt, signal_sent_at__isnull=True).update(
                signal_sent_at=now
            )
        for gang, ranks in live.items():
            self.runtime.signal(gang, self.grace_seconds)
            self.signalled[gang] = (len(ranks), time.monotonic() + self.grace_seconds)
        return len(live), sum(len(ranks) for ranks in live.values())

    def finish(self, *, poll_seconds: float = 0.25) -> ShutdownReport:
        """Signal the gangs launched since `signal_live`, then wait for every gang
        signalled to exit, killing each that outlives its grace."""
        self.signal_live()
        killed: dict[GangId, int] = {}
        while True:
            left = [
                (gang, len(ranks))
                for gang, ranks in _live_ranks(self.runtime).items()
                if gang in self.signalled and gang not in killed
            ]
            if not left:
                break
            now = time.monotonic()
            for gang, ranks in left:
                if self.signalled[gang][1] > now:
                    continue
                self.runtime.kill(gang)
                killed[gang] = ranks
                PreemptionEvent.objects.filter(
                    victim_attempt__job_id=gang.job_id,
                    victim_attempt__number=gang.attempt,
                    killed_at__isnull=True,
                ).update(killed_at=timezone.now())
            if any(gang not in killed for gang, _ in left):
                # Some gang is still within its grace.
                time.sleep(poll_seconds)
        return ShutdownReport(
            jobs=len({gang.job_id for gang in self.signalled}),
            ranks=sum(ranks for ranks, _ in self.signalled.values()),
            killed=sum(killed.values()),
            resumes=self._close_stopped(),
        )

    def _close_stopped(self) -> dict[int, int | None]:
        """Close the attempts of the gangs stopped, as the next start's reconcile
        would, and return where each job requeued resumes.

        The ranks checkpoint on the signal after the web server has gone, so their
        trap's reports by POST are lost and only their logs say which step they
        committed; the pass reads those logs before it decides where the job resumes.
        Left to the next start, the job read as still stopping, from the checkpoint
        before, for as long as the portal was down. Should the pass fail, the next
        start's does the same."""
        job_ids = sorted({gang.job_id for gang in self.signalled})
        if not job_ids:
            return {}
        # A pass may leave a job stopping for a moment yet (a rank's end is recorded
        # by its keeper just after the rank is gone); passes for a bounded time.
        deadline = time.monotonic() + CLOSE_PASSES_SECONDS
        while time.monotonic() < deadline:
            try:
                reconcile_jobs(job_ids=job_ids, runtime=self.runtime)
            except Exception:
                logger.warning(
                    "closing the stopped jobs %s failed; the next start closes them",
                    job_ids,
                    exc_info=True,
                )
                break
            if not Job.objects.filter(pk__in=job_ids, state=JobState.PREEMPTING).exists():
                break
            time.sleep(CLOSE_PASS_SECONDS)
        return dict(
            Job.objects.filter(pk__in=job_ids, state=JobState.REQUEUED)
            .order_by("pk")
            .values_list("pk", "resume_step")
        )


def runtime_shutdown(
    *, grace_seconds: float, runtime: Runtime | None = None, poll_seconds: float = 0.25
) -> ShutdownReport:
    """`RankShutdown`'s two steps at once, where nothing else runs meanwhile."""
    shutdown = RankShutdown(grace_seconds=grace_seconds, runtime=runtime)
    shutdown.signal_live()
    return shutdown.finish(poll_seconds=poll_seconds)
