"""Between the database and the pure engine: build a `fairshare.Snapshot` from
the rows."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, models
from django.db.models import (
    BooleanField,
    Case,
    Exists,
    ExpressionWrapper,
    F,
    FloatField,
    Max,
    OuterRef,
    Q,
    TextField,
    When,
)
from django.db.models.functions import Cast
from django.utils import timezone

import fairshare
from preemption.models import (
    ACTIVE_STATES,
    WAITING_STATES,
    Attempt,
    Checkpoint,
    Job,
    JobState,
    PreemptionEvent,
    allowed_sizes,
    attempt_ranks,
)
from quotas.models import Node, PriorityClass, Quota, ResourceFlavor, Team
from quotas.selectors import priority_allowances, scheduling_policy

ENGINE_STATE = {
    JobState.PENDING: "pending",
    JobState.REQUEUED: "pending",
    JobState.ADMITTED: "running",
    JobState.RUNNING: "running",
    JobState.PREEMPTING: "terminating",
}


class _EpochSeconds(models.Func):
    """A timestamp with time zone as PostgreSQL's seconds since the epoch, a float.

    date_part answers a double precision, which reaches Python as a float:
    EXTRACT answers a numeric (PostgreSQL 14 and later), and the cast and Django's
    per-row conversion of a float expression took a fifth of the snapshot at
    Kueue's baseline peak (14,400 waiting jobs). The value needs no conversion."""

    template = "date_part('epoch', %(expressions)s)"
    output_field = FloatField()

    def get_db_converters(self, connection: Any) -> list[Any]:
        return []


def _seconds(field: str | Any) -> Any:
    """A timestamp column (or an aggregate of one) as seconds since the epoch, computed
    by PostgreSQL: a cycle reads every waiting job's submission time and every running
    job's admission and last checkpoint, and parsing tens of thousands of timestamps
    into aware datetimes took a tenth of a busy worker's time. Other databases answer
    the datetime, which `_seconds_of` turns into the same number."""
    expression = F(field) if isinstance(field, str) else field
    if connection.vendor == "postgresql":
        # The epoch of the instant itself, whatever the session's time zone.
        return _EpochSeconds(expression)
    return expression


def _seconds_of(value: float | datetime) -> float:
    return value.timestamp() if isinstance(value, datetime) else float(value)


def workload_id(job_id: int) -> str:
    return str(job_id)


def held_jobs() -> dict[int, str]:
    """Waiting jobs of a class their team may no longer use, with the reason.

    A team's classes may be narrowed after a job was submitted. Like a Slurm job
    whose QOS was taken away (InvalidQOS), such a job stays queued but never
    starts, and says why; a running one is left to finish.

    Held jobs are rare: the answer is found from the distinct (team, class) pairs of
    the waiting jobs, and only the jobs of a pair no longer allowed are read one by
    one (a few dozen pairs, where the waiting jobs may be thousands). A cycle finds
    the same answer from the rows its snapshot reads anyway (`read_snapshot`).
    """
    waiting = Job.objects.filter(state__in=WAITING_STATES)
    # Without the model's ordering: its columns would join the DISTINCT, and every
    # job would make a pair of its own.
    pairs = set(waiting.order_by().values_list("team_id", "priority_class_id").distinct())
    barred = _barred(pairs)
    if not barred:
        return {}
    which = models.Q()
    for team_id, class_id in barred:
        which |= models.Q(team_id=team_id, priority_class_id=class_id)
    return {
        job_id: barred[(team_id, class_id)]
        for job_id, team_id, class_id in waiting.filter(which).values_list(
            "id", "team_id", "priority_class_id"
        )
    }


def _barred(pairs: set[tuple[int, int]]) -> dict[tuple[int, int], str]:
    """Of these (team id, class id) pairs of waiting jobs, those whose team may no
    longer use the class, with the reason its jobs are held."""
    if not pairs:
        return {}
    allowances = priority_allowances(team_ids={team_id for team_id, _ in pairs})
    barred = {
        (team_id, class_id)
        for team_id, class_id in pairs
        if not allowances[team_id].allows_class_id(class_id)
    }
    if not barred:
        return {}
    names = dict(
        PriorityClass.objects.filter(pk__in={class_id for _, class_id in barred}).values_list(
            "pk", "name"
        )
    )
    return {
        (team_id, class_id): (
            f"held: team {allowances[team_id].team} may no longer use {names[class_id]} "
            f"(it may use {allowances[team_id].describe()}); cancel and resubmit in one of those"
        )
        for team_id, class_id in barred
    }


