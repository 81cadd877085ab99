"""How the word of a stop reaches every rank at once: signals seen the moment they
arrive, and passed to the other ranks through the gang's own rendezvous store.

A rank learns of a preemption by its own signal, and on Kubernetes each rank's
node sends it when its kubelet gets to the eviction: 0.1 to 0.7 s apart for 8
ranks on two loaded nodes. Python runs a signal's handler only when the main
thread next runs Python code, which a rank inside a collective or a long kernel
may not do for a whole step. So:

- ``SignalWatch`` hands the interpreter a socket (``signal.set_wakeup_fd``), to
  which its C-level handler writes each signal's number as it arrives, and reads
  it in a thread of its own: the trap knows the time the signal came, whatever the
  main thread is doing.
- ``GangRelay`` passes that word to the other ranks through torch's c10d store of
  the process group (rank 0 serves it, every rank already reaches it): words are
  numbered keys ``word/<n>`` that each rank's thread waits for in turn, so a word
  reaches every rank in about a millisecond, one request each, with no polling.

The gang still agrees on the step to stop at through the all-reduce in
``should_stop``; the relay only makes every rank know sooner. Written here because
torch offers no broadcast outside a collective (a collective needs every rank's
main thread) and c10d's store, a key-value server with blocking waits, is the one
channel every rank of a process group is known to reach.

Neither thread may outlive the rank's exit handlers: a thread that takes the GIL
while the interpreter finalizes ends the process with "terminate called without an
active exception". ``GangRelay.stop`` wakes its thread with a word of its own and
joins it; ``shutdown`` ends every rank's thread with one word from rank 0.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed.distributed_c10d import PrefixStore, _get_default_store

# One blocking wait of the store lasts at most this long before it is asked again.
# Long, since a stop word, the rank's own goodbye or rank 0's end wakes it.
WAIT_SECONDS = 3600.0
# How long `stop` waits for the thread to read its goodbye (or rank 0's end).
JOIN_SECONDS = 2.0
# The store's keys, under the attempt's prefix.
_PREFIX = "gracetrap/relay/"
_COUNTER = "words"


class SignalWatch:
    """Reads the numbers of the signals that arrive, in a thread, as they arrive.

    Calls ``on_signal(signum, at)`` from its thread, ``at`` being ``time.time()`` when
    the byte was read. Where the interpreter's wakeup socket cannot be taken (the trap
    was built outside the main thread, or another part of the program holds it, such
    as an asyncio loop), the trap's handlers ``poke`` it instead, which is later: when
    the main thread runs Python again.
    """

    def __init__(self, on_signal: Callable[[int, float], None]) -> None:
        self._on_signal = on_signal
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        self._closed = threading.Event()
        self.installed = False
        self._previous_fd = -1
        self._pid = os.getpid()
        try:
            previous = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        except ValueError:
            previous = None  # Not the main thread.
        if previous is not None:
            if previous != -1:
                # Someone else's: put it back and use the handlers' pokes.
                signal.set_wakeup_fd(previous)
            else:
                self.installed = True
                # A forked child (a DataLoader worker) inherits the wakeup socket: its
                # own signals must not read as the rank's.
                os.register_at_fork(after_in_child=_forget_wakeup_in_child)
        self._thread = threading.Thread(target=self._run, name="gracetrap-signals", daemon=True)
        self._thread.start()

    def poke(self, signum: int) -> None:
        """Pass one signal on from a Python handler, where the wakeup socket is not ours."""
        if self.installed or self._closed.is_set() or os.getpid() != self._pid:
            return
        with contextlib.suppress(OSError):
            self._writer.send(bytes([signum]))

    def close(self) -> None:
        """Give the wakeup socket back and end the thread."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self.installed:
            with contextlib.suppress(ValueError):
                previous = signal.set_wakeup_fd(-1)
                if previous != self._writer.fileno():
                    # Taken over since: not ours to clear.
                    signal.set_wakeup_fd(previous)
        with contextlib.suppress(OSError):
            self._writer.send(b"\0")
        self._thread.join(JOIN_SECONDS)
        self._reader.close()
        self._writer.close()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                readable, _, _ = select.select([self._reader], [], [], 1.0)
                if not readable:
                    continue
                received = self._reader.recv(64)
            except (OSError, ValueError):
                return
            at = time.time()
            for signum in received:
                if signum and not self._closed.is_set():
                    self._on_signal(signum, at)


def _forget_wakeup_in_child() -> None:
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)


class GangRelay:
    """Words between the ranks of one attempt: ``say`` posts one, every rank's thread
    calls ``on_word(kind, rank, at)`` for each word of another rank, in order.

    Built only inside an initialised process group of more than one rank; its two
    connections to the store are its own (a blocking wait holds a connection).
    """

    def __init__(
        self,
        *,
        rank: int,
        attempt: int | None,
        on_word: Callable[[str, int, float], None],
        store: Any = None,
    ) -> None:
        # Each clone is a connection of its own (Store.clone, missing from older torch).
        base: Any = store if store is not None else _get_default_store()
        prefix = f"{_PREFIX}{attempt if attempt is not None else 0}/"
        self.rank = rank
        self._on_word = on_word
        self._waiting = PrefixStore(prefix, base.clone())
        self._posting = PrefixStore(prefix, base.clone())
        self._post_lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gracetrap-relay", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def say(self, kind: str, at: float) -> None:
        """Post a word for the other ranks; a store that is gone is not an error."""
        self._post({"kind": kind, "rank": self.rank, "at": at})

    def end(self) -> None:
        """Rank 0's last word, which ends every rank's thread (see ``Trap.shutdown``)."""
        self._post({"kind": "end", "rank": self.rank, "at": time.time()})

    def stop(self, timeout: float = JOIN_SECONDS) -> None:
        """End this rank's thread: post its goodbye, unless rank 0's end came, and join."""
        if self._stopping.is_set() and not self._thread.is_alive():
            return
        self._stopping.set()
        if self._thread.is_alive():
            self._post({"kind": "bye", "rank": self.rank, "at": time.time()})
            self._thread.join(timeout)

    def join(self, timeout: float) -> bool:
        """Wait for the thread to end (after rank 0's end); True when it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _post(self, word: dict[str, object]) -> None:
        with self._post_lock:
            try:
                number = int(self._posting.add(_COUNTER, 1))
                self._posting.set(f"word/{number}", json.dumps(word))
            except Exception as error:
                # Rank 0 is gone or going: the all-reduce at the step takes the word.
                line = str(error).splitlines()[0] if str(error) else type(error).__name__
                print(f"gracetrap: relay: {line}", file=sys.stderr, flush=True)

    def _run(self) -> None:
        number = 1
        while True:
            key = f"word/{number}"
            try:
                self._waiting.wait([key], timedelta(seconds=WAIT_SECONDS))
                word = json.loads(self._waiting.get(key))
            except Exception as error:
                if "timeout" in str(error).lower() and not self._stopping.is_set():
                    continue
                # The store closed (rank 0 left): nothing more will come.
                return
            kind, rank = str(word.get("kind")), int(word.get("rank", -1))
            if kind == "end" or (kind == "bye" and rank == self.rank):
                return
            if kind != "bye" and rank != self.rank:
                self._on_word(kind, rank, float(word.get("at", 0.0)))
            number += 1
