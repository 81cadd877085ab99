"""One rank's log must not take down the worker or the API, however much it writes.

Tried as a hostile researcher would: a rank that prints hundreds of MiB keeps a log of
its cap (head, a line saying what was cut, tail) on the local runtime; the ingestion at
an attempt's end reads a log of any length within a fixed memory budget; and a tail of
the logs API, or the rank log page, reads only the end of a huge log. Real processes,
real files; the memory and the bytes read are measured, not timed.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from preemption.models import Attempt, Job, TrapEvent
from preemption.reconcile.logs import ingest_logs
from preemption.runtime import use_runtime
from preemption.runtimes import (
    GangId,
    GangSpec,
    LocalRuntime,
    RankPlacement,
    iter_trap_events,
    iter_trap_events_in_chunks,
    parse_inventory,
)
from preemption.runtimes.capped_log import CappedLog, LogCap, cut_line
from preemption.runtimes.records import RANK_LOG
from preemption.runtimes.runner import RunnerAccount
from tests import builders
from tests.conftest import PASSWORD
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(180)

MIB = 1 << 20
INVENTORY = "node-a:h100-80gb:8"
CUT = re.compile(
    rb"quartermaster: (\d+) bytes of this log were cut here "
    rb"\(the log keeps its first 1 MiB and last 1 MiB\)\n"
)


def event_line(name: str, attempt: Attempt, **fields: Any) -> bytes:
    """One trap event as the trap prints it."""
    event = {"event": name, "attempt": attempt.number, "rank": 0, "at": time.time(), **fields}
    return b"QM_EVENT " + json.dumps(event).encode() + b"\n"


def one_rank_attempt(world: Any) -> tuple[Job, Attempt]:
    job = builders.job(world, world.vision, ranks=1)
    attempt = builders.attempt(job)
    builders.ranks(attempt)
    return job, attempt


def stored_events(job: Job) -> list[str]:
    return list(TrapEvent.objects.filter(job=job).order_by("at").values_list("event", flat=True))


def bytes_read_by_this_process() -> int:
    """What this process has read through read(2) and its kin so far, as the kernel
    counts it, from the page cache or a disk alike (and a sparse file's holes too)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("/proc/self/io has no rchar")


# --- the cap on the local runtime: a real rank writes 300 MiB ---------------------------


@pytest.fixture
def capped_runtime(runner_tmp_path: Path, runner_account: RunnerAccount) -> Iterator[LocalRuntime]:
    local = LocalRuntime(
        runner_tmp_path / "runs",
        parse_inventory(INVENTORY),
        runner=runner_account,
        log_cap=LogCap(head_bytes=1 * MIB, tail_bytes=1 * MIB),
    )
    yield local
    for gang in {GangId(o.job_id, o.attempt) for o in local.observe()}:
        local.kill(gang)
        wait_until(lambda gang=gang: not local.gang_processes(gang), what="teardown")


def test_a_rank_that_writes_300_mib_keeps_a_capped_log_with_its_head_tail_and_events(
    world: Any, capped_runtime: LocalRuntime, runner_tmp_path: Path
) -> None:
    job, attempt = one_rank_attempt(world)
    head = b"first line of the rank\n" + event_line("trap_ready", attempt)
    block = b"".join(b"%09d the middle of a long log\n" % n for n in range(MIB // 38))
    tail = (
        event_line("checkpoint_skipped", attempt, step=7)
        + event_line("exiting", attempt, code=0)
        + b"last line of the rank\n"
    )
    blocks = 300 * MIB // len(block) + 1
    for name, content in (("head", head), ("block", block), ("tail", tail)):
        (runner_tmp_path / name).write_bytes(content)
    (runner_tmp_path / "flood.py").write_text(
        "import sys\n"
        "out = sys.stdout.buffer\n"
        f"folder = {str(runner_tmp_path)!r}\n"
        "out.write(open(folder + '/head', 'rb').read())\n"
        "block = open(folder + '/block', 'rb').read()\n"
        f"for _ in range({blocks}):\n"
        "    out.write(block)\n"
        "out.write(open(folder + '/tail', 'rb').read())\n"
    )
    spec = GangSpec(
        job_id=job.pk,
        attempt=attempt.number,
        command=f"{shlex.quote(sys.executable)} {shlex.quote(str(runner_tmp_path / 'flood.py'))}",
        ranks=(RankPlacement(rank=0, node="node-a", local_rank=0),),
        gpus_per_rank=1,
        grace_seconds=10.0,
        priority_class="ai-batch-preemptible",
        env={},
        team="vision",
        flavor="h100-80gb",
    )
    capped_runtime.launch(spec)
    wait_until(
        lambda: capped_runtime.observe(spec.gang)[0].phase == "exited",
        what="the rank to exit",
        timeout=120,
    )
    assert capped_runtime.observe(spec.gang)[0].exit_code == 0

    written = len(head) + blocks * len(block) + len(tail)
    assert written > 300 * MIB
    log = (capped_runtime.gang_dir(spec.gang) / "0" / RANK_LOG).read_bytes()
    cuts = CUT.findall(log)
    assert len(cuts) == 1, log[:300]
    note = CUT.search(log)
    assert note is not None
    # No bigger than the cap plus the cut line, and the cut line says exactly how much
    # of what the rank wrote is not there.
    assert len(log) <= 2 * MIB + len(note.group(0))
    assert int(cuts[0]) == written - (len(log) - len(note.group(0)))
    assert log.startswith(head)
    assert log.endswith(tail)
    # Cut between whole lines: the head ends and the tail starts a line.
    assert log[note.start() - 1 : note.start()] == b"\n"
    assert re.match(rb"\d{9} the middle", log[note.end() :])

    assert ingest_logs(job, attempt, attempt.rank_set.all(), capped_runtime) == 3
    assert stored_events(job) == ["trap_ready", "checkpoint_skipped", "exiting"]


def test_a_capped_log_cut_many_times_keeps_exactly_the_first_and_last_whole_lines(
    tmp_path: Path,
) -> None:
    cap = LogCap(head_bytes=64 << 10, tail_bytes=64 << 10)
    lines = [b"line %d %s\n" % (n, b"x" * (n % 97)) for n in range(120_000)]
    output = b"".join(lines)
    log = CappedLog(tmp_path / "rank.log", cap)
    # Written in pieces of every size, lines split across them, as a pipe hands them over.
    position, sizes = 0, [1, 7, 4096, 65_537, 300_001]
    while position < len(output):
        size = sizes[position % len(sizes)]
        log.write(output[position : position + size])
        position += size
    log.close()

    kept = (tmp_path / "rank.log").read_bytes()
    head = whole_lines_within(lines, cap.head_bytes)
    tail = whole_lines_within(lines[::-1], cap.tail_bytes, reverse=True)
    assert log.cut_bytes == len(output) - len(head) - len(tail)
    assert kept == head + cut_line(log.cut_bytes, cap) + tail
    assert b"the log keeps its first 64 KiB and last 64 KiB" in kept


def whole_lines_within(lines: list[bytes], budget: int, *, reverse: bool = False) -> bytes:
    """The most of `lines`, from the first on, whose length adds up to `budget` at most
    (joined in their order in the log when `lines` is reversed)."""
    taken: list[bytes] = []
    for line in lines:
        budget -= len(line)
        if budget < 0:
            break
        taken.append(line)
    return b"".join(taken[::-1] if reverse else taken)


# --- the ingestion at an attempt's end: a fixed memory budget --------------------------


def test_ingesting_a_200_mb_log_stays_within_a_fixed_memory_budget_and_finds_its_last_event(
    world: Any, tmp_path: Path
) -> None:
    job, attempt = one_rank_attempt(world)
    runtime = LocalRuntime(tmp_path / "runs", parse_inventory(INVENTORY))
    rank_dir = runtime.gang_dir(GangId(job.pk, attempt.number)) / "0"
    rank_dir.mkdir(parents=True)
    block = b"".join(b"%09d the middle of a long log\n" % n for n in range(MIB // 38))
    with open(rank_dir / RANK_LOG, "wb") as log:
        log.write(event_line("trap_ready", attempt))
        for _ in range(200 * 1000 * 1000 // len(block) + 1):
            log.write(block)
        # One absurdly long line, which the reader must skip rather than hold.
        log.write(b"QM_EVENT " + b"{" * (16 * MIB))
        log.write(b"\n")
        # The last event, its line not even ended.
        log.write(event_line("exiting", attempt, code=3).rstrip(b"\n"))
    assert (rank_dir / RANK_LOG).stat().st_size > 200 * 1000 * 1000

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        added = ingest_logs(job, attempt, attempt.rank_set.all(), runtime)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert added == 2
    assert stored_events(job) == ["trap_ready", "exiting"]
    assert TrapEvent.objects.get(job=job, event="exiting").payload["code"] == 3
    # The whole log in memory would be 216 MB; a chunk and a line are a few MiB.
    assert peak - before < 32 * MIB, f"peak {(peak - before) / MIB:.1f} MiB"


def test_the_stream_finds_the_same_events_wherever_its_chunks_are_cut() -> None:
    log = (
        b'QM_EVENT {"event": "trap_ready", "rank": 0, "at": 1.0}\r\n'
        b"progress 10%\rprogress 90%\r"
        b'noise QM_EVENT {"event": "exiting", "code": 0, "rank": 0, "at": 2.0}\n'
        b"QM_EVENT {not json\n"
        b'QM_EVENT {"event": "resumed", "step": 3, "rank": 0, "at": 3.0}'
    )
    whole = list(iter_trap_events(log))
    assert [event["event"] for event in whole] == ["trap_ready", "exiting", "resumed"]
    for size in range(1, len(log) + 1):
        chunks = (log[start : start + size] for start in range(0, len(log), size))
        assert list(iter_trap_events_in_chunks(chunks)) == whole, size


def test_a_line_without_end_is_skipped_within_a_bounded_buffer() -> None:
    chunk = b"y" * MIB
    event = b'QM_EVENT {"event": "exiting", "code": 0, "rank": 0, "at": 2.0}\n'

    def endless_line() -> Iterator[bytes]:
        yield b"QM_EVENT {"
        # The same chunk object each time: what the reader allocates is its own.
        for _ in range(256):
            yield chunk
        yield b"}\n" + event

    tracemalloc.start()
    try:
        events = list(iter_trap_events_in_chunks(endless_line(), max_line_bytes=MIB))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The 256 MiB line is dropped whole, and the event after it is found.
    assert events == [{"event": "exiting", "code": 0, "rank": 0, "at": 2.0}]
    assert peak < 8 * MIB, f"peak {peak / MIB:.1f} MiB"


# --- the logs API and the rank log page read only the end of a huge log -----------------


@pytest.fixture
def huge_log(world: Any, tmp_path: Path) -> Iterator[tuple[Job, Attempt, int, bytes]]:
    """A 4 GiB rank log, sparse but for a unique line at its very end."""
    job, attempt = one_rank_attempt(world)
    runtime = LocalRuntime(tmp_path / "runs", parse_inventory(INVENTORY))
    rank_dir = runtime.gang_dir(GangId(job.pk, attempt.number)) / "0"
    rank_dir.mkdir(parents=True)
    marker = b"the very last line %d\n" % time.time_ns()
    size = 4 << 30
    with open(rank_dir / RANK_LOG, "wb") as log:
        log.seek(size - len(marker))
        log.write(marker)
    use_runtime(runtime)
    try:
        yield job, attempt, size, marker
    finally:
        use_runtime(None)


def test_a_tail_of_the_logs_api_reads_the_end_of_a_4_gib_log_only(
    world: Any, huge_log: tuple[Job, Attempt, int, bytes]
) -> None:
    job, _, size, marker = huge_log
    client = world.client("researcher")
    client.get(f"/api/v1/jobs/{job.pk}/logs/?rank=0&tail=1")  # imports, caches, sessions

    before = bytes_read_by_this_process()
    answer = client.get(f"/api/v1/jobs/{job.pk}/logs/?rank=0&tail=64")
    read = bytes_read_by_this_process() - before

    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert body["text"].encode().endswith(marker)
    assert (body["offset"], body["next_offset"]) == (size - 64, size)
    assert read < 4 * MIB, f"read {read} bytes of a {size}-byte log"


def test_the_rank_log_page_reads_one_chunk_of_a_4_gib_log(
    world: Any, huge_log: tuple[Job, Attempt, int, bytes]
) -> None:
    job, attempt, size, marker = huge_log
    browser = Client()
    assert browser.login(username="researcher", password=PASSWORD)
    page = reverse("rank-log", args=[job.pk, attempt.number, 0])
    browser.get(page)  # imports, templates, sessions

    for query, ending in ((f"?offset={size - 200}&raw=1", marker), ("", None)):
        before = bytes_read_by_this_process()
        answer = browser.get(page + query)
        read = bytes_read_by_this_process() - before
        assert answer.status_code == 200
        if ending is not None:
            assert answer.content.endswith(ending)
            assert answer["X-Next-Offset"] == str(size)
        assert read < 4 * MIB, f"read {read} bytes of a {size}-byte log for {query!r}"


def test_the_logs_api_is_held_to_the_api_rate_of_its_user(
    world: Any, huge_log: tuple[Job, Attempt, int, bytes], settings: Any
) -> None:
    # Each read is bounded now, and the API's per-user rate bounds how many there are:
    # the logs endpoint has no exemption of its own.
    settings.QM_API_RATE_USER = "3/minute"
    job = huge_log[0]
    client = world.client("researcher")
    answers = [client.get(f"/api/v1/jobs/{job.pk}/logs/?rank=0&tail=64") for _ in range(4)]

    assert [answer.status_code for answer in answers] == [200, 200, 200, 429]
    assert int(answers[-1]["Retry-After"]) > 0
    # Another user's allowance is their own.
    assert (
        world.client("admin").get(f"/api/v1/jobs/{job.pk}/logs/?rank=0&tail=64").status_code == 200
    )
