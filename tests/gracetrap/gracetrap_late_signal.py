"""A rank whose own SIGTERM arrives late, after another rank's signal stopped the gang.

Rank 0 signals itself after step 3. Every rank agrees to stop there; rank 1's own
SIGTERM comes a moment after the agreement, as from a runtime that evicts pods one
by one (on Kubernetes each rank's from its own node's kubelet): by default from
inside the final save, through a registered object; with ``--at-exit`` once the
trap has closed and the process is shutting down (an atexit hook).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from gracetrap import Trap


class SignalsItselfWhenSaved:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def state_dict(self) -> dict[str, Any]:
        if self.enabled:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        return {"marker": torch.zeros(1)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        del state_dict


def signal_itself_while_exiting() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    at_exit = "--at-exit" in sys.argv[1:]
    if rank == 1 and at_exit:
        atexit.register(signal_itself_while_exiting)
    # As a context manager, the trap closes (and restores the handlers it replaced)
    # while the SystemExit of its graceful stop goes out.
    with Trap(
        os.environ["QM_CHECKPOINT_DIR"],
        {"late": SignalsItselfWhenSaved(rank == 1 and not at_exit)},
    ) as trap:
        for step in trap.steps(100):
            print(f"STEP {step} 0 0 0 0 0 0", flush=True)
            if rank == 0 and step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.02)
    sys.exit("the gang was never stopped")


if __name__ == "__main__":
    main()
