"""Level-triggered reconcilers: compare what the database wants with what the
runtime observes right now, and move ranks and jobs forward.

Every step is idempotent and claims its row with a conditional update, so a
second reconcile of the same state, or two workers at once, change nothing
more: signals are sent once per preemption (a repeat is harmless), an attempt
is finished once, and a job is requeued once.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from preemption.event_tokens import attempt_events_token
from preemption.ingest import ingest_trap_event
from preemption.models import (
    ACTIVE_STATES,
    Attempt,
    Checkpoint,
    Job,
    JobState,
    PreemptionEvent,
    Rank,
    TrapEvent,
)
from preemption.runtime import get_runtime
from preemption.runtimes import iter_trap_events, read_whole_log
from preemption.runtimes.base import (
    GangId,
    GangSpec,
    RankObservation,
    RankPlacement,
    Runtime,
    RuntimePermanentError,
    RuntimeTemporaryError,
)
from preemption.wakeup import queue_cycle
from preemption.webhooks import notify

logger = logging.getLogger(__name__)

TERMINAL_PHASES = ("exited", "lost")


def _when(at: float | None) -> datetime | None:
    return datetime.fromtimestamp(at, tz=UTC) if at is not None else None


def events_url(job_id: int) -> str:
    return f"{settings.QM_PUBLIC_URL.rstrip('/')}/api/v1/jobs/{job_id}/events/"


def gang_spec(job: Job, attempt: Attempt, ranks: Iterable[Rank]) -> GangSpec:
    per_node: dict[str, int] = defaultdict(int)
    placements = []
    for rank in sorted(ranks, key=lambda r: r.index):
        placements.append(
            RankPlacement(rank=rank.index, node=rank.node, local_rank=per_node[rank.node])
        )
        per_node[rank.node] += 1
    env = {
        **{str(k): str(v) for k, v in (job.env or {}).items()},
        "QM_JOB_ID": str(job.pk),
        "QM_ATTEMPT": str(attempt.number),
        "QM_GRACE_SECONDS": str(job.priority_class.grace_seconds),
        "QM_CHECKPOINT_DIR": job.checkpoint_dir,
        "QM_EVENTS_URL": events_url(job.pk),
        # The attempt's own token: it expires when the attempt ends.
        "QM_EVENTS_TOKEN": attempt_events_token(attempt),
    }
    return GangSpec(
        job_id=job.pk,
        attempt=attempt.number,
        command=job.command,
        ranks=tuple(placements),
        gpus_per_rank=job.gpus_per_rank,
        grace_seconds=float(job.priority_class.grace_seconds),
        priority_class=job.priority_class.name,
        env=env,
        image=job.image or None,
        team=job.team.slug,
        flavor=job.flavor.name,
    )


def request_stop(
    *, job: Job, reason: str, cause: str, grace_seconds: float | None = None
) -> PreemptionEvent | None:
    """Record that a running job must stop gracefully (cancel, gang guard).
    The reconciler then signals every rank and enforces the deadline."""
    attempt = Attempt.objects.filter(job=job, ended_at__isnull=True).first()
    if attempt is None or PreemptionEvent.objects.filter(victim_attempt=attempt).exists():
        return None
    now = timezone.now()
    grace = float(job.priority_class.grace_seconds if grace_seconds is None else grace_seconds)
    Job.objects.filter(pk=job.pk, state__in=[JobState.ADMITTED, JobState.RUNNING]).update(
        state=JobState.PREEMPTING, preempting_at=now
    )
    return PreemptionEvent.objects.create(
        victim_attempt=attempt,
        job=job,
        reason=reason,
        cause=cause[:300],
        decided_at=now,
        grace_seconds=grace,
        deadline=now + timedelta(seconds=grace),
    )


def reconcile_jobs(*, job_ids: list[int] | None = None, runtime: Runtime | None = None) -> int:
    """Reconcile every open attempt of active jobs (or only those of `job_ids`).
    Returns how many attempts were looked at."""
    runtime = runtime or get_runtime()
    attempts = Attempt.objects.filter(
        ended_at__isnull=True, job__state__in=ACTIVE_STATES
    ).select_related("job", "job__team", "job__priority_class", "job__flavor")
    if job_ids is not None:
        attempts = attempts.filter(job_id__in=job_ids)
    attempts = list(attempts.order_by("id"))
    if not attempts:
        return 0
    observed: dict[tuple[int, int], list[RankObservation]] = defaultdict(list)
    try:
        if job_ids is not None and len(attempts) <= 4:
            for attempt in attempts:
                for obs in runtime.observe(GangId(attempt.job_id, attempt.number)):
                    observed[(obs.job_id, obs.attempt)].append(obs)
        else:
            for obs in runtime.observe(None):
                observed[(obs.job_id, obs.attempt)].append(obs)
    except RuntimeTemporaryError:
        logger.warning("runtime observation failed; retrying next cycle", exc_info=True)
        return 0
    # Runtimes that can tell a rank was taken away (kube-scheduler preemption,
    # node loss) even when it exited 0 name those gangs themselves.
    taken: set[tuple[int, int]] = set()
    guard = getattr(runtime, "guard_victims", None)
    if guard is not None:
        try:
            taken = {(gang.job_id, gang.attempt) for gang in guard()}
        except RuntimeTemporaryError:
            logger.warning("gang-guard observation failed; retrying next cycle", exc_info=True)
    for attempt in attempts:
        try:
            reconcile_attempt(
                attempt,
                observed.get((attempt.job_id, attempt.number), []),
                runtime,
                taken=(attempt.job_id, attempt.number) in taken,
            )
        except RuntimeTemporaryError:
            logger.warning(
                "temporary runtime error on %s; retrying next cycle", attempt, exc_info=True
            )
    return len(attempts)


def reconcile_attempt(
    attempt: Attempt, observations: list[RankObservation], runtime: Runtime, *, taken: bool = False
) -> None:
    job = attempt.job
    gang = GangId(job.pk, attempt.number)
    now = timezone.now()
    with transaction.atomic():
        ranks = {
            rank.index: rank for rank in Rank.objects.select_for_update().filter(attempt=attempt)
        }
        attempt.refresh_from_db(fields=["launched_at", "ended_at"])
        if attempt.ended_at is not None:
            return
        job.refresh_from_db(fields=["state", "cancel_requested_at", "env"])
        event = PreemptionEvent.objects.filter(victim_attempt=attempt).first()

        if not observations:
            if event is not None and attempt.launched_at is None:
                # Stopped before it ever started: nothing to signal.
                _finish_attempt(job, attempt, list(ranks.values()), event, runtime, now)
                return
            if attempt.launched_at is None:
                try:
                    runtime.launch(gang_spec(job, attempt, ranks.values()))
                except RuntimePermanentError as exc:
                    _fail_launch(job, attempt, str(exc), now)
                    return
                Attempt.objects.filter(pk=attempt.pk, launched_at__isnull=True).update(
                    launched_at=now
                )
                return
            # The observation may predate a launch another worker just made:
            # look again before calling the gang lost.
            observations = runtime.observe(gang)
            if not observations:
                # The runtime forgot a gang it launched: its ranks are lost.
                observations = [
                    RankObservation(
                        job.pk,
                        attempt.number,
                        r.index,
                        r.node,
                        "lost",
                        None,
                        "",
                        None,
                        now.timestamp(),
                        None,
                    )
                    for r in ranks.values()
                ]
        _record_observations(ranks, observations)
        phases = {index: rank.state for index, rank in ranks.items()}
        alive = [i for i, phase in phases.items() if phase not in TERMINAL_PHASES]

        if (job.state == JobState.ADMITTED and not alive) or (
            job.state == JobState.ADMITTED and all(p != "starting" for p in phases.values())
        ):
            Job.objects.filter(pk=job.pk, state=JobState.ADMITTED).update(
                state=JobState.RUNNING, running_at=now
            )

        if event is None:
            broken = [
                r
                for r in ranks.values()
                if r.state == "lost" or (r.state == "exited" and r.exit_code not in (0, None))
            ]
            if (broken or taken) and alive:
                first = broken[0] if broken else None
                if first is None:
                    cause = "a rank was taken away by the cluster"
                elif first.state == "lost":
                    cause = f"rank {first.index} was lost"
                else:
                    cause = f"rank {first.index} exited with code {first.exit_code}"
                event = request_stop(job=job, reason="gang-guard", cause=f"gang guard: {cause}")
                if event is not None:
                    notify(
                        job_id=job.pk,
                        event="preempted",
                        payload={"reason": "gang-guard", "cause": event.cause},
                    )

        if event is not None and alive:
            if event.signal_sent_at is None:
                remaining = max(0.0, (event.deadline - now).total_seconds())
                # Stamped before the call: ranks receive the signal while it
                # runs, and the record must not say it was sent after that.
                sent = timezone.now()
                runtime.signal(gang, remaining)
                PreemptionEvent.objects.filter(pk=event.pk, signal_sent_at__isnull=True).update(
                    signal_sent_at=sent
                )
                Rank.objects.filter(
                    attempt=attempt, signal_sent_at__isnull=True, index__in=alive
                ).update(signal_sent_at=sent)
            elif now >= event.deadline:
                runtime.kill(gang)
                if event.killed_at is None:
                    PreemptionEvent.objects.filter(pk=event.pk, killed_at__isnull=True).update(
                        killed_at=now
                    )
            return
        if not alive:
            _finish_attempt(job, attempt, list(ranks.values()), event, runtime, now)


def _record_observations(ranks: dict[int, Rank], observations: list[RankObservation]) -> None:
    """Write what changed, and only that."""
    for obs in observations:
        rank = ranks.get(obs.rank)
        if rank is None:
            continue
        changes: dict[str, Any] = {}
        state = obs.phase if obs.phase in Rank.State.values else "lost"
        if rank.state != state and rank.state not in TERMINAL_PHASES:
            changes["state"] = state
        if obs.exit_code is not None and rank.exit_code != obs.exit_code:
            changes["exit_code"] = obs.exit_code
        if obs.handle:
            if obs.handle.isdigit():
                if rank.pid != int(obs.handle):
                    changes["pid"] = int(obs.handle)
            elif rank.pod_name != obs.handle:
                changes["pod_name"] = obs.handle
        if obs.started_at is not None and rank.started_at is None:
            changes["started_at"] = _when(obs.started_at)
        if obs.exited_at is not None and rank.exited_at is None:
            changes["exited_at"] = _when(obs.exited_at)
        if obs.signal_sent_at is not None and rank.signal_sent_at is None:
            changes["signal_sent_at"] = _when(obs.signal_sent_at)
        if changes:
            for name, value in changes.items():
                setattr(rank, name, value)
            rank.save(update_fields=list(changes))


def ingest_logs(job: Job, attempt: Attempt, ranks: Iterable[Rank], runtime: Runtime) -> int:
    """Read every rank's QM_EVENT lines so no event is lost when its POST was."""

    added = 0
    gang = GangId(job.pk, attempt.number)
    for rank in ranks:
        try:
            log = read_whole_log(runtime, gang, rank.index)
        except (RuntimeTemporaryError, RuntimePermanentError, OSError):
            logger.warning("could not read the log of %s", rank, exc_info=True)
            continue
        for event in iter_trap_events(log):
            try:
                added += ingest_trap_event(attempt=attempt, event=event, source="log")
            except Exception as exc:
                logger.warning("ignoring a refused trap event in %s: %s", rank, exc)
    return added


