"""Liveness of a recorded process: a pid with its creation time, checked against a real
process. The kernel's boot time follows the wall clock, so a record taken before a clock
step holds a creation time a second or so off what psutil reads for the same process
later; that process is still alive, and another process is not it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from preemption.runtimes import processes


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def test_a_live_process_is_alive_by_its_record(sleeper: subprocess.Popen[bytes]) -> None:
    created = processes.created_at(sleeper.pid)
    assert created is not None
    assert processes.is_alive(sleeper.pid, created)
    assert processes.is_alive(sleeper.pid, None)


@pytest.mark.parametrize("clock_step", [-1.0, 1.0, 2.0])
def test_a_record_taken_before_a_clock_step_still_finds_its_process(
    sleeper: subprocess.Popen[bytes], clock_step: float
) -> None:
    created = processes.created_at(sleeper.pid)
    assert created is not None
    # The boot time read when the record was written differed by the clock's step.
    assert processes.is_alive(sleeper.pid, created + clock_step)


def test_a_pid_recorded_for_another_process_is_not_alive(
    sleeper: subprocess.Popen[bytes],
) -> None:
    created = processes.created_at(sleeper.pid)
    assert created is not None
    # The same pid with a start minutes apart is a reused pid: another process.
    assert not processes.is_alive(sleeper.pid, created - 300.0)
    assert not processes.is_alive(sleeper.pid, created + 300.0)


def test_an_exited_process_is_not_alive(sleeper: subprocess.Popen[bytes]) -> None:
    created = processes.created_at(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    assert not processes.is_alive(sleeper.pid, created)
    assert processes.created_at(sleeper.pid) is None
