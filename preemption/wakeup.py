"""Ask for an extra scheduling cycle after a change that may let a job run.

The cycle task itself is an interface module (`portal.tasks`) above this
domain, so it is sent by its registered name rather than imported.
"""

from __future__ import annotations

import logging

from celery import current_app
from django.db import transaction

SCHEDULE_CYCLE_TASK = "preemption.tasks.schedule_cycle"

logger = logging.getLogger(__name__)


def queue_cycle() -> None:
    """Ask for an extra scheduling cycle once the current transaction commits."""
    transaction.on_commit(_send_quietly)


def _send_quietly() -> None:
    # The beat runs the cycle every second anyway: a broker hiccup while asking
    # for an extra run must not fail the request that asked.
    try:
        current_app.send_task(SCHEDULE_CYCLE_TASK, retry=False, expires=5)
    except Exception:
        logger.warning("could not queue an extra scheduling cycle", exc_info=True)
