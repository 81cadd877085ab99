"""The checkpoint notice by poll, as on Kubernetes: real gloo ranks whose runtime sets
QM_NOTICE_POLL_SECONDS ask a real HTTP server for the notice with their token, and
answer it as they answer the notice signal."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from gracetrap.events import NoticePoller
from gracetrap_gang import launch, step_dirs

TOKEN = "t" * 64
MODEL = ["--steps", "400", "--hidden", "256", "--layers", "2", "--step-sleep", "0.05"]


class EventsEndpoint:
    """The events URL: takes POSTed events, answers polls with the notice once sent."""

    def __init__(self) -> None:
        self.notice_sent_at: float | None = None
        self.polls: list[tuple[float, str]] = []
        self.posted: list[dict[str, Any]] = []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                auth = self.headers.get("Authorization", "")
                endpoint.polls.append((time.time(), auth))
                if auth != f"Bearer {TOKEN}":
                    self._answer(403, {"detail": "refused"})
                    return
                sent = endpoint.notice_sent_at
                self._answer(200, {"attempt": 1, "notice": sent is not None, "sent_at": sent})

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                endpoint.posted.append(json.loads(body))
                self._answer(202, {"accepted": 1})

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api/v1/jobs/42/events/"


@pytest.fixture
def endpoint() -> Iterator[EventsEndpoint]:
    served = EventsEndpoint()
    thread = threading.Thread(target=served.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        served.server.shutdown()
        served.server.server_close()


def test_a_polled_notice_is_answered_while_training_goes_on(
    tmp_path: Path, endpoint: EventsEndpoint
) -> None:
    checkpoint_dir = tmp_path / "checkpoints"
    gang = launch(
        2,
        checkpoint_dir,
        tmp_path / "logs",
        MODEL,
        env={
            "QM_NOTICE_POLL_SECONDS": "0.5",
            "QM_NOTICE_SIGNAL": "off",
            "QM_EVENTS_URL": endpoint.url,
            "QM_EVENTS_TOKEN": TOKEN,
            "QM_ASYNC_SAVES": "1",
            "QM_GRACE_SECONDS": "60",
        },
    )
    try:
        ready = gang.wait_for_event("trap_ready", timeout=120)
        assert {(e["notice_signal"], e["notice_poll"]) for e in ready} == {(None, True)}
        gang.wait_for_step(5, timeout=120)
        deadline = time.monotonic() + 10
        while len(endpoint.polls) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(endpoint.polls) >= 2, "nobody asked for the notice"
        assert {auth for _, auth in endpoint.polls} == {f"Bearer {TOKEN}"}
        endpoint.notice_sent_at = time.time()
        committed = gang.wait_for_event("checkpoint_committed", timeout=120, notice=True)
        notice_step = committed[0]["step"]
        assert {e["step"] for e in committed} == {notice_step}
        # Rank 0 asked and received it and the relay told rank 1 at once (the all-reduce
        # at the next step boundary would have); both began the notice's save within a
        # second of the notice.
        received = [e for e in gang.ranks[0].events() if e["event"] == "notice_received"]
        assert len(received) == 1 and received[0]["at"] >= endpoint.notice_sent_at
        relayed = [e for e in gang.ranks[1].events() if e["event"] == "notice_received"]
        assert len(relayed) == 1 and relayed[0]["at"] >= received[0]["at"]
        for rank in gang.ranks:
            began = [
                e["at"]
                for e in rank.events()
                if e["event"] == "checkpoint_started" and e["step"] == notice_step
            ]
            assert began and began[0] - endpoint.notice_sent_at < 1.0
        gang.wait_for_step(notice_step + 3, timeout=120)
        assert all(rank.process.poll() is None for rank in gang.ranks)
        # The poll stopped with the answer.
        polls = len(endpoint.polls)
        time.sleep(1.5)
        assert len(endpoint.polls) == polls
        gang.ranks[0].signal(signal.SIGTERM)
    finally:
        try:
            codes = gang.wait(timeout=180)
        finally:
            gang.kill()
    assert codes == [0, 0], gang.tail()
    stop_step = gang.ranks[0].steps()[-1][0]
    assert stop_step >= notice_step + 3
    assert max(step_dirs(checkpoint_dir)) == stop_step
    # The commits went to the events URL too, where a scheduler waits for them.
    assert {
        (e["rank"], e["step"])
        for e in endpoint.posted
        if e["event"] == "checkpoint_committed" and e["notice"]
    } == {(0, notice_step), (1, notice_step)}


def test_a_poll_refused_or_unanswered_never_raises_and_is_asked_again(
    endpoint: EventsEndpoint,
) -> None:
    noticed: list[float] = []
    refused = NoticePoller(
        events_url=endpoint.url, events_token="wrong", interval=0.05, on_notice=noticed.append
    )
    assert refused.ask() is False
    nobody = NoticePoller(
        events_url="http://127.0.0.1:9/",
        events_token=TOKEN,
        interval=0.05,
        on_notice=noticed.append,
    )
    assert nobody.ask() is False
    poller = NoticePoller(
        events_url=endpoint.url, events_token=TOKEN, interval=0.05, on_notice=noticed.append
    ).start()
    try:
        deadline = time.monotonic() + 10
        while len(endpoint.polls) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not noticed
        endpoint.notice_sent_at = time.time()
        while not noticed and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(noticed) == 1 and noticed[0] >= endpoint.notice_sent_at
    finally:
        poller.stop()
    with pytest.raises(ValueError, match="positive"):
        NoticePoller(events_url=endpoint.url, events_token=TOKEN, interval=0, on_notice=print)
