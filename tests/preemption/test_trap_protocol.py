"""One list of trap event names: gracetrap's documented protocol (its README's
table), the trap's own reporter and the portal's ingestion all use
`gracetrap_protocol.EVENT_NAMES`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from gracetrap_protocol import EVENT_NAMES, EVENT_PREFIX

import gracetrap
from preemption import ingest
from preemption.models import TrapEvent
from preemption.runtimes import trap_events
from tests import builders

README = Path(__file__).resolve().parents[2] / "gracetrap" / "README.md"


def test_the_readme_documents_exactly_the_protocols_events() -> None:
    text = README.read_text()
    table = text[text.index("| event | extra fields | when |") :].split("\n\n", 1)[0]
    documented = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    assert documented == list(EVENT_NAMES)


def test_the_trap_and_the_portal_share_the_list_and_the_prefix() -> None:
    assert gracetrap.EVENT_NAMES is EVENT_NAMES and gracetrap.EVENT_PREFIX == EVENT_PREFIX
    assert ingest.EVENT_NAMES is EVENT_NAMES
    assert EVENT_PREFIX.encode() == trap_events.EVENT_MARKER


@pytest.mark.django_db
def test_ingestion_takes_every_name_of_the_protocol_and_refuses_others(world: Any) -> None:
    job = builders.running_job(world, world.vision, rank_fields={})
    for index, name in enumerate(EVENT_NAMES):
        event = {"event": name, "attempt": 1, "rank": 0, "at": 1_800_000_000.0 + index}
        assert ingest.ingest_trap_event(job=job, event=event, source="post")
    assert sorted(TrapEvent.objects.values_list("event", flat=True)) == sorted(EVENT_NAMES)
    unknown = {"event": "checkpoint_dreamt", "attempt": 1, "rank": 0, "at": 1_800_000_100.0}
    with pytest.raises(ValidationError) as refused:
        ingest.ingest_trap_event(job=job, event=unknown, source="post")
    assert "checkpoint_dreamt" in str(refused.value)
    assert TrapEvent.objects.count() == len(EVENT_NAMES)
