"""The embedded default's disk broker: with a producer and two consumers
racing, every message arrives whole, exactly once."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

from kombu import Connection

import portal.broker  # noqa: F401 - registers the qmdisk:// transport


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


def test_messages_arrive_whole_and_once_with_racing_consumers(tmp_path: Path) -> None:
    total = 400
    context = multiprocessing.get_context("fork")
    manager = context.Manager()
    seen = manager.list()
    consumers = [context.Process(target=_consume, args=(tmp_path, seen, total)) for _ in range(2)]
    for consumer in consumers:
        consumer.start()
    with Connection("qmdisk://", transport_options=_options(tmp_path)) as connection:
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
    assert not any(name.endswith(".msg") for name in (tmp_path / "out").iterdir())
