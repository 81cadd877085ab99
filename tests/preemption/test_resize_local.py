"""Resizing an elastic gang on the local runtime, with real rank processes, real
signals and gloo on CPU (examples/train_elastic.py): a reclaim shrinks a gang of 8
ranks to 4 at a step its ranks agree on, the job is relaunched at once at 4 ranks on
GPUs it had, and the reclaiming job starts on the GPUs it gave up; when the reclaimer
ends the gang grows back to 8. The resizes are told on the job's API, its page,
`qm show` (a real subprocess against a live server) and the team's webhook, and every
sample of every epoch is trained on exactly once across the three sizes. With the
class's flag off, the same reclaim evicts the whole gang, as before.

The world: org/ml/{vision,nlp} and other/ops, 3 nodes × 8 h100 GPUs; vision and nlp
are guaranteed 8 each, ops 8. nlp runs a job on one node and ops a job of its class
`critical` (not preemptible) on another, so ops's elastic gang runs on GPUs it
borrowed from org, on the third node, and vision reclaims them."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest

from drills.measure import stop_reached
from portal.services import api_token_create
from preemption.logs import read_rank_log
from preemption.models import (
    Attempt,
    Job,
    JobState,
    PreemptionEvent,
    Rank,
    TrapEvent,
    Webhook,
)
from preemption.services import job_cancel, job_submit
from preemption.webhooks import deliver_due
from tests.preemption.conftest import PYTHON, ROOT, sleeper_command, state_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(600)]

DATASET_LEN = 480
EPOCHS = 2
GLOBAL_BATCH = 24
ELASTIC = (
    'echo "GPUS=$CUDA_VISIBLE_DEVICES"; exec '
    f"{PYTHON} {shlex.quote(str(ROOT / 'examples' / 'train_elastic.py'))} "
    f"--epochs {EPOCHS} --dataset-len {DATASET_LEN} --global-batch {GLOBAL_BATCH} "
    "--micro-batch 3 --hidden 8 --seed 3 --step-sleep 0.3"
)


@pytest.fixture
def webhook_receiver(settings: Any) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A real HTTP server on loopback that keeps every notice it is sent."""
    received: list[dict[str, Any]] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append({"event": self.headers["X-Quartermaster-Event"], **json.loads(body)})
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            return

    settings.QM_WEBHOOK_ALLOW_NETS = ["127.0.0.1/32"]
    server = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/hook", received
    finally:
        server.shutdown()


def submit(world: Any, team: Any, **fields: Any) -> Job:
    fields.setdefault("priority_class", world.batch)
    return job_submit(submitter=world.users["researcher"], team=team, flavor=world.h100, **fields)


def fill_two_nodes(world: Any, drive: Any) -> None:
    """nlp's job on one node, ops's critical one on another, both running."""
    blockers = [
        submit(world, world.nlp, ranks=1, gpus_per_rank=8, command=sleeper_command(600)),
        submit(
            world,
            world.ops,
            ranks=1,
            gpus_per_rank=8,
            command=sleeper_command(600),
            priority_class=world.critical,
        ),
    ]
    drive(
        lambda: all(state_of(job) == JobState.RUNNING for job in blockers),
        what="the two blockers to run",
    )


def elastic_gang(world: Any, drive: Any) -> tuple[Job, str]:
    """ops's elastic gang of 8 ranks (it may run at 4), training on the third node."""
    fill_two_nodes(world, drive)
    elastic = submit(
        world, world.ops, ranks=8, ranks_min=4, rank_sizes=[4, 8], gpus_per_rank=1, command=ELASTIC
    )
    drive(lambda: steps_logged(elastic, 1) >= 3, what="the gang of 8 to train", timeout=180)
    first = Attempt.objects.get(job=elastic, number=1)
    assert (first.ranks, first.borrowed_gpus) == (8, 8)
    [entry] = first.placement
    return elastic, entry["node"]


def rank_log(job: Job, attempt: int, rank: int) -> str:
    chunk, _ = read_rank_log(job=job, attempt=attempt, rank=rank, offset=0, limit=1 << 22)
    return chunk.decode()


