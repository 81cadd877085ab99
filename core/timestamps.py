"""PostgreSQL's timestamps read with Python's own ISO 8601 parser.

Django reads every timestamptz through a subclass of psycopg's pure-Python
TimestamptzLoader, to give each value its own time zone object, so psycopg's C
loader never runs for them: each value goes through a regular expression and a
few calls, about 4 us. Python 3.11's ``datetime.fromisoformat`` (in C) reads
PostgreSQL's ISO output, "+00" offset included, in 0.1 us. A reconcile pass that
reads a few thousand attempts, jobs, ranks and stops whole reads tens of thousands
of timestamps (27,584 in the first pass of bench/bench_cycle.py, 0.15 s of it).
psycopg's C loader cannot be subclassed and Django has no setting for its loader,
so this one is written here: it does what Django's does (the value read, with
Django's time zone object put in place of the session's, which is the same zone)
and leaves what ``fromisoformat`` cannot read (infinity, a date BC, another
DateStyle) to psycopg's loader, as before.

`use_iso_loader` registers it on each new PostgreSQL connection (Django's
``connection_created`` signal, connected by the portal's app config). Django
registers a loader of its own on a cursor only when the connection's does not
carry its time zone, which this one does.
"""

from __future__ import annotations

from datetime import datetime, tzinfo
from functools import cache
from typing import Any

from psycopg.types.datetime import TimestamptzLoader


class IsoTimestamptzLoader(TimestamptzLoader):
    """A timestamptz as ``fromisoformat`` reads it, in ``timezone`` (None: naive)."""

    timezone: tzinfo | None = None

    def load(self, data: Any) -> datetime:
        try:
            value = datetime.fromisoformat(bytes(data).decode())
        except ValueError:
            value = super().load(data)
        return value.replace(tzinfo=self.timezone)


@cache
def loader_for(zone: tzinfo | None) -> type[IsoTimestamptzLoader]:
    """The loader class for Django's time zone ``zone`` (one class per zone)."""
    return type("IsoTimestamptzLoaderIn", (IsoTimestamptzLoader,), {"timezone": zone})


def use_iso_loader(sender: Any, connection: Any, **kwargs: Any) -> None:
    """``connection_created`` receiver: read the new connection's timestamps with
    `IsoTimestamptzLoader` in the connection's time zone (PostgreSQL only)."""
    if connection.vendor != "postgresql":
        return
    connection.connection.adapters.register_loader("timestamptz", loader_for(connection.timezone))
