"""A rank killed past its memory limit: the job says so, on its page, in the API and in
`qm show`, in one wording (preemption.reasons.rank_end_words).

Real ranks on the sandboxed local runtime, driven by the real scheduling cycle and
reconciler in this process. The job's flavor sets a memory limit of 64 MiB per GPU
(ResourceFlavor.rank_memory_per_gpu); rank 1 holds ever more memory until the kernel's
OOM killer ends it inside its cgroup, while rank 0 waits. The gang guard stops rank 0,
and the failed job must say "rank 1 was killed: it used more than its memory limit of
64 MiB", not merely "exited with code 137".
"""

from __future__ import annotations

import shlex
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from rest_framework.test import APIClient

from preemption.cycle import schedule_cycle
from preemption.models import Job, JobState, Rank
from preemption.reconcile import reconcile_jobs
from preemption.runtime import flavor_sandbox_limits, inventory, use_runtime
from preemption.runtimes import GangId, LocalRuntime
from preemption.runtimes import sandbox as sandboxes
from preemption.runtimes.runner import RunnerAccount
from preemption.services import job_submit
from qmcli import cli

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

WORDS = "rank 1 was killed: it used more than its memory limit of 64 MiB"
SITE = sandboxes.SandboxLimits(pids_max=256, memory_max=8 << 30, file_size_max=1 << 30)

# Rank 1 holds 8 MiB more at each step, every page written, up to 1 GiB; rank 0 waits.
GREEDY = textwrap.dedent(
    """
    import os, time
    if os.environ["RANK"] != "1":
        time.sleep(60)
    held = []
    for step in range(128):
        held.append(b"x" * (8 << 20))
    print("NOT LIMITED", flush=True)
    """
)


@pytest.fixture
def runtime(
    world: Any, runner_tmp_path: Path, runner_account: RunnerAccount, settings: Any
) -> Iterator[LocalRuntime]:
    found = sandboxes.support()
    assert found.available, found.reason
    settings.QM_RUNS_DIR = runner_tmp_path / "runs"
    settings.QM_CHECKPOINTS_DIR = runner_tmp_path / "checkpoints"
    local = LocalRuntime(
        root=runner_tmp_path / "runs",
        inventory=inventory(),
        runner=runner_account,
        sandbox=sandboxes.SandboxConfig(
            mode="on", limits=SITE, flavor_limits=flavor_sandbox_limits
        ),
    )
    use_runtime(local)
    try:
        yield local
    finally:
        use_runtime(None)
        for observed in local.observe(None):
            if observed.phase not in ("exited", "lost"):
                local.kill(GangId(observed.job_id, observed.attempt))


def drive_until_failed(runtime: LocalRuntime, job: Job, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reconcile_jobs(runtime=runtime)
        schedule_cycle()
        if Job.objects.values_list("state", flat=True).get(pk=job.pk) == JobState.FAILED:
            return
        time.sleep(0.1)
    raise AssertionError(f"job {job.pk} did not fail: {Job.objects.values().get(pk=job.pk)}")


def test_a_rank_killed_past_its_memory_limit_is_said_so_everywhere(
    world: Any, runtime: LocalRuntime, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    world.h100.rank_memory_per_gpu = 64 << 20
    world.h100.save(update_fields=["rank_memory_per_gpu"])
    job = job_submit(
        submitter=world.users["researcher"],
        team=world.vision,
        flavor=world.h100,
        ranks=2,
        gpus_per_rank=1,
        command=f"{shlex.quote(sys.executable)} -c {shlex.quote(GREEDY)}",
        priority_class=world.batch,
        name="greedy",
        retries=0,
    )

    drive_until_failed(runtime, job)

    job.refresh_from_db()
    assert job.failure_reason.startswith(f"gang guard: {WORDS}"), job.failure_reason
    greedy = Rank.objects.get(attempt__job=job, index=1)
    assert (greedy.exit_code, greedy.end_reason, greedy.memory_limit) == (
        137,
        "out-of-memory",
        64 << 20,
    )
    # Rank 0 was stopped by the gang guard: it ended for no reason of its own.
    assert Rank.objects.get(attempt__job=job, index=0).end_reason == ""

    # The job page: the failure, and the rank's line in the attempt's table.
    page = Client()
    page.force_login(world.users["researcher"])
    html = page.get(f"/jobs/{job.pk}/").content.decode()
    assert f"gang guard: {WORDS}" in html
    assert f'data-field="rank-end">{WORDS}</span>' in html

    # The API: the job's failure and the rank's own field.
    api = APIClient()
    api.force_authenticate(world.users["researcher"])
    body = api.get(f"/api/v1/jobs/{job.pk}/").json()
    assert body["failure_reason"].startswith(f"gang guard: {WORDS}")
    [attempt] = body["attempts"]
    ranks = {rank["index"]: rank for rank in attempt["ranks"]}
    assert (ranks[1]["end_reason"], ranks[1]["ended_because"]) == ("out-of-memory", WORDS)
    assert ranks[1]["memory_limit"] == 64 << 20
    assert (ranks[0]["end_reason"], ranks[0]["ended_because"]) == ("", "")

    # `qm show` prints the job's failure as the API gives it.
    class Answers:
        def call(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
            response = api.generic(method, f"/api/v1/{path}")
            return response.json()

        def all_pages(self, path: str, query: dict[str, Any], limit: int = 0) -> list[Any]:
            return api.get(f"/api/v1/{path}", query).json()["results"]

    monkeypatch.setattr(cli.Client, "from_environment", staticmethod(lambda: Answers()))
    monkeypatch.setattr(cli, "_print_failed_rank_log", lambda client, job: None)
    cli.main(["show", str(job.pk)])
    shown = capsys.readouterr().out
    assert f"Failed because  gang guard: {WORDS}" in shown
