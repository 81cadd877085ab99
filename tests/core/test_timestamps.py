"""PostgreSQL's timestamps are read by core.timestamps' loader, to the same values,
time zone objects and errors as Django's own loader gives (this module runs in the
suite's PostgreSQL run; SQLite reads no timestamptz)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import DataError, connection
from psycopg.pq import Format

from core.timestamps import IsoTimestamptzLoader
from preemption.models import Job
from tests import builders

pytestmark = pytest.mark.django_db


def read(text: str) -> datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT %s::timestamptz", [text])
        value: datetime = cursor.fetchone()[0]
    return value


def test_every_postgresql_connection_reads_timestamps_with_the_iso_loader() -> None:
    assert connection.vendor == "postgresql"
    connection.ensure_connection()
    oid = connection.connection.adapters.types["timestamptz"].oid
    loader = connection.connection.adapters.get_loader(oid, Format.TEXT)
    assert issubclass(loader, IsoTimestamptzLoader)
    assert loader.timezone is connection.timezone


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-12-07 19:08:17.123456+00", datetime(2026, 12, 7, 19, 8, 17, 123456, tzinfo=UTC)),
        ("2026-12-07 19:08:17+00", datetime(2026, 12, 7, 19, 8, 17, tzinfo=UTC)),
        # Another offset in, the session's zone (UTC) out, as PostgreSQL writes it.
        ("2026-12-07 21:08:17.5+02:00", datetime(2026, 12, 7, 19, 8, 17, 500000, tzinfo=UTC)),
        ("1899-12-31 23:59:59.000001+00", datetime(1899, 12, 31, 23, 59, 59, 1, tzinfo=UTC)),
        ("0001-01-01 00:00:00+00", datetime(1, 1, 1, tzinfo=UTC)),
    ],
)
def test_a_timestamp_reads_as_the_same_aware_datetime_in_djangos_zone(
    text: str, expected: datetime
) -> None:
    value = read(text)
    assert value == expected
    assert value.tzinfo is connection.timezone
    assert value.utcoffset() == timedelta(0)


@pytest.mark.parametrize("text", ["infinity", "0044-03-15 12:00:00+00 BC"])
def test_what_python_cannot_hold_fails_as_with_psycopgs_loader(text: str) -> None:
    with pytest.raises(DataError):
        read(text)


def test_a_model_field_round_trips(world: object) -> None:
    job = builders.job(world, world.vision)  # type: ignore[attr-defined]
    moment = datetime(2026, 12, 7, 19, 8, 17, 654321, tzinfo=UTC)
    Job.objects.filter(pk=job.pk).update(submitted_at=moment)
    assert Job.objects.get(pk=job.pk).submitted_at == moment
    assert Job.objects.values_list("submitted_at", flat=True).get(pk=job.pk) == moment
