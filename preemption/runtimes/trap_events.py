"""Read the trap's `QM_EVENT {json}` lines back out of a rank's log.

After a rank exits, the control plane ingests these lines so that no event is lost when the
trap's POST to the portal was. The parser is runtime-agnostic: it takes the log's bytes, or
the log as a stream of chunks (`iter_trap_events_in_chunks`), which is how a log of any
length is read within a fixed memory budget: one chunk and one line at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from gracetrap_protocol import EVENT_PREFIX

EVENT_MARKER = EVENT_PREFIX.encode()
# The longest line the stream parser holds while it waits for the line's end. A trap
# event is a few hundred bytes; a longer line is not one, and is skipped unread rather
# than buffered, however long it grows.
MAX_EVENT_LINE_BYTES = 1 << 20
LINE_ENDS = (b"\n", b"\r")


def iter_trap_events(log_bytes: bytes) -> Iterator[dict[str, Any]]:
    """Yield each trap event found in a rank log, in log order.

    An event is a line holding `QM_EVENT ` followed by one JSON object with an "event"
    key. The marker may follow other text on the same line, since output of other
    processes sharing the log can precede it without a newline. Lines that do not parse,
    including a last line cut short while the rank is still writing it, are skipped.
    """
    return iter_trap_events_in_chunks((log_bytes,))


def iter_trap_events_in_chunks(
    chunks: Iterable[bytes], *, max_line_bytes: int = MAX_EVENT_LINE_BYTES
) -> Iterator[dict[str, Any]]:
    """`iter_trap_events` over a log given as consecutive chunks, holding at most one
    chunk and one partial line (up to `max_line_bytes`) at a time."""
    decoder = json.JSONDecoder()
    for line in iter_marked_lines(chunks, EVENT_MARKER, max_line_bytes=max_line_bytes):
        start = line.find(EVENT_MARKER)
        text = line[start + len(EVENT_MARKER) :].decode("utf-8", errors="replace").strip()
        try:
            event, end = decoder.raw_decode(text)
        except json.JSONDecodeError:
            continue
        if text[end:].strip() or not isinstance(event, dict) or "event" not in event:
            continue
        yield event


def iter_marked_lines(
    chunks: Iterable[bytes], marker: bytes, *, max_line_bytes: int
) -> Iterator[bytes]:
    """The lines of a stream of chunks that contain `marker`, without their line ends.

    Lines end as `bytes.splitlines` ends them (\\n, \\r or \\r\\n), and the last line
    counts even without an end. A line is carried from one chunk to the next until it
    ends; one that grows past `max_line_bytes` is dropped up to its end, so a single
    absurdly long line costs a bounded buffer, not its length. Chunks without the
    marker are only searched for their last line end, never split.
    """
    carried = b""
    skipping = False  # inside a line already longer than max_line_bytes
    for chunk in chunks:
        if not chunk:
            continue
        if skipping:
            end = _first_line_end(chunk)
            if end < 0:
                continue
            chunk, skipping = chunk[end + 1 :], False
        buffer = carried + chunk if carried else chunk
        # A \r at the very end may be the first half of \r\n: keep it with the partial line.
        end = max(buffer.rfind(b"\n"), buffer.rfind(b"\r", 0, len(buffer) - 1))
        complete, carried = buffer[: end + 1], buffer[end + 1 :]
        if marker in complete:
            yield from (line for line in complete.splitlines() if marker in line)
        if len(carried) > max_line_bytes:
            carried, skipping = b"", True
    if carried and marker in carried:
        yield from (line for line in carried.splitlines() if marker in line)


def _first_line_end(chunk: bytes) -> int:
    ends = [found for found in (chunk.find(end) for end in LINE_ENDS) if found >= 0]
    return min(ends, default=-1)
