"""What holds a reconcile pass back on this machine, kept as marker files in
QM_VAR_DIR: the launch hold (`hold_launches`: the act step carries out no launch
while a live process holds it) and the exits listener's beat (`exits_listened`:
while the listener lives, a pass over every job leaves it the gangs that ended
less than SETTLE_SECONDS ago).

Reads and writes those markers only, never the database or the runtime: the act
step, the pass and the exits listener all import it, and it imports none of them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from django.conf import settings

from preemption.runtimes import processes
from preemption.runtimes.records import read_record, write_record

# How long the exits listener keeps looking at a job whose gang ended before the
# pass could close it (exits.listen_for_exits); a periodic pass leaves the
# listener the gangs that ended less long ago.
SETTLE_SECONDS = 2.0
# How often a live exits listener says so (`exits_listened`).
LISTENER_BEAT_SECONDS = 0.5


def listening_marker() -> Path:
    """The file a live exits listener touches (`exits_listened`)."""
    return Path(settings.VAR_DIR) / "exits.listening"


def exits_listened() -> bool:
    """Whether an exits listener of this installation's machine is alive: it touches
    its marker at least every LISTENER_BEAT_SECONDS."""
    try:
        return time.time() - listening_marker().stat().st_mtime < 4 * LISTENER_BEAT_SECONDS
    except OSError:
        return False


def _launch_hold_marker() -> Path:
    return Path(settings.VAR_DIR) / "launches.held"


def hold_launches(held: bool) -> None:
    """Hold every launch of this installation's machine while this process lives, or
    release the hold.

    The embedded portal holds them while it stops: it tells the ranks to stop as soon
    as it is asked to, while its worker still finishes its tasks, and a gang that
    exits on that signal is requeued by the worker's passes; launching it again then
    would only have it stopped a second time. An attempt whose launch is held keeps
    its recorded launch, which the next start's reconcile carries out. The marker
    names the holding process (pid and creation time), so a hold whose process died
    without releasing it holds nothing.
    """
    marker = _launch_hold_marker()
    if not held:
        marker.unlink(missing_ok=True)
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    me = os.getpid()
    write_record(marker, {"pid": me, "created_at": processes.created_at(me)})


def launches_held() -> bool:
    """Whether a live process holds this machine's launches (`hold_launches`)."""
    try:
        holder = read_record(_launch_hold_marker())
        return holder is not None and processes.is_alive(
            int(holder["pid"]), float(holder["created_at"])
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False
