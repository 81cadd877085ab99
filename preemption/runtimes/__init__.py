"""Runtimes: how Quartermaster starts, signals, kills and observes gangs of ranks.

Nothing here imports Django, so the launcher stays light and the code can be tested alone.
"""

from preemption.runtimes.base import (
    GangGuard,
    GangId,
    GangSpec,
    NodeInventory,
    RankObservation,
    RankPlacement,
    Runtime,
    RuntimePermanentError,
    RuntimeTemporaryError,
    read_whole_log,
)
from preemption.runtimes.inventory import parse_inventory
from preemption.runtimes.local import GangProcess, LocalRuntime
from preemption.runtimes.trap_events import iter_trap_events

__all__ = [
    "GangGuard",
    "GangId",
    "GangProcess",
    "GangSpec",
    "LocalRuntime",
    "NodeInventory",
    "RankObservation",
    "RankPlacement",
    "Runtime",
    "RuntimePermanentError",
    "RuntimeTemporaryError",
    "iter_trap_events",
    "parse_inventory",
    "read_whole_log",
]
