"""One list of trap event names: gracetrap's documented protocol (its README's
table), the trap's own reporter and the portal's ingestion all use
`gracetrap_protocol.EVENT_NAMES`."""

from __future__ import annotations

import re
import time
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


def _refusal(attempt: Any, name: str) -> dict[str, list[str]]:
    event = {"event": name, "attempt": 1, "rank": 0, "at": time.time(), "step": 1}
    try:
        ingest.ingest_trap_event(attempt=attempt, event=event, source="post")
    except ValidationError as error:
        return error.message_dict
    return {}


@pytest.mark.django_db
def test_ingestion_knows_every_name_of_the_protocol_and_refuses_others(world: Any) -> None:
    attempt = builders.running_job(world, world.vision, rank_fields={}).attempts.get()
    # Every documented name passes the name rule (other fields have rules of their own).
    for name in EVENT_NAMES:
        assert "event" not in _refusal(attempt, name), name
    stored = TrapEvent.objects.count()
    refused = _refusal(attempt, "checkpoint_dreamt")
    assert "checkpoint_dreamt" in refused["event"][0]
    assert TrapEvent.objects.count() == stored
