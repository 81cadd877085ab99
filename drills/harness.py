"""The drill harness: the mission's verification protocol, end to end.

A borrower team runs a distributed training job on GPUs an owner team
guarantees but leaves idle; the owner then submits a critical job that needs
them back. The drill measures what happens, with real processes, a real
Celery worker and beat, and the real web endpoint for the trap's events:

- signal propagation: preemption decision -> each rank's `signal_received`;
- checkpoint duration against the grace window;
- the exit code of every rank (0, not 137);
- orphaned sockets: ports of the gang still bound after exit;
- restart integrity: the resumed job's final parameters, Adam moments, RNG
  states and loss against an uninterrupted reference run (bit for bit);
- recovery: the critical job's last rank exit -> the borrower's `resumed`;
- with the checkpoint notice on and off (`--notice both`, the same round twice):
  lost GPU-seconds (work since the last committed checkpoint when the ranks
  stop), the decision -> GPUs free, and the training stall per checkpoint
  (synchronous saves without the notice, background saves with it).

The borrower's regular checkpoints (every SAVE_EVERY steps) are further apart
than the drill runs before the critical job arrives, three quarters through
the run: some 18 s of work unsaved, a small stand-in for the tens of minutes a
real job has between its checkpoints.

`--chaos N` repeats it with a random disturbance per round (SIGKILL of a rank,
a second SIGTERM, a grace shorter than the save, the Celery worker killed
mid-preemption) and counts corrupt checkpoints, orphaned ranks, double
preemptions and lost events, each by a check independent of the code under
test: resume and compare, a scan of every process, log lines against database rows.

Everything the drill sets up (flavor, nodes, teams, quotas, priority classes)
goes through the quotas services as the `drill-bot` user, so each change is
validated and audited like any other; the targets it is judged against are
those of `telemetry.mission`.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from drills.base import (
    BORROWER_RETRIES,
    CRITICAL_SECONDS,
    DISTURBANCES,
    SAVE_EVERY,
    STEP_SLEEP,
    STEPS,
    DrillError,
)
from drills.measure import DrillMeasurements
from drills.result import ChaosRound, DrillResult, RoundFigures
from drills.setup import DrillSetup
from portal.processes import beat_command, web_command, worker_command
from preemption.logs import read_rank_log
from preemption.models import FINAL_STATES, Attempt, Job, JobState, PreemptionEvent, Rank
from preemption.services import job_submit
from quotas.models import PriorityClass
from telemetry.services import drill_run_record


@dataclass
class Services:
    """The web server, Celery worker and beat the drill runs against."""

    env: dict[str, str]
    port: int
    address: str = "127.0.0.1"
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    log_dir: Path = Path()

    def start(self, name: str) -> None:
        commands = {
            "web": web_command(
                bind=f"{self.address}:{self.port}", workers=2, threads=8, timeout=60
            ),
            "worker": worker_command(hostname=f"drill-{os.getpid()}-{time.time_ns()}@%h"),
            "beat": beat_command(schedule=self.log_dir / "celerybeat-schedule"),
        }
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        self.processes[name] = subprocess.Popen(
            commands[name],
            env=self.env,
            cwd=settings.BASE_DIR,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill(self, name: str) -> None:
        process = self.processes.pop(name, None)
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.time() + 15
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        self.processes.clear()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Drill(DrillSetup, DrillMeasurements):
    """One drill run (or a chaos series) with its own teams, nodes and processes."""

    # -- the services ----------------------------------------------------------

    def start_services(self) -> Services:
        port = _free_port()
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "QM_PUBLIC_URL": f"http://{self.bind_address}:{port}",
            "QM_RETRY_BACKOFF_SECONDS": "1",
            "QM_CYCLE_SECONDS": "1",
            **self.service_settings(),
        }
        # The ranks reach the portal at the bind address (on real nodes, the pod
        # network's bridge): Django answers 400 to a host it does not serve, and every
        # trap event and notice poll of the ranks was refused.
        hosts = list(settings.ALLOWED_HOSTS)
        if self.bind_address not in hosts:
            env["ALLOWED_HOSTS"] = ",".join([*hosts, self.bind_address])
        self.public_url = env["QM_PUBLIC_URL"]
        services = Services(env=env, port=port, address=self.bind_address, log_dir=self.work)
        for name in ("web", "worker", "beat"):
            services.start(name)
        self.wait(lambda: self._http_ok(self.bind_address, port), "the web server", timeout=60)
        self.log(
            f"web on {self.bind_address}:{port}, Celery worker and beat started (logs in {self.work})"
        )
        return services

    def service_settings(self) -> dict[str, str]:
        """Settings of the drill's own web server, worker and beat beyond the cycle's."""
        return {}

    @staticmethod
    def _http_ok(address: str, port: int) -> bool:
        try:
            with socket.create_connection((address, port), timeout=0.5):
                return True
        except OSError:
            return False

    # -- the jobs ----------------------------------------------------------------

    def train_command(self, *, dump: Path, checkpoint_dir: Path | None = None) -> str:
        parts = [
            sys.executable,
            str(self.train),
            "--steps",
            str(self.steps),
            "--step-sleep",
            str(STEP_SLEEP),
            "--save-every",
            str(SAVE_EVERY),
            "--dump",
            str(dump),
        ]
        if checkpoint_dir is not None:
            parts += ["--checkpoint-dir", str(checkpoint_dir)]
        return " ".join(shlex.quote(p) for p in parts)

    @property
    def reference_dump(self) -> Path:
        """Where each rank of the reference run dumps its final state."""
        return self.work / "reference-{rank}.pt"

    def reference_run(self) -> Path:
        """An uninterrupted run of the same training, outside the scheduler."""
        dump = self.reference_dump
        ckpt = self.work / "reference-checkpoints"
        port = _free_port()
        command = shlex.split(self.train_command(dump=dump, checkpoint_dir=ckpt))
        processes = []
        for rank in range(self.ranks):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(self.ranks),
                "LOCAL_RANK": str(rank % self.gpus_per_node),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
            }
            for name in ("QM_EVENTS_URL", "QM_EVENTS_TOKEN", "QM_JOB_ID", "QM_ATTEMPT"):
                env.pop(name, None)
            log = open(self.work / f"reference-rank-{rank}.log", "wb")  # noqa: SIM115
            processes.append(
                subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            )
        self.log(f"reference run: {self.ranks} ranks, {self.steps} steps, uninterrupted")
        for process in processes:
            if process.wait(timeout=900) != 0:
                raise DrillError(f"the reference run failed (logs in {self.work})")
        return dump

    def submit_borrower(
        self, *, name: str, priority: PriorityClass, dump: Path, background: bool = False
    ) -> Job:
        command = self.train_command(dump=dump)
        if background:
            # With the notice the borrower writes its checkpoints in the background,
            # so that answering the notice does not stall training.
            command = f"QM_ASYNC_SAVES=1 {command}"
        return job_submit(
            submitter=self.user,
            team=self.borrower,
            flavor=self.flavor,
            ranks=self.ranks,
            gpus_per_rank=1,
            command=command,
            priority_class=priority,
            name=name,
            # A chaos round kills a rank as a failing machine would (exit 137); a job
            # runs again after its own failures only when it asks to, as a training
            # job meant to survive lost machines does.
            retries=BORROWER_RETRIES,
        )

    def submit_critical(self, *, name: str) -> Job:
        command = f"{shlex.quote(sys.executable)} {shlex.quote(str(self.sleeper))} --seconds {self.critical_seconds}"
        return job_submit(
            submitter=self.user,
            team=self.owner,
            flavor=self.flavor,
            ranks=self.nodes,
            gpus_per_rank=self.gpus_per_node,
            command=command,
            priority_class=self.critical,
            name=name,
        )

    def _state(self, job: Job) -> str:
        return Job.objects.values_list("state", flat=True).get(pk=job.pk)

    def _rank0_step(self, job: Job) -> int:
        attempt = Attempt.objects.filter(job=job).order_by("-number").first()
        if attempt is None:
            return -1
        try:
            chunk, _ = read_rank_log(
                job=job, attempt=attempt.number, rank=0, offset=0, limit=1 << 20
            )
        except Exception:
            return -1
        steps = [
            int(line.split()[1])
            for line in chunk.decode(errors="replace").splitlines()
            if line.startswith("STEP ")
        ]
        return max(steps, default=-1)

    # -- one round ---------------------------------------------------------------

    def round(
        self, *, services: Services, label: str, disturbance: str | None, notice: bool = True
    ) -> RoundFigures:
        """Borrower runs, critical job reclaims, borrower resumes and finishes; with
        `notice`, the borrower's class sends the checkpoint notice first."""
        dump = self.dumps / f"{label}-{{rank}}.pt"
        priority = self.classes[notice]
        if disturbance == "short-grace":
            priority = self.short_grace
        borrower = self.submit_borrower(
            name=f"{label}-borrower", priority=priority, dump=dump, background=notice
        )
        self.log(
            f"submitted borrower job {borrower.pk}: {self.ranks} ranks × 1 GPU on borrowed GPUs"
        )
        self.wait(
            lambda: self._state(borrower) == JobState.RUNNING, "the borrower to run", timeout=300
        )
        self.wait(
            lambda: self._rank0_step(borrower) >= self.steady_step,
            "the borrower's steady state",
            timeout=300,
        )
        if disturbance == "kill-rank":
            self._kill_random_rank(borrower)
            self.wait(
                lambda: (
                    self._state(borrower) == JobState.RUNNING
                    and self._rank0_step(borrower) >= self.steady_step
                    and Attempt.objects.filter(job=borrower).count() >= 2
                ),
                "the gang guard to restart the borrower",
                timeout=300,
            )
        master_port = self.master_port(Attempt.objects.get(job=borrower, ended_at__isnull=True))
        self.log(
            f"the gang rendezvoused on port {master_port}"
            if master_port
            else "the gang's rendezvous port is not visible from this machine"
        )
        critical = self.submit_critical(name=f"{label}-critical")
        self.log(
            f"submitted critical job {critical.pk}: {self.nodes} × {self.gpus_per_node} GPUs under ai-prod-critical"
        )
        self.wait(
            lambda: PreemptionEvent.objects.filter(job=borrower, preemptor=critical).exists(),
            "the preemption decision",
            timeout=60,
        )
        event = PreemptionEvent.objects.get(job=borrower, preemptor=critical)
        self.log(f"decided: {event.cause} (grace {event.grace_seconds:.0f} s)")
        if disturbance == "kill-worker":
            services.kill("worker")
            self.log("chaos: Celery worker killed mid-preemption; starting a new one")
            services.start("worker")
        if disturbance == "second-sigterm":
            self.wait(
                lambda: PreemptionEvent.objects.filter(
                    pk=event.pk, signal_sent_at__isnull=False
                ).exists(),
                "the first signal",
                timeout=30,
                quiet=True,
            )
            time.sleep(0.05)
            self._signal_ranks(event.victim_attempt, signal.SIGTERM)
            self.log("chaos: a second SIGTERM sent to every rank")
        self.wait(
            lambda: (
                self._state(borrower)
                in (
                    JobState.REQUEUED,
                    JobState.PENDING,
                    JobState.ADMITTED,
                    JobState.RUNNING,
                    JobState.SUCCEEDED,
                )
                and Attempt.objects.filter(
                    pk=event.victim_attempt_id, ended_at__isnull=False
                ).exists()
            ),
            "every borrower rank to exit",
            timeout=event.grace_seconds + 120,
        )
        self.log("borrower requeued; critical job takes the GPUs")
        self.wait(
            lambda: self._state(critical) == JobState.SUCCEEDED,
            "the critical job to finish",
            timeout=self.critical_seconds + 300,
        )
        self.wait(
            lambda: self._state(borrower) in FINAL_STATES,
            "the borrower to resume and finish",
            timeout=900,
        )
        close_old_connections()
        return self.measure(
            borrower=borrower,
            critical=critical,
            event_id=event.pk,
            dump=dump,
            master_port=master_port,
            notice=priority.notice_seconds > 0,
        )

    def _kill_random_rank(self, job: Job) -> None:
        attempt = Attempt.objects.filter(job=job, ended_at__isnull=True).first()
        ranks = list(Rank.objects.filter(attempt=attempt, pid__isnull=False))
        if not ranks:
            raise DrillError("no rank pid recorded to kill")
        victim = self.random.choice(ranks)
        os.killpg(os.getpgid(victim.pid), signal.SIGKILL)
        self.log(f"chaos: SIGKILL to rank {victim.index} (pid {victim.pid})")

    def _signal_ranks(self, attempt: Attempt, signum: int) -> None:
        for pid in Rank.objects.filter(attempt=attempt, pid__isnull=False).values_list(
            "pid", flat=True
        ):
            try:
                os.killpg(os.getpgid(pid), signum)
            except ProcessLookupError:
                continue


