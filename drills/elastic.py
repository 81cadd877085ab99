"""The elastic drill (`manage.py drill --elastic`): an elastic training job is shrunk
by a reclaim instead of evicted, grown back once the owner's job is done, and checked
sample for sample against an uninterrupted run.

The borrower team runs examples/train_elastic.py at 8 ranks (any of 4 or 8) on GPUs
the owner team guarantees but leaves idle, under a class that lets the scheduler
resize its elastic jobs. At a chosen step the owner submits a critical job of half the
GPUs. The scheduler shrinks the borrower to 4 ranks (the ranks stop at an agreed step,
checkpoint and exit 0, and the job is relaunched at once at 4 ranks on GPUs it keeps)
and the critical job takes the other half. Once the shrunk gang has trained a few steps
the drill ends the critical job, and the scheduler grows the borrower back to 8 ranks
the same way. The drill then checks, from the ranks' own logs, that every step took the
same global batch as an uninterrupted 8-rank run of the same seed, that every epoch saw
every sample exactly once, and that the final loss is within LOSS_RELATIVE_TOLERANCE of
the uninterrupted run's; and it measures, for each resize, the time from the decision to
the old gang's GPUs being free, to the critical job running, and the GPU-seconds the
job's kept GPUs spent not training (decision to the resumed step).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import close_old_connections
from django.utils import timezone

from drills.base import GPUS_PER_NODE_ENV, DrillError
from drills.elastic_samples import (
    LOSS_RELATIVE_TOLERANCE,
    SampleCheck,
    TrainingRecord,
    compare_samples,
)
from drills.harness import Drill, _free_port
from preemption.logs import read_rank_log
from preemption.models import FINAL_STATES, Attempt, Job, JobState, PreemptionEvent, Rank
from preemption.services import job_cancel, job_submit
from quotas.models import PriorityClass, SchedulingPolicy
from quotas.services import priority_class_save, team_priority_classes_set

ELASTIC_CLASS = "drill-elastic"
# The training run: 240 samples, a global batch of 24 (10 steps an epoch), 3 samples a
# rank and micro-batch, so that 8 ranks take one micro-batch a step and 4 take two.
DATASET_LEN = 240
GLOBAL_BATCH = 24
MICRO_BATCH = 3
HIDDEN = 8
SEED = 7
ELASTIC_EPOCHS = 16
ELASTIC_STEP_SLEEP = 0.25
# The step the borrower has reached when the owner's critical job arrives.
SHRINK_AT_STEP = 20
# Steps the shrunk gang trains before the owner's job ends and makes room to grow.
GROW_AFTER_STEPS = 10
# The owner's job sleeps at most this long; the drill cancels it before.
CRITICAL_MAX_SECONDS = 1800
# The fair-share minimum runtime the drill's services run with (see service_settings).
DRILL_GROW_AFTER_SECONDS = 5


@dataclass(frozen=True)
class ResizeFigures:
    """One resize of the borrower, from its stop's row and the attempts around it."""

    cause: str
    from_ranks: int
    to_ranks: int
    agreed_step: int | None
    resumed_step: int | None
    exit_codes: list[int | None]
    # The decision -> the last rank of the old gang exited (its GPUs free).
    time_to_free_seconds: float | None
    # The decision -> the new attempt's ranks resumed training.
    time_to_resume_seconds: float | None
    # The decision -> the critical job's ranks running (a shrink only).
    critical_running_seconds: float | None
    # Steps the resized job ran twice: work a resize lost (0 when it stopped at the
    # agreed step and resumed from its checkpoint).
    steps_run_again: int
    # GPUs the job kept through the resize times the decision -> resumed: the training
    # the kept GPUs did not do while the gang stopped and came back.
    idle_gpu_seconds: float | None


