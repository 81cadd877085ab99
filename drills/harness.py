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
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import close_old_connections
from django.utils import timezone

from drills.integrity import compare_with_reference
from drills.result import ChaosRound, DrillResult, RoundFigures
from portal.processes import beat_command, web_command, worker_command
from preemption.ingest import fingerprint
from preemption.logs import read_rank_log
from preemption.models import (
    FINAL_STATES,
    Attempt,
    Job,
    JobState,
    PreemptionEvent,
    Rank,
    TrapEvent,
)
from preemption.runtime import get_runtime, local_runner
from preemption.runtimes import iter_log_chunks, iter_trap_events_in_chunks, processes
from preemption.runtimes.base import GangId
from preemption.services import job_cancel, job_submit
from quotas.models import Node, PriorityClass, Quota, ResourceFlavor, Team
from quotas.services import (
    flavor_create,
    node_upsert,
    priority_class_save,
    quota_set,
    team_create,
    team_priority_classes_set,
)
from telemetry.services import drill_run_record

FLAVOR = "drill-gpu"
STEP_SLEEP = 0.2
STEPS = 120
SAVE_EVERY = 200
NOTICE_MODES = {"on": (True,), "off": (False,), "both": (False, True)}
CRITICAL_SECONDS = 30.0
DISTURBANCES = ("kill-rank", "second-sigterm", "short-grace", "kill-worker")
# One kill-rank round needs one retry; the second leaves room for a disturbance that
# lands during the restart.
BORROWER_RETRIES = 2
# Two hooks for a test cluster of real kubelets on this machine (tests/k8s/realnodes):
# nodes of fewer GPUs, so that eight ranks span two nodes, and the web server on an
# address the pods reach (the host's address on their bridge) rather than loopback.
GPUS_PER_NODE_ENV = "QM_DRILL_GPUS_PER_NODE"
BIND_ADDRESS_ENV = "QM_DRILL_BIND_ADDRESS"


class DrillError(RuntimeError):
    """The drill could not complete a phase (the message says which)."""


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


def _ts(moment: datetime | None) -> float | None:
    return moment.timestamp() if moment else None