def steps_logged(job: Job, attempt: int) -> int:
    if not Rank.objects.filter(attempt__job=job, attempt__number=attempt, pid__isnull=False):
        return 0
    return sum(1 for line in rank_log(job, attempt, 0).splitlines() if line.startswith("STEP "))


def gpus_seen(job: Job, attempt: int, size: int) -> list[str]:
    """The GPU indices each rank of the attempt was given (CUDA_VISIBLE_DEVICES)."""
    return [
        re.search(r"^GPUS=(.*)$", rank_log(job, attempt, rank), re.MULTILINE).group(1)  # type: ignore[union-attr]
        for rank in range(size)
    ]


def resize_of(job: Job, attempt: int) -> PreemptionEvent:
    return PreemptionEvent.objects.get(job=job, victim_attempt__number=attempt)


def samples_by_epoch(
    job: Job, attempt: int, size: int, last_step: int | None
) -> dict[int, list[int]]:
    """The sample ids the attempt's ranks trained on, by epoch, up to `last_step` (the
    step its stop checkpointed; the steps after it are done again by the next attempt)."""
    seen: dict[int, list[int]] = defaultdict(list)
    for rank in range(size):
        for line in rank_log(job, attempt, rank).splitlines():
            match = re.match(r"^SAMPLES (\d+) EPOCH (\d+) WORLD (\d+) IDS ([\d,]*)$", line)
            if match is None or (last_step is not None and int(match.group(1)) > last_step):
                continue
            assert int(match.group(3)) == size
            seen[int(match.group(2))] += [int(i) for i in match.group(4).split(",") if i]
    return seen


