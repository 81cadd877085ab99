"""What the stages of a reconcile pass hand one another: the `Step` the decide
step finds an attempt needs, the gang spec a launch carries, the lease of a
claimed action, and `guarded`, which keeps one attempt's trouble its own.

The stages import this module; it imports none of them. It decides nothing
and calls no runtime.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TypeVar

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import transaction

from preemption.event_tokens import attempt_events_token
from preemption.models import Attempt, Job, PreemptionEvent, Rank
from preemption.runtimes.base import (
    GangId,
    GangSpec,
    RankPlacement,
    RuntimePermanentError,
    RuntimeTemporaryError,
)

logger = logging.getLogger(__name__)

TERMINAL_PHASES = ("exited", "lost")


T = TypeVar("T")
FINISH = "finish"
# A claim older than this belonged to a worker that died while acting: longer than
# any single runtime call may take (the local launcher's timeout, the Celery task's
# hard time limit).
ACTION_LEASE = timedelta(seconds=180)


def events_url(job_id: int) -> str:
    return f"{settings.QM_PUBLIC_URL.rstrip('/')}/api/v1/jobs/{job_id}/events/"


def gang_spec(job: Job, attempt: Attempt, ranks: Iterable[Rank]) -> GangSpec:
    per_node: dict[str, int] = defaultdict(int)
    placements = []
    for rank in sorted(ranks, key=lambda r: r.index):
        placements.append(
            RankPlacement(rank=rank.index, node=rank.node, local_rank=per_node[rank.node])
        )
        per_node[rank.node] += 1
    env = {
        **{str(k): str(v) for k, v in (job.env or {}).items()},
        "QM_JOB_ID": str(job.pk),
        "QM_ATTEMPT": str(attempt.number),
        "QM_GRACE_SECONDS": str(job.priority_class.grace_seconds),
        "QM_CHECKPOINT_DIR": job.checkpoint_dir,
        "QM_EVENTS_URL": events_url(job.pk),
        # The attempt's own token: it expires when the attempt ends.
        "QM_EVENTS_TOKEN": attempt_events_token(attempt),
    }
    return GangSpec(
        job_id=job.pk,
        attempt=attempt.number,
        command=job.command,
        ranks=tuple(placements),
        gpus_per_rank=job.gpus_per_rank,
        grace_seconds=float(job.priority_class.grace_seconds),
        priority_class=job.priority_class.name,
        env=env,
        image=job.image or None,
        team=job.team.slug,
        flavor=job.flavor.name,
        mtbp_seconds=attempt.preemption_mtbp_seconds,
    )


@dataclass
class Step:
    """What the decide step found an attempt needs from the runtime next.

    `action` is one of Attempt.Action's values, or FINISH: every rank has exited and
    the attempt is to be closed (which reads the ranks' logs first)."""

    action: str
    attempt: Attempt
    event: PreemptionEvent | None = None
    spec: GangSpec | None = None
    alive: list[int] = field(default_factory=list)
    # When the runtime call began: a signal is recorded as sent at this moment,
    # since ranks receive it while the call runs and the record must not say it
    # was sent after they received it.
    called_at: datetime | None = None
    # When it returned: a launch is recorded as done at this moment, its own, not
    # when the last of the pass's launches returned (the work a victim loses counts
    # from its launch).
    returned_at: datetime | None = None
    # A kill whose gang's evictions a disruption budget still refused: the
    # preemption's outcome says it was forced past the budget.
    forced: bool = False
    # A checkpoint notice: the signal to send ("" where the runtime answers polls).
    notice_signal: str = ""

    @property
    def gang(self) -> GangId:
        return GangId(self.attempt.job_id, self.attempt.number)


def guarded(attempt: Attempt, work: Callable[[], T], *, savepoint: bool = False) -> T | None:
    """One attempt's trouble is logged and never stops the pass for the others;
    with `savepoint`, its writes so far are undone and the others' kept.

    Two kinds of trouble are not one attempt's and end the pass: the task's time
    limit, and an error that left the enclosing transaction unusable (every later
    query in it would fail); the next pass starts afresh."""
    try:
        if savepoint:
            with transaction.atomic():
                return work()
        return work()
    except SoftTimeLimitExceeded:
        raise
    except (RuntimeTemporaryError, RuntimePermanentError):
        logger.warning("runtime error on %s; retrying next cycle", attempt, exc_info=True)
    except Exception:
        if transaction.get_connection().needs_rollback:
            raise
        logger.exception("reconciling %s failed; retrying next cycle", attempt)
    return None
