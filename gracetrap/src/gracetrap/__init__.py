"""gracetrap: graceful preemption for distributed PyTorch training.

Catch the preemption signal, let every rank agree on the same last step, write an
atomic checkpoint through ``torch.distributed.checkpoint``, close the communicators
and exit cleanly; on the next attempt, resume bit-exactly from that checkpoint.
See README.md for the protocol and a complete example.
"""

from gracetrap.checkpoints import (
    CheckpointInfo,
    complete_checkpoints,
    is_complete,
    list_checkpoints,
    read_pointer,
)
from gracetrap.events import EVENT_NAMES, EVENT_PREFIX, EventReporter, parse_event_line
from gracetrap.state import capture_rng_state, restore_rng_state
from gracetrap.trap import DEFAULT_SIGNALS, Trap, worker_init_fn

__all__ = [
    "DEFAULT_SIGNALS",
    "EVENT_NAMES",
    "EVENT_PREFIX",
    "CheckpointInfo",
    "EventReporter",
    "Trap",
    "capture_rng_state",
    "complete_checkpoints",
    "is_complete",
    "list_checkpoints",
    "parse_event_line",
    "read_pointer",
    "restore_rng_state",
    "worker_init_fn",
]

__version__ = "0.1.0"
