"""Preemption drills with real processes, real signals and gloo on CPU."""

from __future__ import annotations

import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from gracetrap_gang import launch, port_bindable, step_dirs


def _preempt_one_rank(tmp_path: Path, world_size: int, victim: int, timeout: float) -> None:
    checkpoint_dir = tmp_path / "checkpoints"
    gang = launch(
        world_size,
        checkpoint_dir,
        tmp_path / "logs",
        ["--steps", "100000", "--step-sleep", "0.05", "--hidden", "8"],
        env={"QM_GRACE_SECONDS": "60"},
    )
    try:
        gang.wait_for_step(3, timeout=timeout)
        gang.ranks[victim].signal(signal.SIGTERM)
        codes = gang.wait(timeout=timeout)
    finally:
        gang.kill()

    assert codes == [0] * world_size, gang.tail()
    last_steps = {rank.rank: rank.steps()[-1][0] for rank in gang.ranks}
    stop_step = last_steps[0]
    assert set(last_steps.values()) == {stop_step}, last_steps

    # One checkpoint, complete, holding exactly the step every rank stopped after.
    assert step_dirs(checkpoint_dir) == {stop_step: True}
    assert json.loads((checkpoint_dir / "latest").read_text())["step"] == stop_step
    for rank in gang.ranks:
        events = rank.events()
        names = [event["event"] for event in events]
        expected = ["trap_ready", "checkpoint_started", "checkpoint_committed", "exiting"]
        if rank.rank == victim:
            expected.insert(1, "signal_received")
        else:
            # The victim's signal, passed on by the gang's relay before the step's end.
            expected.insert(1, "stop_heard")
        assert names == expected, (rank.rank, names)
        if rank.rank != victim:
            assert events[1]["from_rank"] == victim, events[1]
        committed = events[names.index("checkpoint_committed")]
        assert committed["step"] == stop_step
        assert committed["bytes"] > 0 and committed["seconds"] > 0
        assert events[-1]["code"] == 0
        assert all(e["job_id"] == 42 and e["attempt"] == 1 for e in events)
        assert all(e["rank"] == rank.rank for e in events)

    # The rendezvous port is free for the next attempt half a second later at most.
    assert gang.exited_at is not None
    while not port_bindable(gang.master_port):
        assert time.monotonic() - gang.exited_at < 0.5, "MASTER_PORT still bound after 0.5 s"
        time.sleep(0.01)


def test_sigterm_to_one_rank_stops_all_four_after_the_same_step(tmp_path: Path) -> None:
    _preempt_one_rank(tmp_path, world_size=4, victim=2, timeout=120)


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_all_sixteen_after_the_same_step(tmp_path: Path) -> None:
    _preempt_one_rank(tmp_path, world_size=16, victim=11, timeout=400)


def test_grace_shorter_than_the_save_skips_it_and_keeps_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    checkpoint_dir = tmp_path / "checkpoints"
    gang = launch(
        2,
        checkpoint_dir,
        tmp_path / "logs",
        ["--steps", "100000", "--step-sleep", "0.05", "--save-every", "3", "--exit-code", "3"],
        # By the time the ranks agree to stop, the 0.01 s window has run out, while
        # every save so far took longer than that.
        env={"QM_GRACE_SECONDS": "0.01"},
    )
    try:
        gang.wait_for_step(7, timeout=120)
        for rank in gang.ranks:
            rank.signal(signal.SIGTERM)
        codes = gang.wait(timeout=120)
    finally:
        gang.kill()

    assert codes == [3, 3], gang.tail()
    committed_steps = set()
    for rank in gang.ranks:
        # A rank may report the signals it heard of (its own, or another rank's
        # through the relay) at any point of its stop, even after the skip.
        events = [
            event
            for event in rank.events()
            if event["event"] not in ("signal_received", "stop_heard")
        ]
        names = [event["event"] for event in events]
        assert names[-2:] == ["checkpoint_skipped", "exiting"], names
        skipped = events[-2]
        assert "grace window" in skipped["reason"]
        assert events[-1]["code"] == 3
        committed_steps |= {e["step"] for e in events if e["event"] == "checkpoint_committed"}
        # No save was started after the decision to skip.
        started = [e["step"] for e in events if e["event"] == "checkpoint_started"]
        assert max(started) < skipped["step"]
    previous = max(committed_steps)
    dirs = step_dirs(checkpoint_dir)
    assert all(dirs.values()), f"incomplete checkpoint left behind: {dirs}"
    assert max(dirs) == previous
    assert json.loads((checkpoint_dir / "latest").read_text())["step"] == previous

    # The previous checkpoint is intact: a new attempt resumes from it and finishes.
    resumed = launch(
        2,
        checkpoint_dir,
        tmp_path / "logs",
        ["--steps", str(previous + 3)],
        attempt=2,
    )
    try:
        assert resumed.wait(timeout=120) == [0, 0], resumed.tail()
    finally:
        resumed.kill()
    for rank in resumed.ranks:
        assert [e["step"] for e in rank.events() if e["event"] == "resumed"] == [previous + 1]
        assert [s for s, _ in rank.steps()] == [previous + 1, previous + 2]