@dataclass(frozen=True)
class ElasticDrillResult:
    """The elastic drill's figures and verdict."""

    runtime: str
    ranks: int
    min_ranks: int
    borrower_job: int
    critical_job: int
    borrower_state: str
    resizes: list[ResizeFigures]
    samples: SampleCheck
    attempts: list[dict[str, Any]]

    def missed(self) -> list[str]:
        """What the drill did not show, worded for a person; empty when it passed."""
        missed = []
        shapes = [(r.from_ranks, r.to_ranks) for r in self.resizes]
        if shapes != [(self.ranks, self.min_ranks), (self.min_ranks, self.ranks)]:
            missed.append(f"resizes {shapes}, not a shrink to {self.min_ranks} and a grow back")
        for resize in self.resizes:
            if any(code != 0 for code in resize.exit_codes):
                missed.append(f"exit codes {resize.exit_codes} at {resize.cause!r}")
            if resize.steps_run_again:
                missed.append(f"{resize.steps_run_again} steps run again at {resize.cause!r}")
        if self.borrower_state != JobState.SUCCEEDED:
            missed.append(f"the borrower ended {self.borrower_state}")
        if not self.samples.exact:
            missed.append(
                f"samples: {self.samples.samples_seen} seen of {self.samples.samples_expected}, "
                f"steps differing {list(self.samples.steps_differing)[:10]}, "
                f"repeated {list(self.samples.steps_repeated)[:10]}"
            )
        if not self.samples.loss_within_tolerance:
            missed.append(
                f"final loss {self.samples.loss_relative_difference:.3e} apart (relative), "
                f"parameters {self.samples.params_relative_difference:.3e}: more than "
                f"{LOSS_RELATIVE_TOLERANCE:g}"
            )
        return missed

    @property
    def passed(self) -> bool:
        return not self.missed()

    def to_json(self) -> dict[str, Any]:
        document = asdict(self)
        document["samples"].update(
            exact=self.samples.exact, loss_within_tolerance=self.samples.loss_within_tolerance
        )
        document["loss_relative_tolerance"] = LOSS_RELATIVE_TOLERANCE
        document["passed"] = self.passed
        document["missed"] = self.missed()
        return document


def _seconds(later: Any, earlier: Any) -> float | None:
    if later is None or earlier is None:
        return None
    return round((later - earlier).total_seconds(), 3)


