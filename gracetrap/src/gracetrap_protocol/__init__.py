"""The trap's event protocol: the names of its events and the prefix of the log
line that carries each one (see "Events" in README.md).

A package of its own, beside `gracetrap` and free of torch, so that
the portal, which ingests these events, reads the same list without importing
the training side.
"""

from __future__ import annotations

EVENT_PREFIX = "QM_EVENT "

EVENT_NAMES = (
    "trap_ready",
    "cadence",
    "notice_received",
    "signal_received",
    "stop_heard",
    "checkpoint_started",
    "checkpoint_committed",
    "checkpoint_skipped",
    "exiting",
    "resumed",
)