def _fail_launch(job: Job, attempt: Attempt, message: str, now: datetime) -> None:
    Attempt.objects.filter(pk=attempt.pk, ended_at__isnull=True).update(
        ended_at=now, end_reason=Attempt.EndReason.FAILED
    )
    Job.objects.filter(pk=job.pk).update(
        state=JobState.FAILED, finished_at=now, failure_reason=message[:300]
    )
    notify(job_id=job.pk, event="failed", payload={"reason": message[:300]})


def _finish_attempt(
    job: Job,
    attempt: Attempt,
    ranks: list[Rank],
    event: PreemptionEvent | None,
    runtime: Runtime,
    now: datetime,
) -> None:
    """Every rank has exited: free the GPUs and decide what becomes of the job."""
    gang = GangId(job.pk, attempt.number)
    ingest_logs(job, attempt, ranks, runtime)
    try:
        orphaned = runtime.released_ports(gang) if attempt.launched_at is not None else []
    except (RuntimeTemporaryError, OSError):
        orphaned = []
    codes = [rank.exit_code for rank in ranks]
    exited_at = max((rank.exited_at for rank in ranks if rank.exited_at), default=now)
    failed = any(rank.state == "lost" or (rank.exit_code not in (0, None)) for rank in ranks)
    job.refresh_from_db()
    last_step = Checkpoint.objects.filter(job=job).aggregate(step=Max("step"))["step"]
    resume_step = (last_step + 1) if last_step is not None else job.resume_step

    if event is not None:
        reason = event.reason
        end_reason = {
            "manual": Attempt.EndReason.CANCELLED,
            "gang-guard": Attempt.EndReason.GANG_GUARD,
        }.get(reason, Attempt.EndReason.PREEMPTED)
        if job.cancel_requested_at is not None:
            end_reason = Attempt.EndReason.CANCELLED
    elif failed:
        end_reason = Attempt.EndReason.FAILED
    else:
        end_reason = Attempt.EndReason.SUCCEEDED

    claimed = Attempt.objects.filter(pk=attempt.pk, ended_at__isnull=True).update(
        ended_at=now, end_reason=end_reason, orphaned_ports=orphaned
    )
    if claimed != 1:
        return
    if event is not None:
        _close_event(event, attempt, job, exited_at, resume_step)

    update: dict[str, Any] = {"resume_step": resume_step}
    if end_reason == Attempt.EndReason.SUCCEEDED:
        update.update(state=JobState.SUCCEEDED, finished_at=now)
        notice = ("finished", {"state": "succeeded", "exit_codes": codes})
    elif end_reason == Attempt.EndReason.CANCELLED:
        update.update(state=JobState.CANCELLED, finished_at=now)
        notice = ("finished", {"state": "cancelled", "exit_codes": codes})
    elif end_reason == Attempt.EndReason.PREEMPTED:
        update.update(
            state=JobState.REQUEUED,
            requeued_at=now,
            waiting_reason="requeued after preemption; waiting for GPUs",
        )
        notice = ("requeued", {"resume_step": resume_step, "reason": event.reason if event else ""})
    else:
        # A failed rank: retry with backoff until the attempts run out.
        attempts = Attempt.objects.filter(job=job).count()
        broken = next((r for r in ranks if r.state == "lost" or r.exit_code not in (0, None)), None)
        why = (event.cause if event is not None else "") or (
            f"rank {broken.index} exited with code {broken.exit_code}"
            if broken
            else "a rank failed"
        )
        if attempts >= job.max_attempts:
            update.update(
                state=JobState.FAILED,
                finished_at=now,
                failure_reason=f"{why}; gave up after {attempts} attempts"[:300],
            )
            notice = ("failed", {"reason": update["failure_reason"], "exit_codes": codes})
        else:
            backoff = settings.QM_RETRY_BACKOFF_SECONDS * (2 ** (attempts - 1))
            update.update(
                state=JobState.REQUEUED,
                requeued_at=now,
                not_before=now + timedelta(seconds=backoff),
                waiting_reason=f"{why}; retrying in {backoff:.0f} s (attempt {attempts + 1} of {job.max_attempts})"[
                    :300
                ],
            )
            notice = ("requeued", {"reason": why, "resume_step": resume_step})
    Job.objects.filter(pk=job.pk).update(**update)
    notify(job_id=job.pk, event=notice[0], payload=notice[1])
    try:
        runtime.forget(gang)
    except (RuntimeTemporaryError, OSError):
        logger.warning("could not forget %s", gang, exc_info=True)
    queue_cycle()


