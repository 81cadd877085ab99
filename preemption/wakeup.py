"""Ask for an extra scheduling cycle after a change that may let a job run.

The cycle task itself is an interface module (`portal.tasks`) above this
domain, so it is sent by its registered name rather than imported.

Every submission asks for a cycle; a message each would flood the broker and
the worker pool in a burst, delaying the reconciler's passes behind them. So a
request first claims a marker file in QM_VAR_DIR: while one request waits for
a cycle to start, later ones are covered by that cycle and send nothing. A
cycle takes the request when it starts, before its snapshot. The marker is
shared by the web server and the worker of one machine; where they run on
separate machines a request waits at most REQUEST_OVERDUE_SECONDS, and the
periodic cycle runs meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from celery import current_app
from django.conf import settings
from django.db import transaction

SCHEDULE_CYCLE_TASK = "preemption.tasks.schedule_cycle"
RECONCILE_TASK = "preemption.tasks.reconcile"
REQUEST_OVERDUE_SECONDS = 2.0

logger = logging.getLogger(__name__)


def queue_cycle() -> None:
    """Ask for an extra scheduling cycle once the current transaction commits,
    unless one asked for already has not started yet: that one will see this
    commit too."""
    transaction.on_commit(_send_if_first)


def _request_marker() -> Path:
    return Path(settings.VAR_DIR) / "cycle.requested"


def claim_cycle_request() -> bool:
    """True when the caller should queue an extra cycle: no other request is
    waiting for a cycle to start, or the one waiting is overdue (its message
    lost or expired)."""
    marker = _request_marker()
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return True
    except FileExistsError:
        pass
    except OSError:
        return True
    try:
        if time.time() - marker.stat().st_mtime <= REQUEST_OVERDUE_SECONDS:
            return False
        os.utime(marker)
    except OSError:
        pass
    return True


def take_cycle_request() -> None:
    """A cycle starts: requests from now on need a cycle of their own."""
    with contextlib.suppress(OSError):
        _started_marker().touch()
    with contextlib.suppress(OSError):
        _request_marker().unlink(missing_ok=True)


def _started_marker() -> Path:
    return Path(settings.VAR_DIR) / "cycle.started"


def cycle_waiting() -> bool:
    """Whether a cycle was asked for and none has started since."""
    return _request_marker().exists()


def cycle_started_since(moment: float) -> bool:
    """Whether a cycle started after ``moment`` (a time.time()): it saw everything
    committed before then, so a request made then is already served. A file's time
    may lag the clock by a tick, which can only make a served request look unserved
    (one cycle too many), never the reverse."""
    try:
        return _started_marker().stat().st_mtime > moment
    except OSError:
        return False


def _send_if_first() -> None:
    if not claim_cycle_request():
        return
    # The beat runs the cycle every second anyway: a broker hiccup while asking
    # for an extra run must not fail the request that asked.
    try:
        current_app.send_task(
            SCHEDULE_CYCLE_TASK, kwargs={"requested_at": time.time()}, retry=False, expires=5
        )
    except Exception:
        logger.warning("could not queue an extra scheduling cycle", exc_info=True)


def send_reconcile(job_ids: list[int] | None = None) -> None:
    """Ask for a reconcile pass now, of every job or only of `job_ids`: a rank
    exited, or a victim committed the checkpoint its notice asked for and its
    eviction should not wait for the next periodic pass. Call it after the change
    it reports has committed.

    A pass of a few jobs runs even while a pass of every job is under way (that
    one may have read the jobs before the change and is skipped by a request of
    its own kind), and looks at those jobs' gangs only."""
    kwargs = {"job_ids": list(job_ids)} if job_ids else None
    try:
        current_app.send_task(RECONCILE_TASK, kwargs=kwargs, retry=False, expires=5)
    except Exception:
        logger.warning("could not queue a reconcile pass", exc_info=True)
