"""The jobs table as CSV, for spreadsheets and scripts (as `sacct --parsable` is).

Rows come from a queryset the caller has already scoped to the reader and
passed through `job_table`, so the export holds exactly the filtered list the
page shows, every page of it, and nothing of a team the reader cannot see.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from datetime import timedelta

from django.db.models import QuerySet
from django.http import StreamingHttpResponse

from preemption.models import Job

JOB_CSV_COLUMNS = [
    "id",
    "name",
    "team",
    "submitter",
    "priority_class",
    "flavor",
    "ranks",
    # An elastic job's least size, and the only sizes it runs at where it names them
    # (separated by spaces); both empty for a job of a fixed size.
    "ranks_min",
    "rank_sizes",
    "gpus_per_rank",
    "state",
    "submitted_at",
    "finished_at",
    "duration_seconds",
    "gpu_hours",
    "command",
]


def _cell(value: str) -> str:
    """A text cell that a spreadsheet would read as a formula (=, +, -, @) is
    prefixed with a quote, so a job's name cannot run in the reader's sheet."""
    return "'" + value if value[:1] in ("=", "+", "-", "@", "\t", "\r") else value


def _seconds(value: timedelta | None) -> str:
    return "" if value is None else f"{value.total_seconds():.0f}"


def _hours(value: timedelta | None) -> str:
    return "" if value is None else f"{value.total_seconds() / 3600:.3f}"


class _Echo:
    """The file-like object csv.writer writes to, handing each line back."""

    def write(self, value: str) -> str:
        return value


def job_csv_lines(jobs: QuerySet[Job]) -> Iterator[str]:
    writer = csv.writer(_Echo())
    yield writer.writerow(JOB_CSV_COLUMNS)
    for job in jobs.iterator(chunk_size=500):
        yield writer.writerow(
            [
                job.pk,
                _cell(job.name),
                job.team.slug,
                job.submitter.username,
                job.priority_class.name,
                job.flavor.name,
                job.ranks,
                "" if job.ranks_min is None else job.ranks_min,
                " ".join(str(size) for size in job.rank_sizes),
                job.gpus_per_rank,
                job.state,
                job.submitted_at.isoformat(),
                job.finished_at.isoformat() if job.finished_at else "",
                _seconds(getattr(job, "run_time", None)),
                _hours(getattr(job, "gpu_time", None)),
                _cell(job.command),
            ]
        )


def job_csv_response(jobs: QuerySet[Job]) -> StreamingHttpResponse:
    """Streamed, so a history of many thousands of jobs never sits in memory."""
    response = StreamingHttpResponse(job_csv_lines(jobs), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = 'attachment; filename="jobs.csv"'
    return response
