"""The drill's measurements: a round's figures from the database and the trap's
events (signal propagation, checkpoints, exit codes, lost GPU-seconds, stalls),
the scan for orphaned ranks and ports, and the chaos checks. Reads what a round
left; submits, cancels and kills nothing.
"""

from __future__ import annotations

import json
import math
import os
import socket
from collections.abc import Iterable
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from drills.base import DrillBase
from drills.integrity import compare_with_reference
from drills.result import RoundFigures
from preemption.ingest import fingerprint
from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank, TrapEvent
from preemption.runtime import get_runtime
from preemption.runtimes import iter_log_chunks, iter_trap_events_in_chunks, processes
from preemption.runtimes.base import GangId

# The trap's events by which a rank learns of a stop: its own signal or notice, another
# rank's signal passed on by the gang's relay, or the save (or skip) of the step its
# gang agreed to stop at.
TOLD_BY_SIGNAL = ("signal_received", "notice_received", "stop_heard")
TOLD_BY_AGREEMENT = ("checkpoint_started", "checkpoint_skipped")


def stop_reached(
    events: Iterable[TrapEvent], *, decided: float, agreed_step: int | None
) -> dict[int, float]:
    """When each rank of a victim learned of its stop (rank -> the trap's clock), from
    the events of the victim's attempt after the decision: its own signal or notice,
    another rank's signal that the gang's relay passed on, or the checkpoint of the step the gang agreed on (`agreed_step`, the step its
    checkpoint was taken at), whichever came first. On Kubernetes each rank's node
    signals it when its kubelet gets to the eviction; the first signal stops the whole
    gang at the next step, so a rank may stop, at the agreed step, before its own
    signal arrives. A periodic checkpoint of another step tells nothing."""
    told: dict[int, float] = {}
    for event in sorted(events, key=lambda event: event.at):
        if event.at < decided:
            continue
        by_agreement = (
            event.event in TOLD_BY_AGREEMENT
            and agreed_step is not None
            and event.step == agreed_step
        )
        if event.event in TOLD_BY_SIGNAL or by_agreement:
            told.setdefault(event.rank, event.at)
    return told


class DrillMeasurements(DrillBase):
    """Measures what a drill round left behind."""

    # -- measuring -----------------------------------------------------------------

    def measure(
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
        told = stop_reached(victim_events, decided=decided, agreed_step=event.checkpoint_step)
        propagation = (
            round(max(told.values()) - decided, 4) if len(told) == len(ranks) and told else None
        )
        if notice:
            # The notice is the first word that reaches the ranks. Where it is polled,
            # only rank 0 receives it and the gang's relay passes it on; a rank that
            # missed the relay knows at the step boundary where the notice's save begins.
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
            ranks_told=len(told),
            signal_sent_seconds=round(event.signal_sent_at.timestamp() - decided, 4)
            if event.signal_sent_at
            else None,
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

    def master_port(self, attempt: Attempt) -> int | None:
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
            for rank in range(attempt.world_size):
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
