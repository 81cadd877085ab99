"""Read the trap's `QM_EVENT {json}` lines back out of a rank's log.

After a rank exits, the control plane ingests these lines so that no event is lost when the
trap's POST to the portal was. The parser is runtime-agnostic: it takes the log's bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from gracetrap_protocol import EVENT_PREFIX

EVENT_MARKER = EVENT_PREFIX.encode()


def iter_trap_events(log_bytes: bytes) -> Iterator[dict[str, Any]]:
    """Yield each trap event found in a rank log, in log order.

    An event is a line holding `QM_EVENT ` followed by one JSON object with an "event"
    key. The marker may follow other text on the same line, since output of other
    processes sharing the log can precede it without a newline. Lines that do not parse,
    including a last line cut short while the rank is still writing it, are skipped.
    """
    decoder = json.JSONDecoder()
    for line in log_bytes.splitlines():
        start = line.find(EVENT_MARKER)
        if start < 0:
            continue
        text = line[start + len(EVENT_MARKER) :].decode("utf-8", errors="replace").strip()
        try:
            event, end = decoder.raw_decode(text)
        except json.JSONDecodeError:
            continue
        if text[end:].strip() or not isinstance(event, dict) or "event" not in event:
            continue
        yield event
