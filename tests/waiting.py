"""Waiting in tests for something real to happen (a process to start, a rank to exit)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    condition: Callable[[], bool],
    what: str,
    timeout: float = 30.0,
    explain: Callable[[], str] | None = None,
) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout` seconds, with
    what `explain` tells of the state at that moment."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            state = "" if explain is None else f"\n{explain()}"
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{state}")
        time.sleep(0.02)