# Attempts that ended more than this many half-lives ago weigh under a thousandth
# and are left out of decayed usage.
USAGE_HALF_LIVES_KEPT = 10


def decayed_usage(*, now: datetime, half_life_seconds: float) -> dict[str, dict[str, float]]:
    """Each team's GPU-seconds per flavor, every second weighed down by half each
    ``half_life_seconds`` before ``now`` (Slurm's PriorityDecayHalfLife).

    Computed from the attempts, which record when each admission held its GPUs, rather
    than kept as a running counter: the figure then follows a changed half-life at once
    and cannot drift. An attempt held ``gpus`` over [start, end] adds
    ``gpus * h / ln 2 * (2^-((now - end) / h) - 2^-((now - start) / h))``.
    """
    horizon = half_life_seconds / math.log(2)
    oldest = now - timedelta(seconds=half_life_seconds * USAGE_HALF_LIVES_KEPT)
    usage: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    rows = (
        Attempt.objects.filter(admitted_at__lte=now)
        .filter(models.Q(ended_at__isnull=True) | models.Q(ended_at__gte=oldest))
        .values_list(
            "job__team__slug",
            "job__flavor__name",
            attempt_ranks(),
            "job__gpus_per_rank",
            "admitted_at",
            "ended_at",
        )
    )
    for team, flavor, ranks, gpus_per_rank, admitted_at, ended_at in rows:
        end = min(ended_at or now, now)
        start = min(admitted_at, end)
        weight = 2 ** (-(now - end).total_seconds() / half_life_seconds) - 2 ** (
            -(now - start).total_seconds() / half_life_seconds
        )
        usage[team][flavor] += ranks * gpus_per_rank * horizon * weight
    return {team: dict(flavors) for team, flavors in usage.items()}


# The workloads the last snapshot of this process built, by job id, with the values
# each was built from, and the names of the teams, classes and flavors then. A
# waiting job's workload depends on its row and those names alone, and most rows are
# the same from one cycle to the next, so a cycle reuses the object when they match
# rather than build thousands again (they are immutable). Replaced as a whole by each
# snapshot, so it holds only the jobs active then; a renamed team, class or flavor
# starts it afresh.
Names = tuple[dict[int, str], dict[int, str], dict[int, str]]
Built = dict[int, tuple[tuple[Any, ...], fairshare.Workload]]
_built_before: tuple[Names | None, Built] = (None, {})


def _built_with(names: Names) -> Built:
    kept_names, built = _built_before
    return built if kept_names == names else {}


def _keep_built(names: Names, built: Built) -> None:
    global _built_before
    _built_before = (names, built)


def _workload(
    row: tuple[Any, ...],
    engine_state: str,
    names: Names,
    attempt: tuple[list[dict[str, Any]], float, int | None] | None = None,
    checkpoint: float | None = None,
    resizable: bool = False,
    gave_way_to: int | None = None,
) -> fairshare.Workload:
    """The workload of one row of `read_snapshot`'s jobs query; for running work, with
    where its open attempt runs, since when, and its last checkpoint of that attempt
    (a checkpoint of an earlier attempt is not one of this admission's); for a job
    being preempted, the job its GPUs are freed for; for a requeued victim, the
    waiting job it gave way to (`gave_way_to`, see `_gave_way`). An elastic job's row
    carries its `rank_sizes` as JSON text, a fixed one's none."""
    (
        job_id,
        team_id,
        class_id,
        flavor_id,
        ranks,
        gpus_per_rank,
        _,
        submitted_at,
        topology_level,
        topology_required,
        _,
        ranks_min,
        rank_sizes,
    ) = row
    team_slugs, class_names, flavor_names = names
    # A waiting elastic job may start at any of its sizes; a running one is as
    # large as its attempt's placement, and is offered its sizes only where its
    # class lets the engine resize it (`resizable`), at a size among them.
    # (The engine refuses sizes beside a topology, which submission refuses too.)
    elastic = ranks_min is not None and not topology_level
    sizes = (
        allowed_sizes(ranks, ranks_min, json.loads(rank_sizes) if rank_sizes else [])
        if elastic
        else ()
    )
    placement: tuple[tuple[str, int], ...] = ()
    admitted_at = None
    preemptor = None if gave_way_to is None else workload_id(gave_way_to)
    if attempt is not None:
        if engine_state == "terminating" and attempt[2] is not None:
            preemptor = workload_id(attempt[2])
        placement = tuple((entry["node"], int(entry["ranks"])) for entry in attempt[0])
        ranks = sum(count for _, count in placement)
        if not resizable or engine_state != "running" or ranks not in sizes:
            sizes = ()
        admitted_at = attempt[1]
        if checkpoint is not None and checkpoint < admitted_at:
            checkpoint = None
    return fairshare.Workload(
        id=workload_id(job_id),
        queue=team_slugs[team_id],
        priority_class=class_names[class_id],
        flavor=flavor_names[flavor_id],
        ranks=ranks,
        gpus_per_rank=gpus_per_rank,
        state=engine_state,
        submitted_at=_seconds_of(submitted_at),
        admitted_at=admitted_at,
        placement=placement,
        last_checkpoint_at=checkpoint,
        topology_level=topology_level or None,
        topology_required=topology_required,
        preemptor=preemptor,
        sizes=sizes,
    )