def run_drill(
    *,
    ranks: int = 16,
    grace: float | None = None,
    runtime: str = "local",
    chaos: int = 0,
    say: Callable[[str], None] = print,
    seed: int | None = None,
    steps: int = STEPS,
    critical_seconds: float = CRITICAL_SECONDS,
    notice: str = "on",
    critical_at_step: int | None = None,
) -> DrillResult:
    """Run the drill (or `chaos` rounds of it) and store a DrillRun row. `notice`
    is on, off or both: with both, the round runs without the checkpoint notice,
    then with it, and the result compares them; chaos rounds alternate."""
    if runtime != settings.QM_RUNTIME:
        raise DrillError(
            f"--runtime {runtime} needs QM_RUNTIME={runtime} in the environment (this process uses {settings.QM_RUNTIME})"
        )
    started = timezone.now()
    drill = Drill(
        ranks=ranks,
        grace=grace,
        runtime=runtime,
        say=say,
        seed=seed,
        steps=steps,
        critical_seconds=critical_seconds,
        notice=notice,
        critical_at_step=critical_at_step,
    )
    drill.setup()
    drill.log(f"reference run first ({ranks} ranks)")
    drill.reference_run()
    services = drill.start_services()
    figures: RoundFigures | None = None
    without_notice: RoundFigures | None = None
    chaos_rounds: list[ChaosRound] = []
    try:
        if chaos <= 0:
            for mode in drill.notice_modes:
                drill.log(f"round with the checkpoint notice {'on' if mode else 'off'}")
                measured = drill.round(
                    services=services,
                    label=f"drill-notice-{'on' if mode else 'off'}",
                    disturbance=None,
                    notice=mode,
                )
                if mode or len(drill.notice_modes) == 1:
                    figures = measured
                else:
                    without_notice = measured
        for number in range(1, chaos + 1):
            disturbance = drill.random.choice(DISTURBANCES)
            mode = drill.notice_modes[number % len(drill.notice_modes)]
            drill.log(
                f"chaos round {number}/{chaos}: {disturbance}, notice {'on' if mode else 'off'}"
            )
            outcome = drill.round(
                services=services, label=f"chaos{number}", disturbance=disturbance, notice=mode
            )
            time.sleep(1.0)
            checks = drill.chaos_checks([outcome.borrower_job, outcome.critical_job])
            checks["corrupt_checkpoints"] = 0 if outcome.restart_integrity else 1
            chaos_rounds.append(
                ChaosRound(
                    round=number,
                    disturbance=disturbance,
                    **checks,
                    restart_max_abs_diff=outcome.restart_max_abs_diff,
                    exit_codes=outcome.exit_codes,
                    outcome=outcome.outcome,
                    notice=outcome.notice,
                    lost_gpu_seconds=outcome.lost_gpu_seconds,
                    time_to_free_seconds=outcome.time_to_free_seconds,
                )
            )
            drill.log(f"round {number}: {json.dumps(checks)}")
    finally:
        services.stop()
    result = DrillResult(
        runtime=runtime,
        ranks=ranks,
        grace_seconds=grace if grace is not None else float(drill.batch.grace_seconds),
        figures=figures,
        chaos=chaos_rounds,
        without_notice=without_notice,
    )
    drill_run_record(
        started_at=started,
        finished_at=timezone.now(),
        runtime=runtime,
        ranks=ranks,
        grace_seconds=result.grace_seconds,
        chaos_rounds=len(chaos_rounds),
        passed=result.passed,
        result=result.to_json(),
    )
    return result
