"""The jobs table: whitelisted sorting, search, run time and GPU-hours,
the CSV of the filtered list, and paging that says where it is.

The fixture jobs have hand-set attempts, so every figure below is computed by
hand: a job of 2 ranks × 4 GPUs whose one attempt ran 90 minutes ran for
"1 h 30 min" and used 8 × 1.5 = 12.00 GPU-hours.
"""

from __future__ import annotations

import csv
import io
import re
from datetime import timedelta
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from preemption.models import Attempt, Job, JobState
from tests.portal.pages.conftest import page_client, seed_jobs

pytestmark = pytest.mark.django_db


def _job(
    world: Any, *, name: str, team: Any, submitter: str, ran_minutes: int | None, **extra: Any
) -> Job:
    job = Job.objects.create(
        name=name,
        team=team,
        submitter=world.users[submitter],
        priority_class=world.batch,
        flavor=world.h100,
        ranks=extra.pop("ranks", 2),
        gpus_per_rank=extra.pop("gpus_per_rank", 4),
        command=extra.pop("command", "python train.py"),
        state=JobState.SUCCEEDED if ran_minutes is not None else JobState.PENDING,
        **extra,
    )
    if ran_minutes is not None:
        end = timezone.now() - timedelta(minutes=1)
        Attempt.objects.create(
            job=job,
            number=1,
            admitted_at=end - timedelta(minutes=ran_minutes),
            ended_at=end,
            end_reason="succeeded",
        )
    return job


@pytest.fixture
def table(world: Any) -> dict[str, Job]:
    return {
        "long": _job(
            world, name="long-run", team=world.vision, submitter="researcher", ran_minutes=90
        ),
        "short": _job(
            world,
            name="short-run",
            team=world.vision,
            submitter="researcher",
            ran_minutes=10,
            ranks=1,
            gpus_per_rank=1,
            command="python eval.py --split test",
        ),
        "waiting": _job(
            world, name="waiting", team=world.nlp, submitter="manager", ran_minutes=None
        ),
        "outsider": _job(
            world,
            name="ops-secret",
            team=world.ops,
            submitter="other_researcher",
            ran_minutes=30,
            command="python train.py --secret",
        ),
    }


def _rows(html: str) -> list[int]:
    return [int(pk) for pk in re.findall(r'<tr data-job="(\d+)"', html)]


def test_duration_and_gpu_hours_columns(world: Any, table: dict[str, Job]) -> None:
    html = page_client(world, "researcher").get(reverse("job-list")).content.decode()
    long_row = html[html.index(f'data-job="{table["long"].pk}"') :]
    long_row = long_row[: long_row.index("</tr>")]
    assert re.search(r'data-field="duration">1 h 30 min<', long_row)
    assert re.search(r'data-field="gpu-hours">12.00<', long_row)
    short_row = html[html.index(f'data-job="{table["short"].pk}"') :]
    short_row = short_row[: short_row.index("</tr>")]
    # 10 minutes on 1 GPU: 10 / 60 = 0.17 GPU-hours.
    assert re.search(r'data-field="duration">10 min 0 s<', short_row)
    assert re.search(r'data-field="gpu-hours">0.17<', short_row)


@pytest.mark.parametrize(
    ("sort", "expected"),
    [
        ("duration", ["short", "long", "waiting"]),
        ("-duration", ["long", "short", "waiting"]),
        ("gpu_hours", ["short", "long", "waiting"]),
        # A tie (8 GPUs each) breaks by job id in the same direction: newest first.
        ("-gpus", ["waiting", "long", "short"]),
        ("name", ["long", "short", "waiting"]),
        ("team", ["waiting", "long", "short"]),
    ],
)
def test_sort_by_column(world: Any, table: dict[str, Job], sort: str, expected: list[str]) -> None:
    # The manager of ml reads vision and nlp, not ops.
    html = page_client(world, "manager").get(reverse("job-list"), {"sort": sort}).content.decode()
    assert _rows(html) == [table[name].pk for name in expected]