def test_a_reclaim_shrinks_the_gang_which_is_relaunched_at_once_and_grows_back(
    world: Any,
    drive: Any,
    settings: Any,
    live_server: Any,
    webhook_receiver: tuple[str, list[dict[str, Any]]],
) -> None:
    # A gang grows back as soon as its team has room, not a minute later.
    settings.QM_FAIR_SHARE_MIN_RUNTIME_SECONDS = 0
    world.batch.shrink_elastic = True
    world.batch.save(update_fields=["shrink_elastic"])
    url, received = webhook_receiver
    Webhook.objects.create(team=world.ops, url=url, events=["resized"])
    elastic, node = elastic_gang(world, drive)

    owner = submit(world, world.vision, ranks=4, gpus_per_rank=1, command=sleeper_command(600))
    drive(lambda: PreemptionEvent.objects.filter(job=elastic).exists(), what="the shrink")
    shrink = resize_of(elastic, 1)
    assert (shrink.reason, shrink.resize_ranks, shrink.preemptor_id) == ("resize", 4, owner.pk)
    assert shrink.resize_placement == [{"node": node, "ranks": 4}]
    assert shrink.cause == (
        f"shrunk from 8 to 4 ranks to reclaim team vision's guarantee for job {owner.pk}"
    )
    # A resize is no preemption of the whole gang, and takes nothing else.
    assert not PreemptionEvent.objects.exclude(pk=shrink.pk).exists()

    drive(lambda: state_of(owner) == JobState.RUNNING, what="the reclaimer to run")
    drive(lambda: steps_logged(elastic, 2) >= 3, what="the gang of 4 to train", timeout=180)
    shrink.refresh_from_db()
    first, second = Attempt.objects.filter(job=elastic).order_by("number")
    # Every one of the 8 ranks was signalled, learned of the stop, and exited 0 at the
    # step they agreed on, whose checkpoint was committed before any exited. A rank
    # learns of it by its own SIGTERM, or first from the gang's relay or the agreed
    # step's save when another rank's signal was handled before its own (a loaded
    # machine schedules the ranks' handlers in any order).
    ranks = list(Rank.objects.filter(attempt=first).order_by("index"))
    assert len(ranks) == 8
    assert all(rank.signal_sent_at is not None for rank in ranks)

    def told() -> list[int]:
        # The trap's events come by POST, or from the log once the rank has gone.
        return sorted(
            stop_reached(
                TrapEvent.objects.filter(job=elastic, attempt=first.number),
                decided=shrink.decided_at.timestamp(),
                agreed_step=shrink.checkpoint_step,
            )
        )

    drive(lambda: told() == list(range(8)), what="every rank's word of the stop", timeout=60)
    assert any(rank.signal_received_at is not None for rank in ranks)
    assert [rank.exit_code for rank in ranks] == [0] * 8
    assert (shrink.outcome, shrink.lost_gpu_seconds) == ("graceful", 0.0)
    assert shrink.checkpoint_step is not None and shrink.resume_step == shrink.checkpoint_step + 1
    assert first.end_reason == Attempt.EndReason.RESIZED
    # The job was relaunched at once, as its next attempt, never waiting in the queue:
    # admitted as its old ranks' exits were closed, at 4 ranks on the same node, on 4
    # of the GPUs it had, with half its borrowed GPUs given back.
    assert shrink.requeued_at is None
    assert second.admitted_at >= shrink.all_exited_at
    assert (second.ranks, second.placement, second.borrowed_gpus) == (
        4,
        [{"node": node, "ranks": 4}],
        4,
    )
    before, after = gpus_seen(elastic, 1, 8), gpus_seen(elastic, 2, 4)
    assert set(after) <= set(before) and len(set(after)) == 4
    # Each of its ranks was told the new size and resumed at the step after the checkpoint.
    for rank in range(4):
        assert f"RESUMED {shrink.resume_step} WORLD 4 " in rank_log(elastic, 2, rank)
    # The reclaimer started on the 4 GPUs the shrink freed, once they were free.
    [owner_attempt] = Attempt.objects.filter(job=owner)
    assert owner_attempt.placement == [{"node": node, "ranks": 4}]
    assert owner_attempt.admitted_at >= shrink.all_exited_at

    # When the reclaimer ends, the gang grows back to 8 on the GPUs it gave up.
    job_cancel(actor=None, job=owner)
    drive(lambda: steps_logged(elastic, 3) >= 1, what="the gang to grow back", timeout=180)
    grow = resize_of(elastic, 2)
    assert (grow.reason, grow.cause, grow.preemptor_id) == (
        "resize",
        "grown from 4 to 8 ranks",
        None,
    )
    third = Attempt.objects.get(job=elastic, number=3)
    assert (third.ranks, third.placement) == (8, [{"node": node, "ranks": 8}])
    assert Attempt.objects.get(pk=second.pk).end_reason == Attempt.EndReason.RESIZED
    drive(lambda: state_of(elastic) == JobState.SUCCEEDED, what="the gang to finish", timeout=180)

    # Each relaunch resumed at the step after its resize's checkpoint, as its trap
    # reported (the reports of a rank's log are read as its attempt ends).
    shrink.refresh_from_db()
    grow.refresh_from_db()
    # What the ranks of the grown-from attempt reported, should the grow's checkpoint be
    # missing (seen once, on a machine loaded far beyond its cores).
    reported = list(
        TrapEvent.objects.filter(job=elastic, attempt=2).values_list("rank", "event", "step", "at")
    )
    assert grow.checkpoint_step is not None, (grow.outcome, grow.decided_at, reported)
    assert grow.resume_step == grow.checkpoint_step + 1
    for number, resize in ((2, shrink), (3, grow)):
        resumed = TrapEvent.objects.filter(job=elastic, attempt=number, event="resumed")
        assert {event.step for event in resumed} == {resize.resume_step}
        assert resize.resumed_at is not None

    # Across the three sizes every sample of each epoch was trained on exactly once.
    seen: dict[int, Counter[int]] = defaultdict(Counter)
    for number, size, last in (
        (1, 8, shrink.checkpoint_step),
        (2, 4, grow.checkpoint_step),
        (3, 8, None),
    ):
        for epoch, ids in samples_by_epoch(elastic, number, size, last).items():
            seen[epoch].update(ids)
    assert sorted(seen) == list(range(EPOCHS))
    for epoch in range(EPOCHS):
        assert seen[epoch] == Counter(range(DATASET_LEN)), f"epoch {epoch}"

    # The API tells both resizes, on the job and on each attempt.
    detail = world.client("admin").get(f"/api/v1/jobs/{elastic.pk}/").json()
    assert [
        (r["attempt_number"], r["relaunched_as"], r["from_ranks"], r["to_ranks"], r["for_job"])
        for r in detail["resizes"]
    ] == [(1, 2, 8, 4, owner.pk), (2, 3, 4, 8, None)]
    assert detail["resizes"][0]["why"] == shrink.cause
    assert detail["resizes"][0]["checkpoint_step"] == shrink.checkpoint_step
    assert [
        (a["number"], a["world_size"], a["end_reason"], a["preempted_because"])
        for a in detail["attempts"]
    ] == [
        (1, 8, "resized", None),
        (2, 4, "resized", None),
        (3, 8, "succeeded", None),
    ]
    assert [a["resized_because"] for a in detail["attempts"]] == [
        shrink.cause,
        "grown from 4 to 8 ranks",
        None,
    ]
    # No preemption is listed for it.
    listed = world.client("admin").get("/api/v1/preemption-events/", {"job": elastic.pk}).json()
    assert listed["results"] == []

    # The job page tells each resize as its own story.
    page = world.client("admin")
    page.force_login(world.users["admin"])
    html = " ".join(page.get(f"/jobs/{elastic.pk}/").content.decode().split())
    assert "Resize of attempt 1" in html and "8 → 4 ranks" in html
    assert "Shrunk from 8 to 4 ranks to reclaim team vision" in html
    assert "Relaunched at 4 ranks" in html and "Relaunched at 8 ranks" in html

    # `qm show`, a real subprocess against the live server.
    _, token = api_token_create(user=world.users["admin"], name="ci")
    shown = subprocess.run(
        [sys.executable, "-m", "qmcli", "show", str(elastic.pk)],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            "PATH": os.environ["PATH"],
            "PYTHONPATH": str(ROOT),
            "HOME": str(ROOT / "var" / "no-home"),
            "QM_URL": live_server.url,
            "QM_TOKEN": token,
        },
    )
    assert shown.returncode == 0, shown.stderr
    assert (
        f"Resized: {shrink.cause} (decided {shrink.decided_at.isoformat()[:19].replace('T', ' ')}, "
        f"checkpoint at step {shrink.checkpoint_step}, outcome graceful, "
        "relaunched as attempt 2 at 4 ranks)"
    ) in shown.stdout
    assert "Resized: grown from 4 to 8 ranks (" in shown.stdout
    assert "Preempted:" not in shown.stdout

    # The team's webhook was told of each resize as it was decided and as it relaunched.
    deliver_due()
    resized = [
        (r["stage"], r["from_ranks"], r["to_ranks"]) for r in received if r["event"] == "resized"
    ]
    assert resized == [
        ("decided", 8, 4),
        ("relaunched", 8, 4),
        ("decided", 4, 8),
        ("relaunched", 4, 8),
    ]
    relaunched = next(r for r in received if r.get("stage") == "relaunched")
    assert (relaunched["job"]["id"], relaunched["attempt"], relaunched["resume_step"]) == (
        elastic.pk,
        2,
        shrink.resume_step,
    )
    assert relaunched["cause"] == shrink.cause


