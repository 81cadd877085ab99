"""gracetrap: graceful preemption for distributed PyTorch training.

Catch the preemption signal, let every rank agree on the same last step, write an
atomic checkpoint through ``torch.distributed.checkpoint``, close the communicators
and exit cleanly; on the next attempt, resume bit-exactly from that checkpoint.
See README.md for the protocol and a complete example.

The names that need PyTorch are imported on first use, so that a scheduler can
import ``gracetrap.events`` and ``gracetrap.protocol`` (event names, variables,
the cadence rule) without installing or loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gracetrap.checkpoints import (
    CheckpointInfo,
    complete_checkpoints,
    is_complete,
    list_checkpoints,
    read_pointer,
)
from gracetrap.events import EVENT_NAMES, EVENT_PREFIX, EventReporter, parse_event_line
from gracetrap.protocol import checkpoint_interval
from gracetrap.sampling import (
    ElasticSampler,
    RankBatch,
    derive_seed,
    rank_seed,
    sample_seed,
    seed_rank_streams,
)

if TYPE_CHECKING:
    from gracetrap.base import DEFAULT_SIGNALS
    from gracetrap.state import capture_rng_state, restore_rng_state
    from gracetrap.trap import Trap, worker_init_fn

_NEED_TORCH = {
    "capture_rng_state": "gracetrap.state",
    "restore_rng_state": "gracetrap.state",
    "DEFAULT_SIGNALS": "gracetrap.base",
    "Trap": "gracetrap.trap",
    "worker_init_fn": "gracetrap.trap",
}

__all__ = [
    "DEFAULT_SIGNALS",
    "EVENT_NAMES",
    "EVENT_PREFIX",
    "CheckpointInfo",
    "ElasticSampler",
    "EventReporter",
    "RankBatch",
    "Trap",
    "capture_rng_state",
    "checkpoint_interval",
    "complete_checkpoints",
    "derive_seed",
    "is_complete",
    "list_checkpoints",
    "parse_event_line",
    "rank_seed",
    "read_pointer",
    "restore_rng_state",
    "sample_seed",
    "seed_rank_streams",
    "worker_init_fn",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _NEED_TORCH.get(name)
    if module is None:
        raise AttributeError(f"module 'gracetrap' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