@pytest.mark.parametrize("sort", ["password", "submitter__password", "-", "id;drop", "__class__"])
def test_unknown_sort_key_is_ignored(world: Any, table: dict[str, Job], sort: str) -> None:
    response = page_client(world, "manager").get(reverse("job-list"), {"sort": sort})
    assert response.status_code == 200
    # The default order: newest first.
    assert _rows(response.content.decode()) == [
        table["waiting"].pk,
        table["short"].pk,
        table["long"].pk,
    ]


def test_search_matches_name_or_command(world: Any, table: dict[str, Job]) -> None:
    client = page_client(world, "manager")
    assert _rows(client.get(reverse("job-list"), {"q": "EVAL.py"}).content.decode()) == [
        table["short"].pk
    ]
    assert _rows(client.get(reverse("job-list"), {"q": "long"}).content.decode()) == [
        table["long"].pk
    ]
    # Another team's job is not found by its command either.
    assert _rows(client.get(reverse("job-list"), {"q": "secret"}).content.decode()) == []


def test_csv_holds_the_filtered_list_and_nothing_of_another_team(
    world: Any, table: dict[str, Job]
) -> None:
    response = page_client(world, "researcher").get(
        reverse("job-list"), {"format": "csv", "sort": "duration"}
    )
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert [int(row["id"]) for row in rows] == [table["short"].pk, table["long"].pk]
    assert [row["duration_seconds"] for row in rows] == ["600", "5400"]
    assert [row["gpu_hours"] for row in rows] == ["0.167", "12.000"]
    assert all(row["team"] == "vision" for row in rows)
    # Filtered as the page is: a search narrows the export too.
    filtered = page_client(world, "manager").get(
        reverse("job-list"), {"format": "csv", "q": "wait"}
    )
    ids = [
        int(row["id"])
        for row in csv.DictReader(io.StringIO(b"".join(filtered.streaming_content).decode()))
    ]
    assert ids == [table["waiting"].pk]
    # Asking for another team by name gives nothing of it.
    other = page_client(world, "researcher").get(
        reverse("job-list"), {"format": "csv", "team": "ops"}
    )
    assert b"ops-secret" not in b"".join(other.streaming_content)


def test_csv_gives_an_elastic_jobs_sizes_and_none_for_a_fixed_one(world: Any) -> None:
    fixed = _job(world, name="fixed", team=world.vision, submitter="researcher", ran_minutes=None)
    elastic = _job(
        world, name="elastic", team=world.vision, submitter="researcher", ran_minutes=None
    )
    Job.objects.filter(pk=elastic.pk).update(ranks=8, ranks_min=2, rank_sizes=[2, 4, 8])
    response = page_client(world, "researcher").get(reverse("job-list"), {"format": "csv"})
    rows = {
        int(row["id"]): row
        for row in csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode()))
    }
    assert (rows[elastic.pk]["ranks"], rows[elastic.pk]["ranks_min"]) == ("8", "2")
    assert rows[elastic.pk]["rank_sizes"] == "2 4 8"
    assert (rows[fixed.pk]["ranks_min"], rows[fixed.pk]["rank_sizes"]) == ("", "")


def test_csv_cells_never_become_formulas(world: Any) -> None:
    _job(world, name="=HYPERLINK(1)", team=world.vision, submitter="researcher", ran_minutes=None)
    response = page_client(world, "researcher").get(reverse("job-list"), {"format": "csv"})
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert [row["name"] for row in rows] == ["'=HYPERLINK(1)"]


def test_paging_says_where_it_is_and_refuses_a_page_past_the_end(world: Any) -> None:
    seed_jobs(world, 120, teams=[world.vision])
    client = page_client(world, "researcher")
    html = client.get(reverse("job-list"), {"page": "3"}).content.decode()
    assert "page 3 of 3 · jobs 101–120 of 120" in html
    assert len(_rows(html)) == 20
    missing = client.get(reverse("job-list"), {"page": "99999"})
    assert missing.status_code == 404
    assert "There is no page 99999: this list has 3 pages." in missing.content.decode()
    assert client.get(reverse("job-list"), {"page": "two"}).status_code == 404
