"""The reads behind the resize charts, on real rows: resizes counted beside the
preemptions by team and direction, and each resize's time to free its GPUs and
the work it lost, scoped to what each persona may read. Figures by hand in
tests/telemetry/resize_history.py."""

from __future__ import annotations

from typing import Any

import pytest

from quotas.selectors import access_for
from telemetry.preemption_selectors import StopsOfTeam, resize_stops, stops_by_team
from tests.telemetry.resize_history import seed_resizes

pytestmark = pytest.mark.django_db

OPS = StopsOfTeam(team="ops", preemptions=1, shrinks=1, grows=0)
VISION = StopsOfTeam(team="vision", preemptions=0, shrinks=2, grows=1)


@pytest.mark.parametrize(
    ("persona", "expected"),
    [
        ("admin", [OPS, VISION]),
        ("manager", [VISION]),
        ("researcher", [VISION]),
        ("other_manager", [OPS]),
        ("other_researcher", [OPS]),
    ],
)
def test_stops_count_preemptions_shrinks_and_grows_per_readable_team(
    world: Any, persona: str, expected: list[StopsOfTeam]
) -> None:
    seed_resizes(world)
    assert stops_by_team(access=access_for(world.users[persona])) == expected


def test_each_resize_in_time_order_with_its_sizes_time_to_free_and_lost_work(world: Any) -> None:
    history = seed_resizes(world)
    rows = resize_stops(access=access_for(world.users["admin"]))
    assert [
        (
            row.job_id,
            row.attempt,
            row.team,
            row.from_ranks,
            row.to_ranks,
            row.direction,
            row.seconds_to_free,
            row.lost_gpu_seconds,
        )
        for row in rows
    ] == [
        # The first attempt of `wide` has no size of its own: its job's 8 ranks.
        (history.wide.pk, 1, "vision", 8, 4, "shrink", 6.0, 32.0),
        # Still stopping: neither figure is known yet.
        (history.borrower.pk, 1, "ops", 4, 2, "shrink", None, None),
        (history.narrow.pk, 1, "vision", 2, 1, "shrink", 65.0, 20.5),
        (history.wide.pk, 2, "vision", 4, 8, "grow", 12.5, 0.0),
    ]
    assert rows[0].cause == "shrunk from 8 to 4 ranks to reclaim team ops's guarantee for job 1"
    assert rows[0].decided_at == history.decided
    assert {row.grace_seconds for row in rows} == {60.0}
    # The resize whose gang ended first resized nothing and is nowhere.
    assert history.finisher.pk not in {row.job_id for row in rows}


def test_a_researcher_reads_only_the_resizes_of_their_teams(world: Any) -> None:
    history = seed_resizes(world)
    vision = resize_stops(access=access_for(world.users["researcher"]))
    assert [(row.job_id, row.attempt) for row in vision] == [
        (history.wide.pk, 1),
        (history.narrow.pk, 1),
        (history.wide.pk, 2),
    ]
    ops = resize_stops(access=access_for(world.users["other_researcher"]))
    assert [(row.job_id, row.attempt) for row in ops] == [(history.borrower.pk, 1)]


def test_no_resize_no_rows(world: Any) -> None:
    admin = access_for(world.users["admin"])
    assert resize_stops(access=admin) == []
    assert stops_by_team(access=admin) == []