def _close_event(
    event: PreemptionEvent,
    attempt: Attempt,
    job: Job,
    exited_at: datetime,
    resume_step: int | None,
) -> None:
    event.refresh_from_db()
    skipped = TrapEvent.objects.filter(
        job=job, attempt=attempt.number, event="checkpoint_skipped"
    ).exists()
    if event.killed_at is not None:
        outcome = PreemptionEvent.Outcome.KILLED
    elif skipped:
        outcome = PreemptionEvent.Outcome.CHECKPOINT_SKIPPED
    else:
        outcome = PreemptionEvent.Outcome.GRACEFUL
    last = (
        Checkpoint.objects.filter(job=job, attempt=attempt, committed_at__lte=exited_at)
        .order_by("-committed_at")
        .values_list("committed_at", flat=True)
        .first()
    )
    if last is not None and last >= event.decided_at:
        lost = 0.0
    else:
        base = last or attempt.launched_at or attempt.admitted_at
        lost = max(0.0, (exited_at - base).total_seconds()) * job.gpus
    requeue = (
        # Every stop but a person's own brings the job back.
        event.reason != PreemptionEvent.Reason.MANUAL and job.cancel_requested_at is None
    )
    PreemptionEvent.objects.filter(pk=event.pk).update(
        outcome=outcome,
        all_exited_at=exited_at,
        lost_gpu_seconds=lost,
        requeued_at=timezone.now() if requeue else None,
        resume_step=resume_step if requeue else None,
    )