class _EventSink(BaseHTTPRequestHandler):
    received: list[tuple[str | None, dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.headers.get("Authorization"), json.loads(body)))
        self.send_response(202)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        del format, args


def test_events_are_posted_workers_survive_and_a_second_signal_is_harmless(
    tmp_path: Path,
) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EventSink)
    _EventSink.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/api/v1/jobs/42/events/"
    checkpoint_dir = tmp_path / "checkpoints"
    try:
        gang = launch(
            1,
            checkpoint_dir,
            tmp_path / "logs",
            ["--steps", "100000", "--step-sleep", "0.05", "--workers", "2"],
            env={"QM_EVENTS_URL": url, "QM_EVENTS_TOKEN": "s3cret", "QM_GRACE_SECONDS": "30"},
        )
        try:
            gang.wait_for_step(3, timeout=120)
            # The whole process group, DataLoader workers included, twice.
            gang.ranks[0].signal(signal.SIGTERM)
            gang.ranks[0].signal(signal.SIGTERM)
            codes = gang.wait(timeout=120)
        finally:
            gang.kill()
    finally:
        server.shutdown()
        server.server_close()

    assert codes == [0], gang.tail()
    events = gang.ranks[0].events()
    names = [event["event"] for event in events]
    assert names == [
        "trap_ready",
        "signal_received",
        "checkpoint_started",
        "checkpoint_committed",
        "exiting",
    ]
    assert "Traceback" not in gang.ranks[0].text()
    assert all(step_dirs(checkpoint_dir).values()) and len(step_dirs(checkpoint_dir)) == 1
    # Every logged event was POSTed with the bearer token, the very same object. POSTs
    # run concurrently, so they may arrive in any order; `at` orders them.
    assert [auth for auth, _ in _EventSink.received] == ["Bearer s3cret"] * len(events)
    posted = sorted((body for _, body in _EventSink.received), key=lambda e: e["at"])
    assert posted == sorted(events, key=lambda e: e["at"])


def test_a_signal_that_arrives_after_the_trap_closed_does_not_kill_the_exiting_rank(
    tmp_path: Path,
) -> None:
    """Rank 1's own SIGTERM comes once the gang stopped on rank 0's and the trap closed,
    while the interpreter shuts down: the rank still exits 0, not by the signal."""
    gang = launch(
        2,
        tmp_path / "checkpoints",
        tmp_path / "logs",
        ["--at-exit"],
        script=Path(__file__).with_name("gracetrap_late_signal.py"),
    )
    try:
        codes = gang.wait(timeout=120)
    finally:
        gang.kill()

    assert codes == [0, 0], gang.tail()
    names = [event["event"] for event in gang.ranks[1].events()]
    assert names[-2:] == ["checkpoint_committed", "exiting"], names
    assert len(step_dirs(tmp_path / "checkpoints")) == 1


def test_a_signal_that_arrives_during_the_final_save_is_still_reported(tmp_path: Path) -> None:
    gang = launch(
        2,
        tmp_path / "checkpoints",
        tmp_path / "logs",
        [],
        script=Path(__file__).with_name("gracetrap_late_signal.py"),
    )
    try:
        codes = gang.wait(timeout=120)
    finally:
        gang.kill()

    assert codes == [0, 0], gang.tail()
    ready, *late = gang.ranks[1].events()
    assert ready["event"] == "trap_ready"
    names = [event["event"] for event in late]
    # Rank 0's signal reached rank 1 through the relay before its own came.
    assert names == [
        "stop_heard",
        "checkpoint_started",
        "checkpoint_committed",
        "signal_received",
        "exiting",
    ], names
    assert late[0]["from_rank"] == 0
    started, committed = late[1]["at"], late[2]["at"]
    assert started <= late[3]["at"] <= committed
    assert gang.ranks[0].events()[1]["event"] == "signal_received"
