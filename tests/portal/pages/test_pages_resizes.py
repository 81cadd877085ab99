"""The telemetry page shows resizes of elastic jobs beside the preemptions: how
often each team's jobs were preempted, shrunk or grown, the work each resize lost
and the seconds until its GPUs were free. Each persona sees only the teams they
may read, and a cluster with no resize says so. Figures by hand in
tests/telemetry/resize_history.py."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.urls import reverse

from tests.portal.pages.conftest import page_client
from tests.telemetry.resize_history import Resizes, seed_resizes

pytestmark = pytest.mark.django_db


def _figure(body: str, name: str) -> dict[str, Any]:
    payload = re.search(rf'id="figure-{name}">(.*?)</script>', body, re.S)
    assert payload, name
    return dict(json.loads(payload[1]))


def _bars(figure: dict[str, Any]) -> dict[str, dict[str, float]]:
    return {
        trace["name"]: dict(zip(trace["x"], trace["y"], strict=True))
        for trace in figure["data"]
        if trace["type"] == "bar"
    }


def _page(world: Any, persona: str) -> str:
    response = page_client(world, persona).get(reverse("telemetry"))
    assert response.status_code == 200
    return response.content.decode()


def _label(job: Any, attempt: int) -> str:
    return f"job {job.pk} · attempt {attempt}"


def _vision(history: Resizes) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """What vision's readers see: (work lost, seconds to free) per resize."""
    lost = {
        "shrunk": {_label(history.wide, 1): 32.0, _label(history.narrow, 1): 20.5},
        "grown": {_label(history.wide, 2): 0.0},
    }
    free = {
        "shrunk": {_label(history.wide, 1): 6.0, _label(history.narrow, 1): 65.0},
        "grown": {_label(history.wide, 2): 12.5},
    }
    return lost, free


def test_an_admin_sees_every_teams_stops_and_resizes(world: Any) -> None:
    history = seed_resizes(world)
    body = _page(world, "admin")
    assert _bars(_figure(body, "stops")) == {
        "preempted": {"ops": 1, "vision": 0},
        "shrunk": {"ops": 1, "vision": 2},
        "grown": {"ops": 0, "vision": 1},
    }
    lost, free = _vision(history)
    # ops's shrink is still stopping: in the count above, in neither chart below.
    assert _bars(_figure(body, "resize-lost-work")) == lost
    assert _bars(_figure(body, "resize-free-time")) == free


@pytest.mark.parametrize("persona", ["researcher", "manager"])
def test_vision_readers_see_vision_only(world: Any, persona: str) -> None:
    history = seed_resizes(world)
    body = _page(world, persona)
    assert _bars(_figure(body, "stops")) == {
        "preempted": {"vision": 0},
        "shrunk": {"vision": 2},
        "grown": {"vision": 1},
    }
    lost, free = _vision(history)
    assert _bars(_figure(body, "resize-lost-work")) == lost
    assert _bars(_figure(body, "resize-free-time")) == free


def test_an_ops_reader_sees_its_shrink_still_stopping(world: Any) -> None:
    seed_resizes(world)
    body = _page(world, "other_researcher")
    assert _bars(_figure(body, "stops")) == {
        "preempted": {"ops": 1},
        "shrunk": {"ops": 1},
        "grown": {"ops": 0},
    }
    for name in ("resize-lost-work", "resize-free-time"):
        figure = _figure(body, name)
        assert figure["data"] == []
        assert figure["layout"]["annotations"][0]["text"] == "No resize has finished stopping yet."


def test_no_resize_no_preemption_each_chart_says_so(world: Any) -> None:
    body = _page(world, "admin")
    stops = _figure(body, "stops")
    assert stops["data"] == []
    assert stops["layout"]["annotations"][0]["text"] == "No job has been preempted or resized yet."
    for name in ("resize-lost-work", "resize-free-time"):
        figure = _figure(body, name)
        assert figure["data"] == []
        assert figure["layout"]["annotations"][0]["text"] == "No job has been resized yet."