def _resizing(
    row: tuple[Any, ...],
    names: Names,
    attempt: tuple[list[dict[str, Any]], float, int | None],
    resize: tuple[list[dict[str, Any]], float],
) -> list[fairshare.Workload]:
    """The workloads of a job whose running gang is being stopped to be relaunched at
    another size (a stop of reason `resize`), from the decision to the relaunch.

    The GPUs it runs on after the resize are already its: it is planned as running at
    its new size on its new placement since the decision (which the engine's anti-flap
    margin counts from), with no sizes offered, so that no other work is placed on a
    GPU it keeps, nor on a free GPU a grow gave it, while its old ranks stop. What a
    shrink gives up is a gang of its own in its grace window, freeing those GPUs for
    the job the shrink was for exactly as a victim frees its GPUs for its preemptor. Its
    id is the job's with a suffix that names the shrink, which is how a waiting job's
    reason names it; the cycle never acts on it (the engine neither admits, preempts
    nor resizes a workload that is terminating)."""
    target, decided = resize
    placement = tuple((entry["node"], int(entry["ranks"])) for entry in target)
    resized = _workload(row, "running", names, (target, decided, None))
    freed: dict[str, int] = {}
    for entry in attempt[0]:
        freed[entry["node"]] = freed.get(entry["node"], 0) + int(entry["ranks"])
    for node, ranks in placement:
        freed[node] = freed.get(node, 0) - ranks
    gone = tuple((node, ranks) for node, ranks in freed.items() if ranks > 0)
    if not gone:
        return [resized]
    shrinking = _workload(row, "terminating", names, ([], decided, attempt[2]))
    return [
        resized,
        dataclasses.replace(
            shrinking,
            id=f"{shrinking.id} (shrinking)",
            ranks=sum(ranks for _, ranks in gone),
            placement=gone,
        ),
    ]


def _gave_way() -> dict[int, int]:
    """Each requeued victim whose preemptor still waits, with that preemptor.

    Once a victim has exited and waits again, the GPUs it freed are free GPUs: only the
    order of the next plan gives them to the job they were freed for. A victim inside
    its own guarantee goes by age, often before that job, and a job moved aside by a
    consolidation would take back the node cleared for it; named here, each is planned
    after its preemptor (`fairshare.Workload.preemptor`). Only the stop that requeued
    the victim counts (none of its attempts came after it), and only while its
    preemptor has not started since (one admitted and requeued again owes it nothing):
    a handful of rows, the victims and preemptors both waiting."""
    newer_attempt = Attempt.objects.filter(
        job=OuterRef("job_id"), number__gt=OuterRef("victim_attempt__number")
    )
    started_since = Attempt.objects.filter(
        job=OuterRef("preemptor_id"), admitted_at__gte=OuterRef("decided_at")
    )
    return dict(
        PreemptionEvent.objects.filter(
            job__state=JobState.REQUEUED,
            preemptor__state__in=WAITING_STATES,
            reason__in=[
                PreemptionEvent.Reason.RECLAIM,
                PreemptionEvent.Reason.PRIORITY,
                PreemptionEvent.Reason.FAIR_SHARE,
                PreemptionEvent.Reason.CONSOLIDATE,
            ],
        )
        .exclude(Exists(newer_attempt))
        .exclude(Exists(started_since))
        .order_by("decided_at")
        .values_list("job_id", "preemptor_id")
    )


def build_snapshot(
    *, now: datetime | None = None, held: dict[int, str] | None = None
) -> fairshare.Snapshot:
    """Everything the engine needs, in a fixed number of queries (`read_snapshot`), for
    a look now and then (a page's preview): it neither reuses nor keeps workloads."""
    return read_snapshot(now=now, held=held, reuse=False)[0]


