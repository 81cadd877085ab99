"""TCP relays from the pods' bridge to services of this machine, with socat.

The real-node test cluster has no kube-proxy and no routes out of the pods'
bridge: the one host address a pod reaches is the bridge's own (``RealNodes.
dns_address``). A portal installed on those nodes needs the API server,
PostgreSQL and Redis, which listen on the loopback address only, and ranks need
the portal's web pod at a fixed address. A relay listens on the bridge address
and forwards each connection to one target; socat (Debian's package, installed
by ``bin/test-services``) does exactly that, one process per relay.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from types import TracebackType


class RelayError(RuntimeError):
    """A relay could not be started."""


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class Relays:
    """socat processes listening on ``host``; all stopped on ``close``."""

    host: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def reserve(self) -> int:
        """A free port of ``host`` for a relay whose target is not known yet."""
        return _free_port(self.host)

    def add(
        self, target_host: str, target_port: int, *, port: int = 0, timeout: float = 10.0
    ) -> int:
        """A relay from ``port`` of ``host`` (a free one if 0) to the target; returns
        that port once it accepts connections."""
        socat = shutil.which("socat")
        if socat is None:
            raise RelayError("socat is not installed (bin/test-services installs it)")
        port = port or _free_port(self.host)
        process = subprocess.Popen(
            [
                socat,
                f"TCP-LISTEN:{port},bind={self.host},reuseaddr,fork",
                f"TCP:{target_host}:{target_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.processes.append(process)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                error = process.stderr.read().decode() if process.stderr else ""
                raise RelayError(f"socat to {target_host}:{target_port} ended: {error.strip()}")
            try:
                with socket.create_connection((self.host, port), timeout=0.5):
                    return port
            except OSError:
                time.sleep(0.05)
        raise RelayError(f"the relay to {target_host}:{target_port} never listened")

    def close(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()

    def __enter__(self) -> Relays:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
