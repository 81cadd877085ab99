"""Whether the database has every migration applied, asked before a command
that needs its tables, so the answer is one line that says what to run
rather than an `OperationalError: no such table` after minutes of work."""

from __future__ import annotations

from django.core.management.base import CommandError
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor


def pending_migrations(alias: str = DEFAULT_DB_ALIAS) -> tuple[list[str], bool]:
    """The migrations not yet applied to the database, as "app.name", and
    whether any migration was ever applied to it."""
    executor = MigrationExecutor(connections[alias])
    targets = executor.loader.graph.leaf_nodes()
    pending = [
        f"{migration.app_label}.{migration.name}"
        for migration, _ in executor.migration_plan(targets)
    ]
    return pending, bool(executor.loader.applied_migrations)


def require_migrated_database(
    *, command: str, instead: str = "", alias: str = DEFAULT_DB_ALIAS
) -> None:
    """Raise a one-line CommandError naming what to run when migrations are
    pending; `instead` names a way to run the command without the database."""
    pending, ever = pending_migrations(alias)
    if not pending:
        return
    where = f"{connections[alias].vendor} {connections[alias].settings_dict['NAME']}"
    state = f"lacks {len(pending)} migrations" if ever else "was never migrated"
    raise CommandError(
        f"The database ({where}) {state}: run `python manage.py migrate` first, "
        f"then `python manage.py {command}` again{instead}."
    )
