"""The database entry the embedded default's `sqlite:///` URL turns into."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from core.env import SQLITE_ENGINE, parse_database_url


def test_the_embedded_sqlite_database_keeps_connections_and_queues_writers() -> None:
    entry = parse_database_url("DATABASE_URL", "sqlite:////srv/qm/quartermaster.sqlite3")
    assert entry["NAME"] == "/srv/qm/quartermaster.sqlite3"
    assert entry["ENGINE"] == SQLITE_ENGINE == "core.sqlite_turns"
    # A connection per request would be opened (and its PRAGMAs run) on every
    # API call; each thread and worker keeps its own for a minute instead.
    assert entry["CONN_MAX_AGE"] == 60
    options = entry["OPTIONS"]
    assert "PRAGMA journal_mode=WAL" in options["init_command"]
    assert options["transaction_mode"] == "IMMEDIATE"
    assert options["timeout"] == 30


def test_a_sqlite_url_without_a_file_is_refused() -> None:
    with pytest.raises(ImproperlyConfigured, match="names no SQLite file"):
        parse_database_url("DATABASE_URL", "sqlite:///")
