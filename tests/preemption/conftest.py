"""Fixtures for end-to-end tests of the local runtime: a LocalRuntime rooted in
a temporary folder, and `drive`, which runs the scheduling cycle and the
reconciler in this process until a condition holds; and `mimic`, the mimic
runtime rooted in a temporary folder that is also the control plane's QM_VAR_DIR."""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from preemption.cycle import schedule_cycle
from preemption.models import Job, JobState, Rank
from preemption.reconcile import reconcile_jobs
from preemption.reconcile.steps import gang_spec
from preemption.runtime import inventory, use_runtime
from preemption.runtimes import GangId, LocalRuntime
from preemption.runtimes.mimic import MimicRuntime
from preemption.runtimes.runner import RunnerAccount
from tests import builders

ROOT = Path(__file__).resolve().parents[2]
PYTHON = shlex.quote(sys.executable)


def train_command(
    steps: int, *, step_sleep: float = 0.05, save_every: int = 0, extra: str = ""
) -> str:
    return (
        f"{PYTHON} {shlex.quote(str(ROOT / 'examples' / 'train_ddp.py'))} --steps {steps} "
        f"--step-sleep {step_sleep} --save-every {save_every} {extra}"
    ).strip()


def sleeper_command(seconds: float, *, exit_code: int = 0) -> str:
    return f"{PYTHON} {shlex.quote(str(ROOT / 'examples' / 'sleeper.py'))} --seconds {seconds} --exit-code {exit_code}"


def ignore_sigterm_command() -> str:
    return f"{PYTHON} {shlex.quote(str(ROOT / 'examples' / 'ignore_sigterm.py'))}"


@pytest.fixture
def local_runtime(
    world: Any, runner_tmp_path: Path, runner_account: RunnerAccount, settings: Any
) -> Iterator[LocalRuntime]:
    """Ranks run as the runner user, as in an installation run by root."""
    settings.QM_RUNS_DIR = runner_tmp_path / "runs"
    settings.QM_CHECKPOINTS_DIR = runner_tmp_path / "checkpoints"
    settings.QM_RETRY_BACKOFF_SECONDS = 0.5
    runtime = LocalRuntime(
        root=runner_tmp_path / "runs", inventory=inventory(), runner=runner_account
    )
    use_runtime(runtime)
    try:
        yield runtime
    finally:
        use_runtime(None)
        for observation in runtime.observe(None):
            if observation.phase not in ("exited", "lost"):
                runtime.kill(GangId(observation.job_id, observation.attempt))


Drive = Callable[..., None]


@pytest.fixture
def drive(local_runtime: LocalRuntime) -> Drive:
    def run(
        condition: Callable[[], bool], *, timeout: float = 120.0, what: str = "the condition"
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reconcile_jobs(runtime=local_runtime)
            schedule_cycle()
            if condition():
                return
            time.sleep(0.1)
        states = list(Job.objects.values_list("id", "name", "state", "waiting_reason"))
        raise AssertionError(f"timed out after {timeout} s waiting for {what}; jobs: {states}")

    return run


def state_of(job: Job) -> str:
    return Job.objects.values_list("state", flat=True).get(pk=job.pk)


@pytest.fixture
def mimic(world: Any, tmp_path: Path, settings: Any) -> Iterator[MimicRuntime]:
    settings.VAR_DIR = tmp_path
    runtime = MimicRuntime(tmp_path / "mimic", inventory())
    use_runtime(runtime)
    try:
        yield runtime
    finally:
        use_runtime(None)


def launched(
    world: Any, mimic: MimicRuntime, *, ranks: int = 2, state: str = JobState.RUNNING
) -> Job:
    """A job of `ranks` ranks whose gang the mimic runtime runs and whose ranks are
    recorded as starting."""
    job = builders.job(world, world.vision, state=state, ranks=ranks)
    attempt = builders.attempt(job, launched_at=timezone.now())
    mimic.launch(gang_spec(job, attempt, builders.ranks(attempt, state=Rank.State.STARTING)))
    return job
