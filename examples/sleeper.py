"""A small workload for runtime tests: sleep, then exit with a chosen code.

On SIGTERM it prints when the signal arrived (Unix time, taken inside the handler) and
exits with --term-exit-code, as a workload that stops cleanly would.

    python examples/sleeper.py --seconds 30 --exit-code 3 --term-exit-code 0
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from types import FrameType


def main() -> int:
    """Parse the arguments, announce readiness, sleep and exit."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3600.0, help="how long to sleep")
    parser.add_argument("--exit-code", type=int, default=0, help="exit code after sleeping")
    parser.add_argument(
        "--term-exit-code", type=int, default=0, help="exit code after receiving SIGTERM"
    )
    args = parser.parse_args()

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        print(f"sleeper rank={os.environ.get('RANK', '')} sigterm_at={time.time():.6f}", flush=True)
        sys.exit(args.term_exit_code)

    signal.signal(signal.SIGTERM, on_sigterm)
    print(f"sleeper rank={os.environ.get('RANK', '')} pid={os.getpid()} ready", flush=True)
    time.sleep(args.seconds)
    print(f"sleeper rank={os.environ.get('RANK', '')} done", flush=True)
    exit_code: int = args.exit_code
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
