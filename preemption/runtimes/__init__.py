"""Runtimes: how Quartermaster starts, signals, kills and observes gangs of ranks.

Nothing here imports Django, so the launcher stays light and the code can be tested alone.

The names below are loaded on first use (PEP 562), not when the package is: every
launch of a gang starts `python -m preemption.runtimes.launcher`, which imports this
package first, and loading the runtimes themselves there took over half of that
interpreter's start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
        iter_log_chunks,
    )
    from preemption.runtimes.inventory import parse_inventory
    from preemption.runtimes.local import GangProcess, LocalRuntime
    from preemption.runtimes.trap_events import iter_trap_events, iter_trap_events_in_chunks

_HOMES = {
    "GangGuard": "base",
    "GangId": "base",
    "GangSpec": "base",
    "NodeInventory": "base",
    "RankObservation": "base",
    "RankPlacement": "base",
    "Runtime": "base",
    "RuntimePermanentError": "base",
    "RuntimeTemporaryError": "base",
    "iter_log_chunks": "base",
    "parse_inventory": "inventory",
    "GangProcess": "local",
    "LocalRuntime": "local",
    "iter_trap_events": "trap_events",
    "iter_trap_events_in_chunks": "trap_events",
}

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
    "iter_log_chunks",
    "iter_trap_events",
    "iter_trap_events_in_chunks",
    "parse_inventory",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
