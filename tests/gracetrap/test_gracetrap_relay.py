"""The relay (gracetrap.relay): a signal is seen when it arrives and every rank hears
of it at once, with real processes, real signals and gloo on CPU."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from gracetrap.relay import SignalWatch
from gracetrap_gang import launch

WORKER = Path(__file__).with_name("gracetrap_relay_worker.py")
SLOW_SECONDS = 4.0


def _step_ends(text: str) -> dict[int, float]:
    """step -> when the rank's all-reduce of that step returned."""
    ends = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "STEP":
            ends[int(parts[1])] = float(parts[2])
    return ends


def test_a_rank_waiting_in_a_collective_is_told_at_once_and_so_is_every_other(
    tmp_path: Path,
) -> None:
    gang = launch(
        3,
        tmp_path / "checkpoints",
        tmp_path / "logs",
        ["--slow-seconds", str(SLOW_SECONDS)],
        env={"QM_GRACE_SECONDS": "60"},
        script=WORKER,
    )
    try:
        deadline = time.monotonic() + 120
        while 1 not in _step_ends(gang.ranks[1].text()):
            assert time.monotonic() < deadline, gang.tail()
            assert all(rank.process.poll() is None for rank in gang.ranks), gang.tail()
            time.sleep(0.05)
        # Rank 1 is now in step 2's all-reduce, waiting seconds for rank 0.
        time.sleep(0.5)
        signalled = time.time()
        gang.ranks[1].signal(signal.SIGTERM)
        codes = gang.wait(timeout=120)
    finally:
        gang.kill()
    assert codes == [0, 0, 0], gang.tail()

    ends = {rank.rank: _step_ends(rank.text()) for rank in gang.ranks}
    # The step during which the signal came: the first to end after it, on every rank.
    step = min(s for s, at in ends[1].items() if at > signalled)
    assert all(min(s for s, at in e.items() if at > signalled) == step for e in ends.values())
    events = {rank.rank: {e["event"]: e for e in rank.events()} for rank in gang.ranks}

    # Rank 1's signal is timed when it arrived, not when its collective let Python run.
    received = events[1]["signal_received"]
    assert signalled <= received["at"] < ends[1][step], (signalled, received, ends[1])
    # Ranks 0 (asleep in Python) and 2 (in the collective) heard it from rank 1 before
    # that step ended: a whole slow step sooner than the all-reduce would have told them.
    for other in (0, 2):
        heard = events[other]["stop_heard"]
        assert "signal_received" not in events[other], events[other]
        assert heard["from_rank"] == 1
        assert heard["signalled_at"] == pytest.approx(received["at"], abs=1e-6)
        assert received["at"] <= heard["at"] < ends[other][step], (heard, ends[other])
    # Still one agreed stop: every rank saved the same step and exited.
    for rank in gang.ranks:
        names = [e["event"] for e in rank.events()]
        assert names[-3:] == ["checkpoint_started", "checkpoint_committed", "exiting"], names
        assert rank.events()[-2]["step"] == step


def test_where_the_wakeup_socket_is_taken_the_handlers_pass_signals_on() -> None:
    # An asyncio loop, say, holds the interpreter's wakeup socket.
    import socket

    theirs, _ = socket.socketpair()
    theirs.setblocking(False)
    previous = signal.set_wakeup_fd(theirs.fileno())
    arrived: list[int] = []
    done = threading.Event()

    def on_signal(signum: int, at: float) -> None:
        arrived.append(signum)
        done.set()

    try:
        watch = SignalWatch(on_signal)
        assert not watch.installed
        assert signal.set_wakeup_fd(theirs.fileno()) == theirs.fileno()
        watch.poke(signal.SIGTERM)
        assert done.wait(10)
        assert arrived == [signal.SIGTERM]
        watch.close()
        # Closing left their socket in place.
        assert signal.set_wakeup_fd(theirs.fileno()) == theirs.fileno()
    finally:
        signal.set_wakeup_fd(previous)
        theirs.close()


def test_a_forked_childs_own_signal_is_not_the_ranks() -> None:
    arrived: list[int] = []
    watch = SignalWatch(lambda signum, at: arrived.append(signum))
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    try:
        assert watch.installed
        child = os.fork()
        if child == 0:
            # As a DataLoader worker that handles a signal of its own.
            os.kill(os.getpid(), signal.SIGUSR1)
            os._exit(0)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        # The rank's own signal still arrives, and only it.
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not arrived and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert arrived == [signal.SIGUSR1]
    finally:
        watch.close()
        signal.signal(signal.SIGUSR1, previous)