def test_with_the_flag_off_a_reclaim_evicts_the_whole_gang(world: Any, drive: Any) -> None:
    elastic, node = elastic_gang(world, drive)
    owner = submit(world, world.vision, ranks=4, gpus_per_rank=1, command=sleeper_command(600))
    drive(lambda: state_of(owner) == JobState.RUNNING, what="the reclaimer to run")
    stop = PreemptionEvent.objects.get(job=elastic)
    assert (stop.reason, stop.preemptor_id, stop.resize_ranks) == ("reclaim", owner.pk, None)
    assert Attempt.objects.get(job=owner).placement == [{"node": node, "ranks": 4}]
    assert (stop.outcome, stop.requeued_at is not None) == ("graceful", True)
    first = Attempt.objects.get(job=elastic, number=1)
    assert first.end_reason == Attempt.EndReason.PREEMPTED
    assert [rank.exit_code for rank in Rank.objects.filter(attempt=first)] == [0] * 8
    # All 8 GPUs were given up; the job waits in the queue for GPUs, at whatever size.
    elastic.refresh_from_db()
    assert elastic.state in (JobState.REQUEUED, JobState.ADMITTED, JobState.RUNNING)
    assert not Attempt.objects.filter(
        job=elastic, number=2, admitted_at__lt=stop.requeued_at
    ).exists()
