"""The embedded default's disk broker: with a producer and two consumers
racing, every message arrives whole, exactly once; and a worker's wait for
messages ends when the worker is asked to stop."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path
from typing import Any

import pytest
from celery.worker import state as worker_state
from kombu import Connection

import portal.broker  # noqa: F401 - registers the qmdisk:// transport


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One broker folder for the module's tests, each on a queue of its own: kombu's
    filesystem transport keeps the queues' bindings in one state per process, so
    every connection of a process must use the same folders (as every process of
    the embedded default does)."""
    return tmp_path_factory.mktemp("broker")


@pytest.fixture
def running_worker(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """This process's Celery worker state with no stop asked; set a flag to ask one."""
    monkeypatch.setattr(worker_state, "should_stop", None)
    monkeypatch.setattr(worker_state, "should_terminate", None)
    return monkeypatch


def _options(root: Path) -> dict[str, Any]:
    for sub in ("out", "processed", "control"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    return {
        "data_folder_in": str(root / "out"),
        "data_folder_out": str(root / "out"),
        "processed_folder": str(root / "processed"),
        "control_folder": str(root / "control"),
        "polling_interval": 0.01,
    }


def _consume(root: Path, seen: Any, total: int) -> None:
    with Connection("qmdisk://", transport_options=_options(root)) as connection:
        queue = connection.SimpleQueue("race")
        while len(seen) < total:
            try:
                message = queue.get(timeout=0.5)
            except queue.Empty:
                continue
            seen.append(message.payload["n"])
            message.ack()
        queue.close()


def test_messages_arrive_whole_and_once_with_racing_consumers(root: Path) -> None:
    total = 400
    context = multiprocessing.get_context("fork")
    manager = context.Manager()
    seen = manager.list()
    consumers = [context.Process(target=_consume, args=(root, seen, total)) for _ in range(2)]
    for consumer in consumers:
        consumer.start()
    with Connection("qmdisk://", transport_options=_options(root)) as connection:
        queue = connection.SimpleQueue("race")
        for n in range(total):
            queue.put({"n": n, "padding": "x" * 2000})
        queue.close()
    for consumer in consumers:
        consumer.join(timeout=60)
    assert all(consumer.exitcode == 0 for consumer in consumers), (
        "a consumer crashed on a partial message"
    )
    assert sorted(seen) == list(range(total))
    assert not any(name.name.endswith(".msg") for name in (root / "out").iterdir())


@pytest.mark.parametrize("flag", ["should_stop", "should_terminate"])
def test_a_wait_for_messages_ends_when_the_worker_is_asked_to_stop(
    root: Path, running_worker: pytest.MonkeyPatch, flag: str
) -> None:
    """Celery's worker loop waits for messages two seconds at a time and looks at
    its stop flag in between; here the wait is a minute, so it can only end early
    because of the flag. A warm stop sets the flag to the exit code, 0."""
    outcome: list[BaseException] = []
    with Connection("qmdisk://", transport_options=_options(root)) as connection:
        queue = connection.SimpleQueue(f"idle-{flag}")

        def wait() -> None:
            try:
                queue.get(timeout=60)
            except BaseException as error:  # handed to the test's thread
                outcome.append(error)

        waiting = threading.Thread(target=wait, daemon=True)
        waiting.start()
        waiting.join(timeout=0.5)
        assert waiting.is_alive(), "with no message and no stop asked, the wait goes on"
        running_worker.setattr(worker_state, flag, 0)
        waiting.join(timeout=20)
        assert not waiting.is_alive(), "the wait went on after the stop was asked"
        queue.close()
    assert len(outcome) == 1 and isinstance(outcome[0], queue.Empty), outcome


@pytest.mark.usefixtures("running_worker")
def test_a_wait_for_messages_still_ends_at_its_timeout_or_with_a_message(root: Path) -> None:
    with Connection("qmdisk://", transport_options=_options(root)) as connection:
        queue = connection.SimpleQueue("idle")
        with pytest.raises(queue.Empty):
            queue.get(timeout=0.5)
        queue.put({"n": 1})
        assert queue.get(timeout=5).payload == {"n": 1}
        queue.close()
