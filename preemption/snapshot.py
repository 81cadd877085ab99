"""Between the database and the pure engine: build a `fairshare.Snapshot` from
the rows."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime

from django.db.models import Max
from django.utils import timezone

import fairshare
from preemption.models import WAITING_STATES, Attempt, Checkpoint, Job, JobState
from quotas.models import Node, PriorityClass, Quota, Team
from quotas.selectors import priority_allowances

ENGINE_STATE = {
    JobState.PENDING: "pending",
    JobState.REQUEUED: "pending",
    JobState.ADMITTED: "running",
    JobState.RUNNING: "running",
    JobState.PREEMPTING: "terminating",
}


def _ts(moment: datetime | None) -> float | None:
    return moment.timestamp() if moment is not None else None


def workload_id(job_id: int) -> str:
    return str(job_id)


def held_jobs() -> dict[int, str]:
    """Waiting jobs of a class their team may no longer use, with the reason.

    A team's classes may be narrowed after a job was submitted. Like a Slurm job
    whose QOS was taken away (InvalidQOS), such a job stays queued but never
    starts, and says why; a running one is left to finish.
    """
    waiting = list(
        Job.objects.filter(state__in=WAITING_STATES).values_list(
            "id", "team_id", "priority_class_id", "priority_class__name"
        )
    )
    if not waiting:
        return {}
    allowances = priority_allowances(team_ids={team_id for _, team_id, _, _ in waiting})
    held: dict[int, str] = {}
    for job_id, team_id, class_id, class_name in waiting:
        allowance = allowances[team_id]
        if not any(pc.pk == class_id for pc in allowance.allowed):
            held[job_id] = (
                f"held: team {allowance.team} may no longer use {class_name} "
                f"(it may use {allowance.describe()}); cancel and resubmit in one of those"
            )
    return held


def build_snapshot(
    *, now: datetime | None = None, held: dict[int, str] | None = None
) -> fairshare.Snapshot:
    """Everything the engine needs, in a fixed number of queries. Held jobs
    (`held_jobs`, computed here unless given) are left out: they cannot start."""
    now = now or timezone.now()
    held = held_jobs() if held is None else held
    nodes = tuple(
        fairshare.Node(name=name, flavor=flavor, gpus=gpus)
        for name, flavor, gpus in Node.objects.filter(schedulable=True)
        .order_by("name")
        .values_list("name", "flavor__name", "gpus")
    )
    quotas: dict[int, dict[str, fairshare.FlavorQuota]] = defaultdict(dict)
    for team_id, flavor, guarantee, borrow_limit, lend_limit in Quota.objects.values_list(
        "team_id", "flavor__name", "guarantee", "borrow_limit", "lend_limit"
    ):
        quotas[team_id][flavor] = fairshare.FlavorQuota(
            guarantee=guarantee, borrow_limit=borrow_limit, lend_limit=lend_limit
        )
    teams = list(Team.objects.values_list("id", "slug", "parent__slug", "weight"))
    queues = tuple(
        fairshare.Queue(name=slug, parent=parent, weight=weight, quotas=quotas.get(team_id, {}))
        for team_id, slug, parent, weight in teams
    )
    classes = tuple(
        fairshare.PriorityClass(
            name=pc.name,
            value=pc.value,
            preemption_policy=pc.preemption_policy,
            preemptible=pc.preemptible,
            grace_seconds=float(pc.grace_seconds),
            min_runtime_seconds=float(pc.min_runtime_seconds),
        )
        for pc in PriorityClass.objects.all()
    )
    jobs = list(
        Job.objects.filter(state__in=list(ENGINE_STATE))
        .exclude(state__in=[JobState.PENDING, JobState.REQUEUED], not_before__gt=now)
        .values_list(
            "id",
            "team__slug",
            "priority_class__name",
            "flavor__name",
            "ranks",
            "gpus_per_rank",
            "state",
            "submitted_at",
        )
    )
    active_ids = [job[0] for job in jobs if ENGINE_STATE[job[6]] != "pending"]
    open_attempts = {
        job_id: (placement, admitted_at)
        for job_id, placement, admitted_at in Attempt.objects.filter(
            job_id__in=active_ids, ended_at__isnull=True
        ).values_list("job_id", "placement", "admitted_at")
    }
    checkpoints = dict(
        Checkpoint.objects.filter(job_id__in=active_ids)
        .values("job_id")
        .annotate(last=Max("committed_at"))
        .values_list("job_id", "last")
    )
    workloads = []
    for job_id, team, pc, flavor, ranks, gpus_per_rank, state, submitted_at in jobs:
        if job_id in held:
            continue
        engine_state = ENGINE_STATE[state]
        placement: tuple[tuple[str, int], ...] = ()
        admitted_at = None
        last_checkpoint_at = None
        if engine_state != "pending":
            attempt = open_attempts.get(job_id)
            if attempt is None:
                # An active job without an open attempt is being wound up by the
                # reconciler; its GPUs are already free.
                continue
            placement = tuple((entry["node"], int(entry["ranks"])) for entry in attempt[0])
            admitted_at = _ts(attempt[1])
            checkpoint = checkpoints.get(job_id)
            if checkpoint is not None and attempt[1] is not None and checkpoint >= attempt[1]:
                last_checkpoint_at = _ts(checkpoint)
        workloads.append(
            fairshare.Workload(
                id=workload_id(job_id),
                queue=team,
                priority_class=pc,
                flavor=flavor,
                ranks=ranks,
                gpus_per_rank=gpus_per_rank,
                state=engine_state,
                submitted_at=submitted_at.timestamp(),
                admitted_at=admitted_at,
                placement=placement,
                last_checkpoint_at=last_checkpoint_at,
            )
        )
    return fairshare.Snapshot(
        now=now.timestamp(),
        nodes=nodes,
        queues=queues,
        priority_classes=classes,
        workloads=tuple(workloads),
    )
