"""The telemetry page's window when none is chosen: back to the first sample of
the charted teams, at least an hour and at most a day, so a new cluster fills
the chart; and a long window is drawn from at most CHART_MOMENTS moments."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from telemetry.history_selectors import CHART_MOMENTS
from telemetry.models import UtilizationSample
from tests.portal.pages.conftest import page_client

pytestmark = pytest.mark.django_db


def _figure(body: str, name: str = "utilization") -> dict[str, Any]:
    payload = re.search(rf'id="figure-{name}">(.*?)</script>', body, re.S)
    assert payload
    return dict(json.loads(payload[1]))


def _window(body: str) -> tuple[datetime, datetime]:
    """The time axis of both utilization charts, which must agree."""
    ranges = {
        tuple(_figure(body, name)["layout"]["xaxis"]["range"])
        for name in ("utilization", "borrowed")
    }
    assert len(ranges) == 1, ranges
    start, end = ranges.pop()
    return datetime.fromisoformat(start), datetime.fromisoformat(end)


def _samples(world: Any, team: Any, *, first: datetime, every: timedelta, until: datetime) -> None:
    rows = []
    at = first
    while at <= until:
        rows.append(
            UtilizationSample(
                at=at, team=team, flavor=world.h100, used=3, guarantee=8, borrowed=0, capacity=24
            )
        )
        at += every
    UtilizationSample.objects.bulk_create(rows, batch_size=2000)


@pytest.mark.parametrize(
    ("first_ago", "span"),
    [
        pytest.param(timedelta(minutes=10), timedelta(hours=1), id="ten-minutes-shows-an-hour"),
        pytest.param(timedelta(hours=5), timedelta(hours=5), id="five-hours-shows-five"),
        pytest.param(timedelta(days=3), timedelta(hours=24), id="three-days-shows-a-day"),
    ],
)
def test_the_default_window_reaches_back_to_the_first_sample(
    world: Any, first_ago: timedelta, span: timedelta
) -> None:
    now = timezone.now()
    first = (now - first_ago).replace(microsecond=0)
    _samples(world, world.vision, first=first, every=timedelta(minutes=10), until=now)
    before = timezone.now()
    body = page_client(world, "researcher").get(reverse("telemetry")).content.decode()
    after = timezone.now()
    since, until = _window(body)
    assert before <= until <= after
    if span == first_ago:
        # The window starts at the first sample itself.
        assert since == first
    else:
        assert until - since == span
    assert '<option value="auto" selected>since sampling began (1 to 24 hours)</option>' in body
    # Every sample in the window is drawn, the first one included.
    used = next(t for t in _figure(body)["data"] if t["name"] == "vision used")
    assert datetime.fromisoformat(used["x"][0]) >= since
    assert len(used["x"]) == UtilizationSample.objects.filter(at__gte=since).count()


def test_a_cluster_without_samples_shows_the_last_hour(world: Any) -> None:
    body = page_client(world, "researcher").get(reverse("telemetry")).content.decode()
    # The charts say there is nothing to draw; the period says which hour it looked at.
    assert "No utilization samples in this period yet." in body
    shown = re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d) – (\d{4}-\d\d-\d\d \d\d:\d\d) UTC", body)
    assert shown
    since, until = (datetime.strptime(value, "%Y-%m-%d %H:%M") for value in shown.groups())
    assert until - since == timedelta(hours=1)


def test_another_teams_older_samples_do_not_widen_the_readers_window(world: Any) -> None:
    now = timezone.now()
    ops_first = (now - timedelta(hours=20)).replace(microsecond=0)
    _samples(world, world.ops, first=ops_first, every=timedelta(hours=1), until=now)
    first = (now - timedelta(hours=2)).replace(microsecond=0)
    _samples(world, world.vision, first=first, every=timedelta(minutes=30), until=now)
    researcher = page_client(world, "researcher").get(reverse("telemetry")).content.decode()
    assert _window(researcher)[0] == first
    # ops's manager sees ops's own first sample, 20 hours back.
    other = page_client(world, "other_manager").get(reverse("telemetry")).content.decode()
    assert _window(other)[0] == ops_first


def test_a_chosen_period_still_wins_and_the_csv_follows_the_default(world: Any) -> None:
    now = timezone.now()
    first = (now - timedelta(hours=3)).replace(microsecond=0)
    _samples(world, world.vision, first=first, every=timedelta(minutes=30), until=now)
    client = page_client(world, "researcher")
    since, until = _window(client.get(reverse("telemetry"), {"period": "7d"}).content.decode())
    assert until - since == timedelta(days=7)
    csv = client.get(reverse("gpu-hours-csv"), {"period": "auto"})
    name = re.search(r'filename="gpu-hours-(\d{8}T\d{4})-', csv["Content-Disposition"])
    assert name and name[1] == f"{first:%Y%m%dT%H%M}"


def test_a_long_window_is_drawn_from_at_most_chart_moments_moments(world: Any) -> None:
    now = timezone.now().replace(microsecond=0)
    # A sample every 15 s for 20 hours: 4,801 moments of two teams.
    first = now - timedelta(hours=20)
    _samples(world, world.vision, first=first, every=timedelta(seconds=15), until=now)
    _samples(world, world.nlp, first=first, every=timedelta(seconds=15), until=now)
    body = page_client(world, "manager").get(reverse("telemetry")).content.decode()
    traces = {t["name"]: t for t in _figure(body)["data"]}
    vision, nlp = traces["vision used"], traces["nlp used"]
    assert 0.9 * CHART_MOMENTS <= len(vision["x"]) <= CHART_MOMENTS
    # Both stacked series are drawn at the same moments, and the newest is kept.
    assert vision["x"] == nlp["x"]
    assert datetime.fromisoformat(vision["x"][-1]) == now
    assert set(vision["y"]) == {3}
