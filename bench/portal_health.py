"""Waiting for a portal that a benchmark started to answer."""

from __future__ import annotations

import http.client
import subprocess
import time
from collections.abc import Mapping


def wait_healthy(
    port: int, processes: Mapping[str, subprocess.Popen[bytes]], timeout: float = 120.0
) -> None:
    """Return once the portal on ``port`` answers /healthz with 200; raise RuntimeError
    if one of ``processes`` (its web server, worker, beat, or the command running them)
    exits first, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = {
            name: child.returncode for name, child in processes.items() if child.poll() is not None
        }
        if dead:
            raise RuntimeError(f"exited while the portal started (exit codes): {dead}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/healthz")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the portal on port {port} did not answer /healthz in {timeout:g} s")