@dataclass(frozen=True)
class ShutdownReport:
    """What stopping the runtime's ranks with the portal did."""

    jobs: int
    ranks: int
    killed: int


def _live_ranks(runtime: Runtime) -> dict[GangId, list[RankObservation]]:
    live: dict[GangId, list[RankObservation]] = defaultdict(list)
    for obs in runtime.observe(None):
        if obs.phase not in TERMINAL_PHASES:
            live[GangId(obs.job_id, obs.attempt)].append(obs)
    return dict(live)


def live_rank_count(*, runtime: Runtime | None = None) -> tuple[int, int]:
    """(jobs, ranks) the runtime runs now."""
    live = _live_ranks(runtime or get_runtime())
    return len(live), sum(len(ranks) for ranks in live.values())


def runtime_shutdown(
    *, grace_seconds: float, runtime: Runtime | None = None, poll_seconds: float = 0.25
) -> ShutdownReport:
    """Stop every rank the runtime runs because the portal that owns them stops:
    record a `shutdown` stop on each open attempt (so the next start requeues
    the job to resume from its checkpoint instead of taking the ranks' clean
    exit for success), send every gang the signal at once, wait up to
    `grace_seconds` for the ranks to exit, then kill what is left.

    Called after the worker and beat have stopped, so nothing launches or
    finishes an attempt meanwhile; the next reconcile finishes the attempts.
    """
    runtime = runtime or get_runtime()
    live = _live_ranks(runtime)
    if not live:
        return ShutdownReport(jobs=0, ranks=0, killed=0)
    now = timezone.now()
    for gang in live:
        attempt = Attempt.objects.filter(
            job_id=gang.job_id, number=gang.attempt, ended_at__isnull=True
        ).first()
        if attempt is None:
            continue
        job = Job.objects.select_related("priority_class").get(pk=gang.job_id)
        request_stop(
            job=job,
            reason=PreemptionEvent.Reason.SHUTDOWN,
            cause="the portal was stopped; the job resumes from its checkpoint at the next start",
            grace_seconds=grace_seconds,
        )
        PreemptionEvent.objects.filter(victim_attempt=attempt, signal_sent_at__isnull=True).update(
            signal_sent_at=now
        )
        Rank.objects.filter(attempt=attempt, signal_sent_at__isnull=True).update(signal_sent_at=now)
    for gang in live:
        runtime.signal(gang, grace_seconds)
    deadline = time.monotonic() + grace_seconds
    remaining = live
    while remaining and time.monotonic() < deadline:
        time.sleep(poll_seconds)
        remaining = _live_ranks(runtime)
    killed = 0
    if remaining:
        killed_at = timezone.now()
        for gang, ranks in remaining.items():
            runtime.kill(gang)
            killed += len(ranks)
            PreemptionEvent.objects.filter(
                victim_attempt__job_id=gang.job_id,
                victim_attempt__number=gang.attempt,
                killed_at__isnull=True,
            ).update(killed_at=killed_at)
    return ShutdownReport(
        jobs=len(live), ranks=sum(len(ranks) for ranks in live.values()), killed=killed
    )
