"""/metrics counts resizes of elastic gangs beside the preemptions, never among
them: resizes and the work they lost by team and direction, and a histogram per
direction of the seconds from the decision until every rank had exited. Exact
lines, on real rows (figures by hand in tests/telemetry/resize_history.py), for
each persona's scope."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from telemetry.metrics import RESIZE_FREE_BUCKETS
from tests.telemetry.resize_history import seed_resizes

pytestmark = pytest.mark.django_db


def _scrape(world: Any, persona: str) -> str:
    client = Client()
    client.force_login(world.users[persona])
    response = client.get(reverse("metrics"))
    assert response.status_code == 200
    return response.content.decode()


def _family(text: str, name: str) -> list[str]:
    """The family's sample lines, in the order written."""
    return [
        line for line in text.splitlines() if re.match(rf"{name}(_bucket|_sum|_count)?[{{ ]", line)
    ]


def _histogram(direction: str, observed: list[int], total: str) -> list[str]:
    """The lines of one direction's histogram: cumulative counts at each edge."""
    lines = [
        f'qm_resize_free_seconds_bucket{{direction="{direction}",le="{bound:g}"}} {count}'
        for bound, count in zip(RESIZE_FREE_BUCKETS, observed, strict=True)
    ]
    count = observed[-1]
    return [
        *lines,
        f'qm_resize_free_seconds_bucket{{direction="{direction}",le="+Inf"}} {count}',
        f'qm_resize_free_seconds_sum{{direction="{direction}"}} {total}',
        f'qm_resize_free_seconds_count{{direction="{direction}"}} {count}',
    ]


# Edges:                  1  2.5 5  10 20 30 60 90 120 300
VISION_SHRINKS_FREE = [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]  # 6 s and 65 s
VISION_GROWS_FREE = [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]  # 12.5 s
NONE_FREE = [0] * 10


def test_an_admin_sees_every_teams_resizes_by_direction(world: Any) -> None:
    seed_resizes(world)
    text = _scrape(world, "admin")
    assert "# TYPE qm_resizes_total counter" in text
    assert _family(text, "qm_resizes_total") == [
        'qm_resizes_total{team="ops",direction="shrink"} 1',
        'qm_resizes_total{team="vision",direction="grow"} 1',
        'qm_resizes_total{team="vision",direction="shrink"} 2',
    ]
    assert "# TYPE qm_resize_lost_gpu_seconds_total counter" in text
    assert _family(text, "qm_resize_lost_gpu_seconds_total") == [
        # ops's shrink is still stopping: it has lost nothing known yet.
        'qm_resize_lost_gpu_seconds_total{team="ops",direction="shrink"} 0',
        'qm_resize_lost_gpu_seconds_total{team="vision",direction="grow"} 0',
        'qm_resize_lost_gpu_seconds_total{team="vision",direction="shrink"} 52.5',
    ]
    assert "# TYPE qm_resize_free_seconds histogram" in text
    assert _family(text, "qm_resize_free_seconds") == [
        *_histogram("shrink", VISION_SHRINKS_FREE, "71"),
        *_histogram("grow", VISION_GROWS_FREE, "12.5"),
    ]
    # A resize is no preemption: the preemption counter holds the one reclaim only.
    assert _family(text, "qm_preemptions_total") == [
        'qm_preemptions_total{reason="reclaim",outcome="graceful"} 1'
    ]


@pytest.mark.parametrize("persona", ["researcher", "manager"])
def test_vision_readers_see_vision_resizes_only(world: Any, persona: str) -> None:
    seed_resizes(world)
    text = _scrape(world, persona)
    assert _family(text, "qm_resizes_total") == [
        'qm_resizes_total{team="vision",direction="grow"} 1',
        'qm_resizes_total{team="vision",direction="shrink"} 2',
    ]
    assert _family(text, "qm_resize_lost_gpu_seconds_total") == [
        'qm_resize_lost_gpu_seconds_total{team="vision",direction="grow"} 0',
        'qm_resize_lost_gpu_seconds_total{team="vision",direction="shrink"} 52.5',
    ]
    assert _family(text, "qm_resize_free_seconds") == [
        *_histogram("shrink", VISION_SHRINKS_FREE, "71"),
        *_histogram("grow", VISION_GROWS_FREE, "12.5"),
    ]


def test_an_ops_researcher_sees_its_one_shrink_still_stopping(world: Any) -> None:
    seed_resizes(world)
    text = _scrape(world, "other_researcher")
    # The shrink of ops's finisher, whose gang ended before the stop reached it,
    # resized nothing and is not counted.
    assert _family(text, "qm_resizes_total") == [
        'qm_resizes_total{team="ops",direction="shrink"} 1'
    ]
    assert _family(text, "qm_resize_lost_gpu_seconds_total") == [
        'qm_resize_lost_gpu_seconds_total{team="ops",direction="shrink"} 0'
    ]
    assert _family(text, "qm_resize_free_seconds") == [
        *_histogram("shrink", NONE_FREE, "0"),
        *_histogram("grow", NONE_FREE, "0"),
    ]


def test_no_resize_announces_the_families_with_empty_histograms(world: Any) -> None:
    text = _scrape(world, "admin")
    assert "# HELP qm_resizes_total Resizes of elastic jobs by team and direction" in text
    assert _family(text, "qm_resizes_total") == []
    assert _family(text, "qm_resize_lost_gpu_seconds_total") == []
    assert _family(text, "qm_resize_free_seconds") == [
        *_histogram("shrink", NONE_FREE, "0"),
        *_histogram("grow", NONE_FREE, "0"),
    ]
