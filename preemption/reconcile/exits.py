"""The exits listener: where the runtime can tell (base.ExitWatcher), reconcile
each job whose ranks exit as they exit, in the listener's own process, and beat
its marker (`hold.exits_listened`) so that the periodic passes leave it the gangs
that have just ended.

Stands apart from the pass: it calls `reconcile_jobs` only, and hands what it
cannot do to the worker (`send_reconcile`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from contextlib import suppress

from django.db import close_old_connections

from preemption.models import Attempt
from preemption.reconcile.hold import LISTENER_BEAT_SECONDS, SETTLE_SECONDS, listening_marker
from preemption.reconcile.passes import reconcile_jobs
from preemption.runtime import get_runtime
from preemption.runtimes.base import Runtime, RuntimePermanentError
from preemption.wakeup import send_reconcile

logger = logging.getLogger(__name__)

# How often the exits listener looks again at a job whose gang ended before the
# pass could close it, for up to SETTLE_SECONDS.
SETTLE_RETRY_SECONDS = 0.1


def listen_for_exits(stop: threading.Event) -> bool:
    """Until `stop` is set, reconcile each job whose ranks exit, as they exit, where
    the runtime can tell (base.ExitWatcher: the local and mimic runtimes); False at
    once where it cannot, or when the runtime refuses the watch for good (the local
    runtime's exits pipe is not its own), and the periodic passes find every end.

    The passes run here, in the listener's own process, rather than as tasks: in a
    busy cluster the worker's queue holds scheduling cycles, and an exit waiting
    behind them kept its GPUs from the next job for seconds. The runtime's watch
    runs in a thread of its own and only collects job ids, so exits announced while
    a pass runs are taken together by the next one. An exit the runtime cannot name,
    or a pass that fails, is handed to the worker as a task instead.

    A pass cannot close every attempt it is told of: a gang may end before the
    launch that started it is recorded (a short job in a large batch of launches),
    or another pass may hold its job. Such jobs are looked at again every
    SETTLE_RETRY_SECONDS for up to SETTLE_SECONDS, after which the periodic passes
    have them. While the listener is alive (its marker in QM_VAR_DIR, touched every
    LISTENER_BEAT_SECONDS) the periodic passes leave it the gangs that ended less
    than SETTLE_SECONDS ago; should it die, they take every end again within a
    couple of seconds."""
    runtime = get_runtime()
    watch = getattr(runtime, "watch_exits", None)
    if watch is None:
        return False
    announced: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
    refused, ending = threading.Event(), threading.Event()

    def watching() -> None:
        while not ending.is_set():
            try:
                watch(ending, announced.put)
            except RuntimePermanentError:
                logger.error("not listening for rank exits; periodic passes only", exc_info=True)
                refused.set()
                return
            except Exception:
                logger.warning("listening for rank exits failed; listening again", exc_info=True)
                ending.wait(1.0)

    watcher = threading.Thread(target=watching, name="exits-watch", daemon=True)
    watcher.start()
    # Jobs told of whose attempt a pass left open, and when first told of.
    unsettled: dict[int, float] = {}
    marker = listening_marker()
    beat = 0.0
    try:
        while not stop.is_set() and not refused.is_set():
            if time.monotonic() - beat >= LISTENER_BEAT_SECONDS:
                with suppress(OSError):
                    marker.touch(mode=0o600)
                beat = time.monotonic()
            batches: list[list[int]] = []
            with suppress(queue.Empty):
                batches.append(
                    announced.get(
                        timeout=SETTLE_RETRY_SECONDS if unsettled else LISTENER_BEAT_SECONDS
                    )
                )
                while True:
                    batches.append(announced.get_nowait())
            if any(not batch for batch in batches):
                send_reconcile()
            now = time.monotonic()
            for job_id in (job_id for batch in batches for job_id in batch):
                unsettled.setdefault(job_id, now)
            if unsettled:
                _settle(unsettled, runtime, now)
    finally:
        with suppress(OSError):
            marker.unlink()
        ending.set()
        watcher.join(timeout=10)
    return not refused.is_set()


def _settle(unsettled: dict[int, float], runtime: Runtime, now: float) -> None:
    """One pass of the exits listener over the jobs told of; those whose attempt it
    left open stay in `unsettled` until SETTLE_SECONDS after they were told of."""
    looked = sorted(unsettled)
    close_old_connections()
    try:
        reconcile_jobs(job_ids=looked, runtime=runtime)
        still_open = set(
            Attempt.objects.filter(job_id__in=looked, ended_at__isnull=True).values_list(
                "job_id", flat=True
            )
        )
    except Exception:
        logger.warning("reconciling jobs %s failed; the worker will", looked, exc_info=True)
        send_reconcile(looked)
        unsettled.clear()
        return
    for job_id in looked:
        if job_id not in still_open or now - unsettled[job_id] > SETTLE_SECONDS:
            del unsettled[job_id]