# What each waiting job shows as it was read: its waiting reason, and until when the
# victims it waits for are protected.
Shown = dict[int, tuple[str, datetime | None]]
# The columns of `read_snapshot`'s jobs query that a workload is built from; the two
# after them are what the job shows (`Shown`).
WORKLOAD_COLUMNS = 13


def read_snapshot(
    *, now: datetime | None = None, held: dict[int, str] | None = None, reuse: bool = True
) -> tuple[fairshare.Snapshot, dict[int, str], Shown]:
    """Everything the engine needs, in a fixed number of queries; the held jobs
    (`held_jobs`), which are left out: they cannot start; and what every waiting job
    shows. Unless given, the held jobs are found from the waiting jobs' rows read here,
    which spares a cycle a second pass over every waiting job; so does what they show,
    against which the cycle writes only the reasons that changed.

    With `reuse`, the workloads of this process's last such snapshot are reused where
    unchanged, and this one's are kept for the next (`_built_before`): the processes
    that run cycles, many a second, keep the active jobs' workloads in memory."""
    now = now or timezone.now()
    # The jobs first, by the ids of their team, class and flavor rather than joined to
    # their names: the joins cost a busy cycle more than reading the few names after.
    # Those rows cannot go away meanwhile, since a job protects what it refers to.
    # Waiting jobs backing off (`not_before`) are read for the held ones, not planned.
    # Unsorted: the engine orders each queue's work itself, and sorting the rows by the
    # model's default order cost PostgreSQL a third of the query at Kueue's baseline peak.
    jobs = list(
        Job.objects.filter(state__in=list(ENGINE_STATE))
        .order_by()
        .annotate(
            submitted=_seconds("submitted_at"),
            backing_off=ExpressionWrapper(Q(not_before__gt=now), output_field=BooleanField()),
            # Only an elastic job's sizes, as JSON text that `_workload` decodes: a fixed
            # job's are an empty list, and Django's decoding of that JSON in each of
            # 50,000 waiting jobs' rows took a third of a steady cycle's snapshot.
            sizes=Case(
                When(ranks_min__isnull=False, then=Cast("rank_sizes", TextField())),
                default=None,
                output_field=TextField(),
            ),
        )
        .values_list(
            "id",
            "team_id",
            "priority_class_id",
            "flavor_id",
            "ranks",
            "gpus_per_rank",
            "state",
            "submitted",
            "topology_level",
            "topology_required",
            "backing_off",
            "ranks_min",
            "sizes",
            "waiting_reason",
            "protected_until",
        )
    )
    waiting = [row for row in jobs if row[6] in WAITING_STATES]
    shown = {row[0]: (row[13], row[14]) for row in waiting}
    if held is None:
        barred = _barred({(row[1], row[2]) for row in waiting})
        held = {row[0]: barred[(row[1], row[2])] for row in waiting if (row[1], row[2]) in barred}
    levels = settings.QM_TOPOLOGY_LABELS
    nodes = tuple(
        fairshare.Node(
            name=name,
            flavor=flavor,
            gpus=gpus,
            topology={
                level: str(labels[key])
                for level, key in levels.items()
                if isinstance(labels, dict) and key in labels
            },
        )
        for name, flavor, gpus, labels in Node.objects.filter(schedulable=True)
        .order_by("name")
        .values_list("name", "flavor__name", "gpus", "labels")
    )
    quotas: dict[int, dict[str, fairshare.FlavorQuota]] = defaultdict(dict)
    for team_id, flavor, guarantee, borrow_limit, lend_limit in Quota.objects.values_list(
        "team_id", "flavor__name", "guarantee", "borrow_limit", "lend_limit"
    ):
        quotas[team_id][flavor] = fairshare.FlavorQuota(
            guarantee=guarantee, borrow_limit=borrow_limit, lend_limit=lend_limit
        )
    teams = list(Team.objects.values_list("id", "slug", "parent__slug", "weight"))
    policy = scheduling_policy()
    strength = policy.usage_strength
    half_life = policy.usage_half_life_seconds
    # Without a strength the engine ignores usage: spare the query.
    recent = decayed_usage(now=now, half_life_seconds=half_life) if strength > 0 else {}
    queues = tuple(
        fairshare.Queue(
            name=slug,
            parent=parent,
            weight=weight,
            quotas=quotas.get(team_id, {}),
            recent_usage=recent.get(slug, {}),
        )
        for team_id, slug, parent, weight in teams
    )
    priority_classes = list(PriorityClass.objects.all())
    class_names = {pc.pk: pc.name for pc in priority_classes}
    flavor_names = dict(ResourceFlavor.objects.values_list("pk", "name"))
    team_slugs = {team_id: slug for team_id, slug, _, _ in teams}
    classes = tuple(
        fairshare.PriorityClass(
            name=pc.name,
            value=pc.value,
            preemption_policy=pc.preemption_policy,
            preemptible=pc.preemptible,
            grace_seconds=float(pc.grace_seconds),
            min_runtime_seconds=float(pc.min_runtime_seconds),
            min_runtime_by_reason=pc.min_runtime_by_reason(),
            shrink_elastic=pc.shrink_elastic,
        )
        for pc in priority_classes
    )
    resizing = {pc.pk for pc in priority_classes if pc.shrink_elastic}
    # The active jobs' attempts and checkpoints are found by a join on the job's state
    # rather than by a list of the active jobs' ids: such a list, thousands of
    # parameters long, cost more to build and send than the rows it selects. A job that
    # changes state between the queries is either left out here (and then taken for one
    # being wound up, as below) or read here and not used.
    # With the job a victim's GPUs are freed for, which the engine keeps them for.
    # A job being resized is read with its target, the size and placement it is
    # relaunched at, and since when (see `_resizing`).
    open_attempts = {}
    resizes: dict[int, tuple[list[dict[str, Any]], float]] = {}
    for job_id, placement, admitted_at, preemptor, reason, target, decided in (
        Attempt.objects.filter(job__state__in=ACTIVE_STATES, ended_at__isnull=True)
        .annotate(admitted=_seconds("admitted_at"), decided=_seconds("preemption__decided_at"))
        .values_list(
            "job_id",
            "placement",
            "admitted",
            "preemption__preemptor_id",
            "preemption__reason",
            "preemption__resize_placement",
            "decided",
        )
    ):
        open_attempts[job_id] = (placement, _seconds_of(admitted_at), preemptor)
        if reason == PreemptionEvent.Reason.RESIZE:
            resizes[job_id] = (target, _seconds_of(decided))
    checkpoints = {
        job_id: _seconds_of(last)
        for job_id, last in Checkpoint.objects.filter(job__state__in=ACTIVE_STATES)
        .values("job_id")
        .annotate(last=_seconds(Max("committed_at")))
        .values_list("job_id", "last")
    }
    gave_way = _gave_way()
    workloads = []
    names = (team_slugs, class_names, flavor_names)
    built: Built = {}
    earlier = _built_with(names) if reuse else {}
    for whole in jobs:
        job_id, state, backing_off = whole[0], whole[6], whole[10]
        if job_id in held:
            continue
        row = whole[:WORKLOAD_COLUMNS]
        engine_state = ENGINE_STATE[state]
        gave_way_to = None
        if engine_state == "pending":
            if backing_off:
                continue
            gave_way_to = gave_way.get(job_id)
            source: tuple[Any, ...] = row if gave_way_to is None else (row, gave_way_to)
            attempt = checkpoint = None
            resizable = False
        else:
            attempt = open_attempts.get(job_id)
            if attempt is None:
                # An active job without an open attempt is being wound up by the
                # reconciler; its GPUs are already free.
                continue
            checkpoint = checkpoints.get(job_id)
            if job_id in resizes:
                # Rare and short-lived: built afresh each time, never kept.
                workloads += _resizing(row, names, attempt, resizes[job_id])
                continue
            # Whether its class lets it be resized decides whether it is offered its
            # sizes, so a change of the class's flag builds it again.
            resizable = row[2] in resizing
            source = (row, attempt[1], checkpoint, attempt[0], attempt[2], resizable)
        kept = earlier.get(job_id)
        if kept is not None and kept[0] == source:
            workload = kept[1]
        else:
            workload = _workload(
                row, engine_state, names, attempt, checkpoint, resizable, gave_way_to
            )
        built[job_id] = (source, workload)
        workloads.append(workload)
    if reuse:
        _keep_built(names, built)
    snapshot = fairshare.Snapshot(
        now=now.timestamp(),
        nodes=nodes,
        queues=queues,
        priority_classes=classes,
        workloads=tuple(workloads),
        priority_min_runtime_seconds=float(policy.priority_min_runtime_seconds),
        fair_share_min_runtime_seconds=float(policy.fair_share_min_runtime_seconds),
        reclaim_min_runtime_seconds=float(policy.reclaim_min_runtime_seconds),
        consolidation_min_runtime_seconds=float(policy.consolidation_min_runtime_seconds),
        usage_strength=strength,
        usage_half_life_seconds=half_life,
    )
    return snapshot, held, shown