class Drill:
    """One drill run (or a chaos series) with its own teams, nodes and processes."""

    def __init__(
        self,
        *,
        ranks: int,
        grace: float | None,
        runtime: str,
        say: Callable[[str], None],
        steps: int = STEPS,
        critical_seconds: float = CRITICAL_SECONDS,
        seed: int | None = None,
        notice: str = "on",
    ) -> None:
        if ranks < 1 or ranks > 256:
            raise DrillError("--ranks must be between 1 and 256")
        self.ranks = ranks
        self.grace = grace
        self.runtime = runtime
        self.say = say
        self.steps = steps
        # The step the borrower has reached when the critical job is submitted.
        self.steady_step = steps * 3 // 4
        self.critical_seconds = critical_seconds
        self.random = random.Random(seed)
        if notice not in NOTICE_MODES:
            raise DrillError("--notice must be on, off or both")
        self.notice_modes = NOTICE_MODES[notice]
        gpus_per_node = os.environ.get(GPUS_PER_NODE_ENV) or "8"
        if not gpus_per_node.isdigit() or not 1 <= int(gpus_per_node) <= 64:
            raise DrillError(f"{GPUS_PER_NODE_ENV} must be between 1 and 64, got {gpus_per_node!r}")
        self.gpus_per_node = int(gpus_per_node)
        self.bind_address = os.environ.get(BIND_ADDRESS_ENV) or "127.0.0.1"
        self.nodes = max(1, math.ceil(ranks / self.gpus_per_node))
        self.capacity = self.nodes * self.gpus_per_node
        self.work = Path(tempfile.mkdtemp(prefix="qm-drill-", dir=settings.VAR_DIR))
        self.dumps = self.work / "dumps"
        self.dumps.mkdir(mode=0o700)
        if (runtime == "local" and local_runner() is not None) or runtime == "kubernetes":
            # The borrowers' ranks run as users of their jobs' own and write their
            # final state here: they may pass through the drill's folder and add files
            # to this one, but neither list it nor remove another job's files.
            self.work.chmod(0o711)
            self.dumps.chmod(0o1733)
        self.train = settings.BASE_DIR / "examples" / "train_ddp.py"
        self.sleeper = settings.BASE_DIR / "examples" / "sleeper.py"
        self.started = time.monotonic()
        # Set when the web server starts: the trap's events go there.
        self.public_url = ""

    # -- set-up ----------------------------------------------------------------

    def log(self, message: str) -> None:
        self.say(f"[{time.monotonic() - self.started:7.1f}s] {message}")

    def setup(self) -> None:
        """Create (or reuse) the drill's flavor, nodes, teams, classes and user.

        Every change goes through the quotas services as `drill-bot`, so it is
        validated and audited; what is already as wanted is left alone (and not
        audited again)."""
        user_model = get_user_model()
        self.user = user_model.objects.filter(
            username="drill-bot"
        ).first() or user_model.objects.create_user("drill-bot", "drill@example.org", None)
        try:
            self._setup_cluster(self.user)
        except ValidationError as error:
            raise DrillError(f"the drill's set-up was refused: {error}") from error
        self._clear_leftovers()

    def _setup_cluster(self, actor: AbstractBaseUser) -> None:
        flavor = ResourceFlavor.objects.filter(name=FLAVOR).first() or flavor_create(
            actor=actor, name=FLAVOR, description="drill GPUs"
        )
        wanted = {f"drill-node-{i}" for i in range(self.nodes)}
        for node in Node.objects.filter(flavor=flavor, schedulable=True).exclude(name__in=wanted):
            node_upsert(
                actor=actor,
                name=node.name,
                flavor=flavor,
                gpus=node.gpus,
                labels=node.labels,
                schedulable=False,
            )
        for name in sorted(wanted):
            gpus = self.gpus_per_node
            if not Node.objects.filter(
                name=name, flavor=flavor, gpus=gpus, schedulable=True
            ).exists():
                node_upsert(actor=actor, name=name, flavor=flavor, gpus=gpus, schedulable=True)
        root = Team.objects.filter(slug="drill").first() or team_create(
            actor=actor, slug="drill", name="Drill"
        )
        owner = Team.objects.filter(slug="drill-owner").first() or team_create(
            actor=actor, slug="drill-owner", name="Drill owner", parent=root
        )
        borrower = Team.objects.filter(slug="drill-borrower").first() or team_create(
            actor=actor, slug="drill-borrower", name="Drill borrower", parent=root
        )
        self._set_quotas(actor=actor, flavor=flavor, root=root, owner=owner, borrower=borrower)
        self.flavor, self.owner, self.borrower = flavor, owner, borrower
        self.batch = PriorityClass.objects.get(name="ai-batch-preemptible")
        self.critical = PriorityClass.objects.get(name="ai-prod-critical")
        self.short_grace = self._priority_class(
            actor=actor,
            name="drill-short-grace",
            grace_seconds=1,
            notice_seconds=0,
            description="Drill only: a grace shorter than a checkpoint save.",
        )
        self.classes = {True: self.batch, False: self._without_notice(actor, self.batch)}
        if self.grace is not None:
            grace = max(1, int(self.grace))
            self.classes = {
                True: self._priority_class(
                    actor=actor,
                    name="drill-grace",
                    grace_seconds=grace,
                    notice_seconds=min(30, grace // 2),
                    description="Drill only: --grace",
                ),
                False: self._priority_class(
                    actor=actor,
                    name="drill-grace-no-notice",
                    grace_seconds=grace,
                    notice_seconds=0,
                    description="Drill only: --grace, no checkpoint notice",
                ),
            }
        # The owner runs the critical job, the borrower the preemptible ones; the
        # root must hold every class its sub-teams narrow to, so it is set first.
        for team, classes in (
            (root, [self.critical, self.batch, self.short_grace, *self.classes.values()]),
            (owner, [self.critical]),
            (borrower, [self.batch, self.short_grace, *self.classes.values()]),
        ):
            if set(team.priority_classes.all()) != set(classes):
                team_priority_classes_set(
                    actor=actor, team=team, priority_classes=classes, may_widen=True
                )

    def _set_quotas(
        self,
        *,
        actor: AbstractBaseUser,
        flavor: ResourceFlavor,
        root: Team,
        owner: Team,
        borrower: Team,
    ) -> None:
        """The owner is guaranteed every drill GPU and the borrower none, so all the
        borrower runs is borrowed. The changes come in an order that keeps every
        sum rule true at each step: sub-teams first make room under the root for
        its new size, then the root, then the owner."""
        current = {
            quota.team_id: quota
            for quota in Quota.objects.filter(flavor=flavor, team__in=[root, owner, borrower])
        }
        borrower_quota = current.get(borrower.pk)
        if (
            borrower_quota is None
            or borrower_quota.guarantee
            or borrower_quota.borrow_limit is not None
        ):
            quota_set(actor=actor, team=borrower, flavor=flavor, guarantee=0)
        owner_quota = current.get(owner.pk)
        if owner_quota is not None and owner_quota.guarantee > self.capacity:
            quota_set(actor=actor, team=owner, flavor=flavor, guarantee=self.capacity)
        quota_set(actor=actor, team=root, flavor=flavor, guarantee=self.capacity)
        quota_set(actor=actor, team=owner, flavor=flavor, guarantee=self.capacity)

    def _without_notice(self, actor: AbstractBaseUser, like: PriorityClass) -> PriorityClass:
        """The borrower's class with its grace window and no checkpoint notice."""
        return self._priority_class(
            actor=actor,
            name="drill-no-notice",
            grace_seconds=like.grace_seconds,
            notice_seconds=0,
            description=f"Drill only: {like.name} without the checkpoint notice",
        )

    @staticmethod
    def _priority_class(
        *,
        actor: AbstractBaseUser,
        name: str,
        grace_seconds: int,
        notice_seconds: int,
        description: str,
    ) -> PriorityClass:
        """A preemptible class of the drill's own with the given grace and notice
        windows, saved (and audited) only when it is new or differs."""
        wanted = {
            "value": 10_000,
            "preemption_policy": "Never",
            "preemptible": True,
            "grace_seconds": grace_seconds,
            "notice_seconds": notice_seconds,
            "description": description,
        }
        priority_class = PriorityClass.objects.filter(name=name).first() or PriorityClass(name=name)
        if priority_class.pk and all(getattr(priority_class, k) == v for k, v in wanted.items()):
            return priority_class
        for key, value in wanted.items():
            setattr(priority_class, key, value)
        return priority_class_save(actor=actor, priority_class=priority_class)

    def _clear_leftovers(self) -> None:
        for job in Job.objects.filter(team__in=[self.owner, self.borrower]).exclude(
            state__in=FINAL_STATES
        ):
            job_cancel(actor=self.user, job=job)
        self._wait(
            lambda: (
                not Job.objects.filter(team__in=[self.owner, self.borrower])
                .exclude(state__in=FINAL_STATES)
                .exists()
            ),
            "earlier drill jobs to stop",
            timeout=180,
            quiet=True,
        )

    def start_services(self) -> Services:
        port = _free_port()
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "QM_PUBLIC_URL": f"http://{self.bind_address}:{port}",
            "QM_RETRY_BACKOFF_SECONDS": "1",
            "QM_CYCLE_SECONDS": "1",
        }
        self.public_url = env["QM_PUBLIC_URL"]
        services = Services(env=env, port=port, address=self.bind_address, log_dir=self.work)
        for name in ("web", "worker", "beat"):
            services.start(name)
        self._wait(lambda: self._http_ok(self.bind_address, port), "the web server", timeout=60)
        self.log(
            f"web on {self.bind_address}:{port}, Celery worker and beat started (logs in {self.work})"
        )
        return services

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

    # -- waiting -----------------------------------------------------------------

    def _wait(
        self, condition: Callable[[], bool], what: str, *, timeout: float, quiet: bool = False
    ) -> None:
        if not quiet:
            self.log(f"waiting for {what}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            close_old_connections()
            if condition():
                return
            time.sleep(0.1)
        raise DrillError(
            f"timed out after {timeout:.0f} s waiting for {what} (logs in {self.work})"
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
        self._wait(
            lambda: self._state(borrower) == JobState.RUNNING, "the borrower to run", timeout=300
        )
        self._wait(
            lambda: self._rank0_step(borrower) >= self.steady_step,
            "the borrower's steady state",
            timeout=300,
        )
        if disturbance == "kill-rank":
            self._kill_random_rank(borrower)
            self._wait(
                lambda: (
                    self._state(borrower) == JobState.RUNNING
                    and self._rank0_step(borrower) >= self.steady_step
                    and Attempt.objects.filter(job=borrower).count() >= 2
                ),
                "the gang guard to restart the borrower",
                timeout=300,
            )
        master_port = self._master_port(Attempt.objects.get(job=borrower, ended_at__isnull=True))
        self.log(
            f"the gang rendezvoused on port {master_port}"
            if master_port
            else "the gang's rendezvous port is not visible from this machine"
        )
        critical = self.submit_critical(name=f"{label}-critical")
        self.log(
            f"submitted critical job {critical.pk}: {self.nodes} × {self.gpus_per_node} GPUs under ai-prod-critical"
        )
        self._wait(
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
            self._wait(
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
        self._wait(
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
        self._wait(
            lambda: self._state(critical) == JobState.SUCCEEDED,
            "the critical job to finish",
            timeout=self.critical_seconds + 300,
        )
        self._wait(
            lambda: self._state(borrower) in FINAL_STATES,
            "the borrower to resume and finish",
            timeout=900,
        )
        close_old_connections()
        return self._measure(
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

    # -- measuring -----------------------------------------------------------------

    def _measure(
        self,
        *,
        borrower: Job,
        critical: Job,
        event_id: int,
        dump: Path,
        master_port: int | None,
        notice: bool = False,
    ) -> RoundFigures:
        borrower.refresh_from_db()
        event = PreemptionEvent.objects.select_related("victim_attempt").get(pk=event_id)
        decided = event.decided_at.timestamp()
        ranks = list(Rank.objects.filter(attempt=event.victim_attempt).order_by("index"))
        latencies = [
            round(r.signal_received_at.timestamp() - decided, 4) if r.signal_received_at else None
            for r in ranks
        ]
        victim_events = list(
            TrapEvent.objects.filter(job=borrower, attempt=event.victim_attempt.number)
        )
        propagation = max((x for x in latencies if x is not None), default=None)
        if notice:
            # The notice is the first word that reaches the ranks. Where it is polled,
            # only rank 0 receives it; the others know at the step boundary where the
            # notice's save begins.
            sent = event.notice_sent_at.timestamp() if event.notice_sent_at else math.inf
            knew: dict[int, float] = {}
            for e in sorted(victim_events, key=lambda e: e.at):
                if e.event in ("notice_received", "checkpoint_started") and e.at >= sent:
                    knew.setdefault(e.rank, e.at)
            propagation = (
                round(max(knew.values()) - decided, 4) if len(knew) == len(ranks) else None
            )
        critical_exit = (
            Rank.objects.filter(attempt__job=critical)
            .order_by("-exited_at")
            .values_list("exited_at", flat=True)
            .first()
        )
        resumed = (
            TrapEvent.objects.filter(
                job=borrower, event="resumed", attempt__gt=event.victim_attempt.number
            )
            .order_by("at")
            .values_list("at", flat=True)
            .first()
        )
        orphaned = sorted(
            set(event.victim_attempt.orphaned_ports)
            | set(self._bound_ports(master_port))
            | set(self._leftover_ports(event.victim_attempt))
        )
        diff, same_rng, same_loss = compare_with_reference(
            dump=dump, reference=self.reference_dump, ranks=self.ranks
        )
        window_start = (
            Attempt.objects.filter(job=borrower)
            .order_by("number")
            .values_list("admitted_at", flat=True)
            .first()
        )
        window_end = borrower.finished_at or timezone.now()
        used = 0.0
        for attempt in Attempt.objects.filter(job__in=[borrower, critical]).select_related("job"):
            start = attempt.launched_at or attempt.admitted_at
            end = attempt.ended_at or window_end
            used += max(0.0, (end - start).total_seconds()) * attempt.job.gpus
        span = max(1e-9, (window_end - window_start).total_seconds()) if window_start else 1.0
        return RoundFigures(
            borrower_job=borrower.pk,
            critical_job=critical.pk,
            borrower_state=borrower.state,
            signal_propagation_seconds=propagation,
            signal_latency_seconds=latencies,
            signals_received=sum(1 for x in latencies if x is not None),
            checkpoint_seconds=event.checkpoint_seconds,
            checkpoint_step=event.checkpoint_step,
            checkpoint_committed=event.checkpoint_step is not None,
            outcome=event.outcome,
            exit_codes=[r.exit_code for r in ranks],
            orphaned_ports=len(orphaned),
            restart_integrity=diff == 0.0
            and same_rng
            and same_loss
            and borrower.state == JobState.SUCCEEDED,
            restart_max_abs_diff=diff,
            recovery_seconds=round(resumed - critical_exit.timestamp(), 3)
            if resumed and critical_exit
            else None,
            utilization=round(used / (self.capacity * span), 4),
            notice=notice,
            notice_committed=event.notice_committed_at is not None,
            lost_gpu_seconds=lost_gpu_seconds(event, ranks, victim_events, gpus_per_rank=1),
            time_to_free_seconds=round(event.all_exited_at.timestamp() - decided, 3)
            if event.all_exited_at
            else None,
            stall_sync_seconds=_mean_stall(victim_events, background=False),
            stall_async_seconds=_mean_stall(victim_events, background=True),
        )

    def _bound_ports(self, port: int | None) -> list[int]:
        """Independent of the runtime: can the gang's master port be bound again?"""
        if port is None:
            return []
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return [port]
        return []

    def _ours(self, pid: int) -> bool:
        """Whether a process was started for a job of this drill: it reports its
        events to this drill's web server (job ids repeat across installations
        sharing a machine)."""
        url = processes.environ_value(pid, "QM_EVENTS_URL") or ""
        return url.startswith(f"{self.public_url}/")

    def _gang_pids(self, attempt: Attempt) -> list[int]:
        """Live processes on this machine started for one attempt of a drill job."""
        pids = []
        for process in processes.live_processes(skip=os.getpid()):
            pid = process.pid
            if processes.environ_value(pid, "QM_JOB_ID") != str(attempt.job_id):
                continue
            if processes.environ_value(pid, "QM_ATTEMPT") != str(attempt.number):
                continue
            if self._ours(pid):
                pids.append(pid)
        return pids

    def _leftover_ports(self, attempt: Attempt) -> list[int]:
        """Independent of the runtime: TCP ports still listened on by any process
        of the gang left on this machine (a scan of every process)."""
        ports: set[int] = set()
        for pid in self._gang_pids(attempt):
            ports |= processes.listening_ports(pid)
        return sorted(ports)

    def _master_port(self, attempt: Attempt) -> int | None:
        """The port the gang rendezvoused on, read while the gang runs.

        The local runtime records it; ranks of other runtimes that run on this
        machine (the test cluster's node agent runs pods as local processes)
        carry it in their environment. None when neither says.
        """
        path = Path(settings.QM_RUNS_DIR) / str(attempt.job_id) / str(attempt.number) / "gang.json"
        if path.exists():
            port = json.loads(path.read_text()).get("master_port")
            return int(port) if port else None
        for pid in self._gang_pids(attempt):
            address = processes.environ_value(pid, "MASTER_ADDR")
            port = processes.environ_value(pid, "MASTER_PORT")
            # A port in another network namespace (a real pod) cannot be probed here.
            if address in ("127.0.0.1", "localhost") and port and port.isdigit():
                return int(port)
        return attempt.master_port

    # -- chaos checks ----------------------------------------------------------------

    def chaos_checks(self, jobs: list[int]) -> dict[str, int]:
        """Orphaned ranks (a scan of every process), double preemptions and lost
        events (log lines against database rows)."""
        orphans = 0
        wanted = {str(j) for j in jobs}
        for process in processes.live_processes(skip=os.getpid()):
            if (
                self._ours(process.pid)
                and processes.environ_value(process.pid, "QM_JOB_ID") in wanted
            ):
                orphans += 1
        double = 0
        for job_id in jobs:
            per_attempt = PreemptionEvent.objects.filter(job_id=job_id).values_list(
                "victim_attempt_id", flat=True
            )
            double += len(per_attempt) - len(set(per_attempt))
            reclaims = PreemptionEvent.objects.filter(
                job_id=job_id, reason__in=["reclaim", "priority", "fair-share"]
            ).count()
            double += max(0, reclaims - 1)
        runtime = get_runtime()
        lost = 0
        for attempt in Attempt.objects.filter(job_id__in=jobs):
            for rank in range(attempt.job.ranks):
                log = iter_log_chunks(runtime, GangId(attempt.job_id, attempt.number), rank)
                for event in iter_trap_events_in_chunks(log):
                    if not TrapEvent.objects.filter(fingerprint=fingerprint(event)).exists():
                        lost += 1
        return {"orphaned_ranks": orphans, "double_preemptions": double, "lost_events": lost}


def lost_gpu_seconds(
    event: PreemptionEvent, ranks: list[Rank], events: list[TrapEvent], *, gpus_per_rank: int
) -> float | None:
    """GPU-seconds of work each rank had done since its last committed checkpoint
    when it stopped training, summed over the ranks.

    A rank stops training when it answers the eviction: its first `checkpoint_started`,
    `checkpoint_skipped` or `exiting` after the eviction was sent (or its exit, if it
    was killed). A checkpoint's work ends when its save began (`checkpoint_started` of
    its step); without a committed checkpoint the work since the rank's trap was
    ready (training began) counts.
    """
    if event.signal_sent_at is None:
        return None
    evicted = event.signal_sent_at.timestamp()
    attempt = event.victim_attempt
    started = (attempt.launched_at or attempt.admitted_at).timestamp()
    total = 0.0
    for rank in ranks:
        mine = sorted((e for e in events if e.rank == rank.index), key=lambda e: e.at)
        answers = [
            e.at
            for e in mine
            if e.at >= evicted
            and e.event in ("checkpoint_started", "checkpoint_skipped", "exiting")
        ]
        if answers:
            stop = answers[0]
        elif rank.exited_at is not None:
            stop = rank.exited_at.timestamp()
        else:
            return None
        committed = [e.step for e in mine if e.event == "checkpoint_committed" and e.at <= stop]
        ready = [e.at for e in mine if e.event == "trap_ready"]
        base = ready[0] if ready else started
        if committed:
            step = max(s for s in committed if s is not None)
            began = [e.at for e in mine if e.event == "checkpoint_started" and e.step == step]
            base = min(began) if began else base
        total += max(0.0, stop - base) * gpus_per_rank
    return round(total, 3)


def _mean_stall(events: list[TrapEvent], *, background: bool) -> float | None:
    """Mean training stall of the committed saves of one kind (the trap reports it)."""
    stalls = [
        float(e.payload["stall"])
        for e in events
        if e.event == "checkpoint_committed"
        and "stall" in e.payload
        and bool(e.payload.get("background")) == background
    ]
    return round(sum(stalls) / len(stalls), 4) if stalls else None


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