class ElasticDrill(Drill):
    """The borrower's job is elastic and its class lets the scheduler resize it."""

    def setup(self) -> None:
        if self.capacity != self.ranks:
            # A free GPU beside the borrower would let the critical job start without
            # taking any of the borrower's.
            raise DrillError(
                f"--elastic needs the drill's nodes filled by the borrower: --ranks "
                f"{self.ranks} on nodes of {self.gpus_per_node} GPUs leaves "
                f"{self.capacity - self.ranks} free (set {GPUS_PER_NODE_ENV})"
            )
        super().setup()
        self.elastic = self._elastic_class(self.user)

    def _elastic_class(self, actor: AbstractBaseUser) -> PriorityClass:
        """The borrower's class: the batch class's grace, no notice, resizable."""
        wanted = {
            "value": 10_000,
            "preemption_policy": "Never",
            "preemptible": True,
            "grace_seconds": self.batch.grace_seconds,
            "notice_seconds": 0,
            "min_runtime_seconds": 0,
            "shrink_elastic": True,
            "description": "Drill only: elastic jobs are shrunk before they are evicted",
        }
        priority_class = PriorityClass.objects.filter(name=ELASTIC_CLASS).first()
        if priority_class is None:
            priority_class = PriorityClass(name=ELASTIC_CLASS)
        if not priority_class.pk or any(getattr(priority_class, k) != v for k, v in wanted.items()):
            for key, value in wanted.items():
                setattr(priority_class, key, value)
            priority_class = priority_class_save(actor=actor, priority_class=priority_class)
        root = self.borrower.parent
        for team in (root, self.borrower):
            if team is None:
                continue
            classes = set(team.priority_classes.all())
            if priority_class not in classes:
                team_priority_classes_set(
                    actor=actor,
                    team=team,
                    priority_classes=[*classes, priority_class],
                    may_widen=True,
                )
        return priority_class

    def service_settings(self) -> dict[str, str]:
        # A gang grows back no sooner than the fair-share minimum runtime after its last
        # start or resize (a minute unless the installation says otherwise); the drill
        # ends its critical job after a few steps, so its services take a few seconds
        # where no policy was saved. A saved policy's minimum holds, and the drill waits for it.
        return {"QM_FAIR_SHARE_MIN_RUNTIME_SECONDS": str(DRILL_GROW_AFTER_SECONDS)}

    def grow_wait_seconds(self) -> float:
        saved = SchedulingPolicy.objects.filter(pk=SchedulingPolicy.SINGLETON).first()
        minimum = saved.fair_share_min_runtime_seconds if saved else DRILL_GROW_AFTER_SECONDS
        return float(minimum) + 120.0

    # -- the training run ------------------------------------------------------

    def elastic_arguments(self) -> list[str]:
        return [
            "--epochs",
            str(ELASTIC_EPOCHS),
            "--dataset-len",
            str(DATASET_LEN),
            "--global-batch",
            str(GLOBAL_BATCH),
            "--micro-batch",
            str(MICRO_BATCH),
            "--hidden",
            str(HIDDEN),
            "--seed",
            str(SEED),
        ]

    def elastic_command(self) -> str:
        script = settings.BASE_DIR / "examples" / "train_elastic.py"
        parts = [
            sys.executable,
            str(script),
            *self.elastic_arguments(),
            "--step-sleep",
            str(ELASTIC_STEP_SLEEP),
        ]
        return " ".join(shlex.quote(part) for part in parts)

    def elastic_reference(self) -> TrainingRecord:
        """An uninterrupted run at the job's largest size, outside the scheduler."""
        script = settings.BASE_DIR / "examples" / "train_elastic.py"
        port = _free_port()
        folder = self.work / "elastic-reference"
        folder.mkdir()
        processes = []
        for rank in range(self.ranks):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(self.ranks),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                "QM_CHECKPOINT_DIR": str(folder / "checkpoints"),
            }
            for name in ("QM_EVENTS_URL", "QM_EVENTS_TOKEN", "QM_JOB_ID", "QM_ATTEMPT"):
                env.pop(name, None)
            log = open(folder / f"rank-{rank}.log", "wb")  # noqa: SIM115 - the child's
            processes.append(
                subprocess.Popen(
                    [sys.executable, str(script), *self.elastic_arguments()],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        self.log(f"elastic reference run: {self.ranks} ranks, uninterrupted")
        for process in processes:
            if process.wait(timeout=900) != 0:
                raise DrillError(f"the elastic reference run failed (logs in {folder})")
        record = TrainingRecord()
        record.add_attempt(
            (folder / f"rank-{rank}.log").read_text(errors="replace") for rank in range(self.ranks)
        )
        return record

    # -- the round -------------------------------------------------------------

    def _resizes(self, job: Job) -> list[PreemptionEvent]:
        return list(PreemptionEvent.objects.filter(job=job).order_by("decided_at", "pk"))

    def _running_at(self, job: Job, ranks: int) -> bool:
        return (
            Job.objects.filter(pk=job.pk, state=JobState.RUNNING).exists()
            and Attempt.objects.filter(
                job=job, ranks=ranks, ended_at__isnull=True, launched_at__isnull=False
            ).exists()
        )

    def _expect_resize(
        self, job: Job, count: int, to_ranks: int, what: str, *, timeout: float = 120.0
    ) -> PreemptionEvent:
        def decided() -> bool:
            stops = self._resizes(job)
            if any(stop.reason != PreemptionEvent.Reason.RESIZE for stop in stops):
                raise DrillError(
                    f"the borrower was stopped for {stops[-1].reason} ({stops[-1].cause!r}), "
                    "not resized"
                )
            return len(stops) >= count

        self.wait(decided, what, timeout=timeout)
        stop = self._resizes(job)[count - 1]
        if stop.resize_ranks != to_ranks:
            raise DrillError(f"{what}: resized to {stop.resize_ranks} ranks, not {to_ranks}")
        self.log(f"decided: {stop.cause}")
        return stop

    def elastic_round(self) -> tuple[Job, Job]:
        """Run the borrower through a shrink and a grow; return it and the critical job."""
        min_ranks = self.ranks // 2
        borrower = job_submit(
            submitter=self.user,
            team=self.borrower,
            flavor=self.flavor,
            ranks=self.ranks,
            ranks_min=min_ranks,
            rank_sizes=[min_ranks, self.ranks],
            gpus_per_rank=1,
            command=self.elastic_command(),
            priority_class=self.elastic,
            name="drill-elastic-borrower",
        )
        self.log(f"submitted elastic borrower job {borrower.pk}: {min_ranks} or {self.ranks} ranks")
        self.wait(
            lambda: self._running_at(borrower, self.ranks), "the borrower to run", timeout=300
        )
        self.wait(
            lambda: self._rank0_step(borrower) >= SHRINK_AT_STEP,
            f"the borrower's step {SHRINK_AT_STEP}",
            timeout=300,
        )
        # The owner's job runs until the drill ends it, once the shrunk gang has trained
        # GROW_AFTER_STEPS steps at its smaller size: a fixed duration would end it
        # before the new gang trains on a slow start (real pods take most of a minute
        # here) or after the whole run on a quick one.
        command = (
            f"{shlex.quote(sys.executable)} {shlex.quote(str(self.sleeper))} "
            f"--seconds {CRITICAL_MAX_SECONDS}"
        )
        critical = job_submit(
            submitter=self.user,
            team=self.owner,
            flavor=self.flavor,
            ranks=1,
            gpus_per_rank=self.ranks - min_ranks,
            command=command,
            priority_class=self.critical,
            name="drill-elastic-critical",
        )
        self.log(f"submitted critical job {critical.pk}: {self.ranks - min_ranks} GPUs")
        shrink = self._expect_resize(borrower, 1, min_ranks, "the shrink")
        self.wait(
            lambda: self._running_at(borrower, min_ranks),
            f"the borrower to run again at {min_ranks} ranks",
            timeout=180,
        )
        shrink.refresh_from_db()
        resumed_at = (shrink.checkpoint_step or SHRINK_AT_STEP) + 1
        self.wait(
            lambda: self._rank0_step(borrower) >= resumed_at + GROW_AFTER_STEPS,
            f"{GROW_AFTER_STEPS} steps at {min_ranks} ranks",
            timeout=300,
        )
        job_cancel(actor=self.user, job=critical)
        self.log(f"the critical job {critical.pk} is done: cancelled by the drill")
        self.wait(
            lambda: Job.objects.filter(pk=critical.pk, state__in=FINAL_STATES).exists(),
            "the critical job to end",
            timeout=120,
        )
        self._expect_resize(borrower, 2, self.ranks, "the grow", timeout=self.grow_wait_seconds())
        self.wait(
            lambda: Job.objects.filter(pk=borrower.pk, state__in=FINAL_STATES).exists(),
            "the borrower to finish",
            timeout=900,
        )
        close_old_connections()
        return borrower, critical

    # -- the figures -----------------------------------------------------------

    def _attempt_logs(self, job: Job, attempt: Attempt) -> list[str]:
        texts = []
        for rank in range(attempt.ranks or job.ranks):
            chunk, _ = read_rank_log(job=job, attempt=attempt.number, rank=rank, limit=1 << 22)
            texts.append(chunk.decode(errors="replace"))
        return texts

    def elastic_figures(
        self, borrower: Job, critical: Job, reference: TrainingRecord
    ) -> ElasticDrillResult:
        borrower.refresh_from_db()
        attempts = list(Attempt.objects.filter(job=borrower).order_by("number"))
        resized = TrainingRecord()
        steps_by_attempt: dict[int, set[int]] = {}
        for attempt in attempts:
            single = TrainingRecord()
            logs = self._attempt_logs(borrower, attempt)
            single.add_attempt(logs)
            resized.add_attempt(logs)
            steps_by_attempt[attempt.number] = set(single.samples)
        critical_started = (
            Rank.objects.filter(attempt__job=critical, started_at__isnull=False)
            .order_by("-started_at")
            .values_list("started_at", flat=True)
            .first()
        )
        figures = []
        for stop in self._resizes(borrower):
            old = stop.victim_attempt
            new = next((a for a in attempts if a.number == old.number + 1), None)
            again = steps_by_attempt.get(old.number, set()) & steps_by_attempt.get(
                new.number if new else -1, set()
            )
            exit_codes = list(
                Rank.objects.filter(attempt=old)
                .order_by("index")
                .values_list("exit_code", flat=True)
            )
            kept = min(old.ranks or 0, stop.resize_ranks or 0)
            resumed = _seconds(stop.resumed_at, stop.decided_at)
            figures.append(
                ResizeFigures(
                    cause=stop.cause,
                    from_ranks=old.ranks or borrower.ranks,
                    to_ranks=stop.resize_ranks or 0,
                    agreed_step=stop.checkpoint_step,
                    resumed_step=stop.resume_step,
                    exit_codes=exit_codes,
                    time_to_free_seconds=_seconds(stop.all_exited_at, stop.decided_at),
                    time_to_resume_seconds=resumed,
                    critical_running_seconds=(
                        _seconds(critical_started, stop.decided_at)
                        if stop.preemptor_id == critical.pk
                        else None
                    ),
                    steps_run_again=len(again),
                    idle_gpu_seconds=round(kept * resumed, 2) if resumed is not None else None,
                )
            )
        return ElasticDrillResult(
            runtime=self.runtime,
            ranks=self.ranks,
            min_ranks=self.ranks // 2,
            borrower_job=borrower.pk,
            critical_job=critical.pk,
            borrower_state=borrower.state,
            resizes=figures,
            samples=compare_samples(resized, reference),
            attempts=[
                {
                    "number": a.number,
                    "ranks": a.ranks,
                    "end_reason": a.end_reason,
                    "steps": len(steps_by_attempt.get(a.number, ())),
                }
                for a in attempts
            ],
        )


def run_elastic_drill(
    *,
    ranks: int = 8,
    runtime: str = "local",
    say: Callable[[str], None] = print,
) -> ElasticDrillResult:
    """Run the elastic drill once and return its figures (see the module docstring)."""
    if runtime != settings.QM_RUNTIME:
        raise DrillError(
            f"--runtime {runtime} needs QM_RUNTIME={runtime} in the environment "
            f"(this process uses {settings.QM_RUNTIME})"
        )
    if ranks < 2 or ranks % 2:
        raise DrillError("--elastic needs an even number of ranks, at least 2")
    if ranks > GLOBAL_BATCH:
        # Each rank takes at least one sample of every global batch.
        raise DrillError(f"--elastic runs at most {GLOBAL_BATCH} ranks")
    started = time.monotonic()
    drill = ElasticDrill(ranks=ranks, grace=None, runtime=runtime, say=say)
    drill.setup()
    reference = drill.elastic_reference()
    services = drill.start_services()
    try:
        borrower, critical = drill.elastic_round()
    finally:
        services.stop()
    result = drill.elastic_figures(borrower, critical, reference)
    drill.log(
        f"elastic drill {'passed' if result.passed else 'FAILED'} in "
        f"{time.monotonic() - started:.0f} s at {timezone.now():%H:%M:%S}"
    )
    return result
