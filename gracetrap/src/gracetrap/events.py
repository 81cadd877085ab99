"""Trap events: one ``QM_EVENT {json}`` line on stdout each, plus a best-effort POST.

The stdout line is the record that counts: after a rank exits, the runtime ingests
the ``QM_EVENT`` lines from its log, so an event whose POST was lost still arrives.
The POST only makes the portal learn about it sooner, which is why it runs in a
background thread with a short timeout and why its failures are swallowed.

The same channel carries the checkpoint notice the other way where the runtime cannot
signal its ranks (``QM_NOTICE_POLL_SECONDS``): ``NoticePoller`` asks the events URL
by GET, with the same token, until the answer says a notice was sent.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any, TextIO

from gracetrap_protocol import EVENT_NAMES, EVENT_PREFIX

__all__ = ["EVENT_NAMES", "EVENT_PREFIX", "EventReporter", "NoticePoller", "parse_event_line"]

POST_TIMEOUT_SECONDS = 2.0


def parse_event_line(line: str) -> dict[str, Any] | None:
    """Return the event carried by one log line, or None when the line is not an event."""
    if not line.startswith(EVENT_PREFIX):
        return None
    payload = json.loads(line[len(EVENT_PREFIX) :])
    return payload if isinstance(payload, dict) else None


class EventReporter:
    """Writes trap events to stdout and POSTs them to the portal without ever blocking training.

    ``rank`` is a callable because the process group is often initialised after the
    trap is built, and the rank an event carries must be the one in force when it
    happened.
    """

    def __init__(
        self,
        *,
        job_id: int | str | None,
        attempt: int | None,
        rank: Callable[[], int],
        events_url: str | None,
        events_token: str | None,
        stream: TextIO | None = None,
    ) -> None:
        self.job_id = job_id
        self.attempt = attempt
        self.events_url = events_url or None
        self.events_token = events_token or None
        self.posts_failed = 0
        self.posts_sent = 0
        self._rank = rank
        self._stream = stream
        self._in_flight = 0
        self._lock = threading.Lock()
        # Background saves report their commit from their own thread: one line at a
        # time on the stream. Reentrant, for a signal handler that runs in between.
        self._write_lock = threading.RLock()

    def emit(self, event: str, *, at: float | None = None, **fields: Any) -> dict[str, Any]:
        """Record one event now; ``at`` defaults to the current Unix time."""
        payload: dict[str, Any] = {
            "event": event,
            "job_id": self.job_id,
            "attempt": self.attempt,
            "rank": self._rank(),
            "at": time.time() if at is None else at,
        }
        payload.update(fields)
        text = json.dumps(payload)
        stream = self._stream if self._stream is not None else sys.stdout
        try:
            with self._write_lock:
                stream.write(EVENT_PREFIX + text + "\n")
                stream.flush()
        except (OSError, ValueError):
            # A closed or broken stdout must not take training down with it.
            pass
        if self.events_url is not None:
            # One daemon thread per event: a portal that does not answer delays no
            # other event and can never keep a finished rank alive.
            with self._lock:
                self._in_flight += 1
            threading.Thread(
                target=self._post, args=(text.encode(),), name="gracetrap-event", daemon=True
            ).start()
        return payload

    def flush(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for POSTs in flight to finish (or fail)."""
        deadline = time.monotonic() + max(0.0, timeout)
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(0.01)

    def _post(self, body: bytes) -> None:
        assert self.events_url is not None
        headers = {"Content-Type": "application/json"}
        if self.events_token is not None:
            headers["Authorization"] = f"Bearer {self.events_token}"
        request = urllib.request.Request(self.events_url, data=body, headers=headers, method="POST")
        sent = False
        try:
            with urllib.request.urlopen(request, timeout=POST_TIMEOUT_SECONDS) as response:
                response.read()
            sent = True
        except Exception:
            # Best effort by design: the log line on stdout already carries the event.
            pass
        finally:
            with self._lock:
                self._in_flight -= 1
                if sent:
                    self.posts_sent += 1
                else:
                    self.posts_failed += 1


class NoticePoller:
    """Asks the events URL for a checkpoint notice every ``interval`` seconds, in a
    daemon thread, and calls ``on_notice`` once, with the time the answer came, when
    the answer is ``{"notice": true, ...}``; then it stops. An answer that fails or
    says anything else is asked again at the next tick: a poll never stops training.
    """

    def __init__(
        self,
        *,
        events_url: str,
        events_token: str,
        interval: float,
        on_notice: Callable[[float], None],
    ) -> None:
        if interval <= 0:
            raise ValueError("the poll interval must be positive")
        self.events_url = events_url
        self.events_token = events_token
        self.interval = interval
        self.polls = 0
        self._on_notice = on_notice
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gracetrap-notice", daemon=True)

    def start(self) -> NoticePoller:
        """Start polling; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling (a poll in flight ends within its timeout, unseen)."""
        self._stopped.set()

    def ask(self) -> bool:
        """One poll: True when the answer says a notice was sent."""
        request = urllib.request.Request(
            self.events_url,
            headers={"Authorization": f"Bearer {self.events_token}", "Accept": "application/json"},
            method="GET",
        )
        self.polls += 1
        try:
            with urllib.request.urlopen(request, timeout=POST_TIMEOUT_SECONDS) as response:
                answer = json.loads(response.read() or b"null")
        except Exception:
            # The portal may be restarting or the token refused: ask again next time.
            return False
        return isinstance(answer, dict) and answer.get("notice") is True

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            if self.ask():
                if not self._stopped.is_set():
                    self._on_notice(time.time())
                return
