"""Polling helper for tests and benchmarks that wait on cluster state."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    check: Callable[[], T | None], *, timeout: float = 30.0, interval: float = 0.05, what: str = ""
) -> T:
    """Call ``check`` until it returns something truthy and return that; raise after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what or 'condition'} not met within {timeout} s")
        time.sleep(interval)
