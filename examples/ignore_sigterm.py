"""A small workload for runtime tests that ignores SIGTERM: only SIGKILL stops it.

It prints each SIGTERM it receives and keeps sleeping, like a workload that never
installed a graceful handler and is stuck, so the control plane must kill it at the
deadline.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from types import FrameType


def main() -> int:
    """Announce readiness, then sleep forever, noting every SIGTERM."""

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        print(f"ignore_sigterm rank={os.environ.get('RANK', '')} sigterm ignored", flush=True)

    signal.signal(signal.SIGTERM, on_sigterm)
    print(f"ignore_sigterm rank={os.environ.get('RANK', '')} pid={os.getpid()} ready", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
