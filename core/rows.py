"""Writing many rows, each with values of its own, in one statement.

Django's `QuerySet.bulk_update` writes each field as a CASE expression with one
WHEN per row. Its cost grows with the square of the rows, on both sides: Django
builds and compiles an expression per row and field, and the database matches
every row against every WHEN. In a reconcile pass over 450 gangs that had just
ended, writing their ranks' new state took 0.35-0.55 s this way, while the exits
listener held those jobs and every job behind them waited for their GPUs.

`update_rows` joins the table with the new values instead: on PostgreSQL one
array per column, unnested (`UPDATE ... FROM unnest(...)`), on SQLite a VALUES
list (`UPDATE ... FROM (VALUES ...)`, since 3.33): the same 450 rows take about
25 ms. On PostgreSQL the arrays keep the statement a few parameters long however
many rows it writes: with one parameter per value, the driver's rewriting of the
statement's placeholders took longer than PostgreSQL's work (0.6 s of a reconcile
pass that wrote 3,000 ranks). Django offers no such statement, and no well-kept
library adds one for both databases, so it is written here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

from django.db import connections, router
from django.db.models import Field, Model

M = TypeVar("M", bound=Model)

# Rows per statement: with a handful of fields, far below SQLite's 32,766
# parameters and small enough for PostgreSQL to plan at once.
BATCH = 500
# Rows per statement on PostgreSQL, where each column's values go as one array.
ARRAY_BATCH = 10_000


def row_values(model: type[M], pk: object, **values: object) -> M:
    """An instance of `model` that holds its primary key and `values` (by attribute
    name) and nothing else, to hand to `update_rows`, which reads no other field.
    It is built without the model's `__init__`, which sets every field through its
    descriptor and looks up each default: about 10 us a row, 50 ms of the reconcile
    pass that records 3,000 ranks' and 1,920 stops' signals (this takes 0.5 us)."""
    obj = model.__new__(model)
    obj.__dict__[model._meta.pk.attname] = pk  # type: ignore[union-attr]
    obj.__dict__.update(values)
    return obj


def update_rows(
    objs: Sequence[Model],
    fields: Sequence[str],
    *,
    batch_size: int | None = None,
    only: Mapping[str, Sequence[object]] | None = None,
) -> int:
    """Write `fields` of each of `objs` (instances of one model, saved before) as
    each holds them, by primary key, as `bulk_update` does; the rows matched.
    `batch_size` rows go in each statement (by default BATCH on SQLite, ARRAY_BATCH
    on PostgreSQL).

    With `only` ({field: values}), a row is written only while each of those fields
    holds one of its values, tested as the row is written (a job still waiting, say,
    and not one cancelled since its values were computed)."""
    if not objs or not fields:
        return 0
    model = type(objs[0])
    if any(type(obj) is not model for obj in objs):
        raise TypeError("update_rows writes the rows of one model at a time")
    meta = model._meta
    pk = meta.pk
    assert pk is not None
    columns = [meta.get_field(name) for name in fields]
    for column in columns:
        if not isinstance(column, Field) or not column.concrete or column.primary_key:
            raise ValueError(f"{meta.label}.{column.name} is not a column update_rows can write")
    conditions = [(meta.get_field(name), list(values)) for name, values in (only or {}).items()]
    for column, values in conditions:
        if not isinstance(column, Field) or not column.concrete or not values:
            raise ValueError(f"{meta.label}.{column.name} cannot restrict the rows written")
    connection = connections[router.db_for_write(model)]
    quote = connection.ops.quote_name
    every = [pk, *columns]
    table = quote(meta.db_table)
    if connection.vendor == "postgresql":
        # A VALUES list takes its columns' types from what it holds: an untyped
        # parameter, or a column of NULLs, would be text to PostgreSQL.
        row = "(" + ", ".join(f"%s::{field.db_type(connection)}" for field in every) + ")"
        alias = "v (" + ", ".join(quote(field.column) for field in every) + ")"
        name = [f"v.{quote(field.column)}" for field in every]
    else:
        # SQLite names a VALUES list's columns column1, column2, ... and takes no
        # list of names after its alias.
        row = "(" + ", ".join("%s" for _ in every) + ")"
        alias = "v"
        name = [f"v.column{i}" for i in range(1, len(every) + 1)]
    sets = ", ".join(
        f"{quote(field.column)} = {value}" for field, value in zip(columns, name[1:], strict=True)
    )
    where = "".join(
        f" AND {table}.{quote(column.column)} IN ({', '.join(['%s'] * len(values))})"
        for column, values in conditions
    )
    where_params = [
        column.get_db_prep_value(value, connection)
        for column, values in conditions
        for value in values
    ]
    matched = 0
    if connection.vendor == "postgresql":
        arrays = ", ".join(f"%s::{field.db_type(connection)}[]" for field in every)
        statement = (
            f"UPDATE {table} SET {sets} FROM unnest({arrays}) AS {alias} "
            f"WHERE {table}.{quote(pk.column)} = {name[0]}{where}"
        )
        with connection.cursor() as cursor:
            step = batch_size or ARRAY_BATCH
            for start in range(0, len(objs), step):
                batch = objs[start : start + step]
                values = [[pk.get_db_prep_value(obj.pk, connection) for obj in batch]]
                values.extend(
                    [
                        field.get_db_prep_save(getattr(obj, field.attname), connection)
                        for obj in batch
                    ]
                    for field in columns
                )
                cursor.execute(statement, values + where_params)
                matched += cursor.rowcount
        return matched
    step = batch_size or BATCH
    with connection.cursor() as cursor:
        for start in range(0, len(objs), step):
            batch = objs[start : start + step]
            params: list[object] = []
            for obj in batch:
                params.append(pk.get_db_prep_value(obj.pk, connection))
                params.extend(
                    field.get_db_prep_save(getattr(obj, field.attname), connection)
                    for field in columns
                )
            # The statement starts with UPDATE, not WITH: Python's sqlite3 counts
            # the rows changed only for a statement it sees to be an UPDATE.
            cursor.execute(
                f"UPDATE {table} SET {sets} "
                f"FROM (VALUES {', '.join([row] * len(batch))}) AS {alias} "
                f"WHERE {table}.{quote(pk.column)} = {name[0]}{where}",
                params + where_params,
            )
            matched += cursor.rowcount
    return matched
