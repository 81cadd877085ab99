"""A rank whose own SIGTERM arrives while it saves after another rank's signal.

Rank 0 signals itself after step 3. Every rank agrees to stop there; on rank 1 a
registered object sends rank 1 its own SIGTERM from inside the final save, as a
runtime that evicts pods one by one would, a moment after the agreement.
"""

from __future__ import annotations

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


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    trap = Trap(os.environ["QM_CHECKPOINT_DIR"], {"late": SignalsItselfWhenSaved(rank == 1)})
    for step in trap.steps(100):
        print(f"STEP {step} 0 0 0 0 0 0", flush=True)
        if rank == 0 and step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.02)
    sys.exit("the gang was never stopped")


if __name__ == "__main__":
    main()
