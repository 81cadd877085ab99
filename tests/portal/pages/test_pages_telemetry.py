"""The telemetry page charts the chosen team, leaves included, over the whole
chosen period; a team the reader cannot see is never charted."""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

import pytest
from django.urls import reverse

from tests.portal.pages.conftest import page_client, seed_samples

pytestmark = pytest.mark.django_db


def _utilization(body: str) -> dict[str, Any]:
    payload = re.search(r'id="figure-utilization">(.*?)</script>', body, re.S)
    assert payload
    return dict(json.loads(payload[1]))


def _used_traces(figure: dict[str, Any]) -> dict[str, list[int]]:
    return {
        trace["name"]: trace["y"] for trace in figure["data"] if trace["name"].endswith(" used")
    }


def test_a_leaf_team_can_be_charted_alone(world: Any) -> None:
    seed_samples(world, points=3)
    client = page_client(world, "manager")
    default = _used_traces(_utilization(client.get(reverse("telemetry")).content.decode()))
    assert set(default) == {"vision used", "nlp used"}
    body = client.get(reverse("telemetry"), {"team": "nlp"}).content.decode()
    assert '<option value="nlp" selected>nlp</option>' in body
    # nlp uses 2 less than vision's 4, 5, 6.
    assert _used_traces(_utilization(body)) == {"nlp used": [2, 3, 4]}


def test_another_tenants_team_is_neither_offered_nor_charted(world: Any) -> None:
    seed_samples(world, points=3)
    body = page_client(world, "manager").get(reverse("telemetry"), {"team": "ops"}).content.decode()
    assert 'value="ops"' not in body
    assert set(_used_traces(_utilization(body))) == {"vision used", "nlp used"}


@pytest.mark.parametrize(("period", "hours"), [("1h", 1), ("24h", 24), ("7d", 168)])
def test_the_chosen_period_is_the_charts_time_axis(world: Any, period: str, hours: int) -> None:
    seed_samples(world, points=3)
    body = (
        page_client(world, "manager").get(reverse("telemetry"), {"period": period}).content.decode()
    )
    for name in ("utilization", "borrowed"):
        payload = re.search(rf'id="figure-{name}">(.*?)</script>', body, re.S)
        assert payload
        start, end = json.loads(payload[1])["layout"]["xaxis"]["range"]
        span = datetime.fromisoformat(end) - datetime.fromisoformat(start)
        assert span.total_seconds() == hours * 3600, name
