"""Reading the ranks' logs for their trap's QM_EVENT lines, so that no event is
lost when its POST was: every rank's log once its gang has ended (`ingest_logs`,
called by the finish step), and a victim's while its eviction waits on what its
trap announced and committed (`read_victims_logs`, before the decide step).

Reads logs through the runtime with no transaction open and ingests the events
found; it decides and acts on nothing.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Iterable

from django.db.models import prefetch_related_objects

from preemption.ingest import ingest_trap_event
from preemption.models import Attempt, Job, PreemptionEvent, Rank, TrapEvent
from preemption.notice import NOTICE_REASONS
from preemption.reconcile.steps import among, guarded
from preemption.runtimes import iter_log_chunks, iter_trap_events_in_chunks
from preemption.runtimes.base import GangId, Runtime, RuntimePermanentError, RuntimeTemporaryError

logger = logging.getLogger(__name__)


def ingest_logs(job: Job, attempt: Attempt, ranks: Iterable[Rank], runtime: Runtime) -> int:
    """Read every rank's QM_EVENT lines so no event is lost when its POST was.

    Each log is streamed a chunk at a time and its events ingested as they are
    found, so a log of any length costs one chunk and one line of memory; a log
    that cannot be read to its end keeps the events found before."""

    added = 0
    gang = GangId(job.pk, attempt.number)
    for rank in ranks:
        try:
            for event in iter_trap_events_in_chunks(iter_log_chunks(runtime, gang, rank.index)):
                try:
                    added += ingest_trap_event(attempt=attempt, event=event, source="log")
                except Exception as exc:
                    logger.warning("ignoring a refused trap event in %s: %s", rank, exc)
        except (RuntimeTemporaryError, RuntimePermanentError, OSError):
            logger.warning("could not read the log of %s", rank, exc_info=True)
    return added


# When each victim's logs were last read while its eviction waited (monotonic clock).
_victim_logs_read: dict[int, float] = {}
# Each victim's logs are read at most this often: most events arrive by POST anyway,
# and a Kubernetes log read is an API call per rank.
VICTIM_LOG_SECONDS = 1.0


def read_victims_logs(attempts: list[Attempt], runtime: Runtime) -> None:
    """A victim whose eviction waits on what its trap announced or committed: an
    event whose POST was lost is still in the log.

    Only those: the read comes before the decide step, so every victim whose log
    cannot change the decision (no notice is planned for it, or its ranks' notice
    announcements are all stored) is evicted without waiting for it. A Kubernetes
    log read is an API call per rank and every event found is ingested again; read
    for every victim, it put most of a third of a second between a preemption's
    decision and its eviction."""
    now = time.monotonic()
    waiting = _logs_awaited(attempts)
    last = {a.pk: _victim_logs_read[a.pk] for a in waiting if a.pk in _victim_logs_read}
    _victim_logs_read.clear()
    _victim_logs_read.update(last)
    due = [
        attempt
        for attempt in waiting
        if now - _victim_logs_read.get(attempt.pk, float("-inf")) >= VICTIM_LOG_SECONDS
    ]
    prefetch_related_objects(due, "rank_set")
    for attempt in due:
        _victim_logs_read[attempt.pk] = now
        guarded(
            attempt,
            functools.partial(ingest_logs, attempt.job, attempt, attempt.rank_set.all(), runtime),
        )


def _logs_awaited(attempts: list[Attempt]) -> list[Attempt]:
    """The launched victims not yet evicted whose logs may hold what their eviction
    waits on: a commit that answers the notice sent, or, before a notice is
    planned for a victim whose class gives one, a rank's announcement of how to
    send it (`preemption.notice.announced_notice` needs every rank's)."""
    awaited: list[Attempt] = []
    unannounced: list[Attempt] = []
    for attempt in attempts:
        try:
            event = attempt.preemption
        except PreemptionEvent.DoesNotExist:
            continue
        if attempt.launched_at is None or event.signal_sent_at is not None:
            continue
        if event.notice_sent_at is not None:
            awaited.append(attempt)
        elif (
            event.notice_deadline is None
            and event.reason in NOTICE_REASONS
            and attempt.job.priority_class.notice_seconds > 0
        ):
            unannounced.append(attempt)
    if unannounced:
        announced = Counter(
            (job_id, number)
            for job_id, number, _ in TrapEvent.objects.filter(
                job_id__in=among({attempt.job_id for attempt in unannounced}), event="trap_ready"
            )
            .values_list("job_id", "attempt", "rank")
            .distinct()
        )
        awaited += [
            attempt
            for attempt in unannounced
            if announced[(attempt.job_id, attempt.number)] < attempt.job.ranks
        ]
    return awaited
