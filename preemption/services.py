"""Writes to jobs from people: submit and cancel. The scheduling cycle and the
reconcilers, which act for the system, live in cycle.py and reconcile/."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from core.access import TeamTree
from core.rows import update_rows
from preemption import job_rules
from preemption.models import FINAL_STATES, WAITING_STATES, Job, JobState
from preemption.reconcile import request_stop
from preemption.runtime import checkpoint_dir_for
from preemption.wakeup import queue_cycle
from preemption.webhooks import notify
from quotas.limits import image_allow_lists, queued_job_limits
from quotas.models import Node, PriorityClass, ResourceFlavor, Team
from quotas.selectors import PriorityAllowance, priority_allowances, team_tree, topology_levels

MAX_RANKS = 4096
MAX_COMMAND = job_rules.MAX_COMMAND
MAX_ATTEMPTS = 100
MAX_RETRIES = 20
# The engine does not search a topology's domains for each size of an elastic job.
ELASTIC_TOPOLOGY = "An elastic job cannot ask for a topology yet; give it a fixed number of ranks."
# Jobs in one batch (POST /jobs/batch/): a sweep's worth, answered in one request.
MAX_BATCH = 500


@dataclass(frozen=True)
class JobRequest:
    """One job as a person asks for it: `ranks` × `gpus_per_rank` GPUs of `flavor`
    for the leaf team `team`. The fields are checked by `job_submit_many`, not here:
    a request is what came in, right or wrong."""

    team: Team
    flavor: ResourceFlavor
    ranks: int
    gpus_per_rank: int
    command: str
    priority_class: PriorityClass | None = None
    # An elastic job's smallest size, and the only sizes it runs at (None: every
    # size from ranks_min to ranks); both None for a fixed-size job.
    ranks_min: int | None = None
    rank_sizes: list[int] | None = None
    name: str = ""
    image: str = ""
    env: dict[str, str] | None = None
    max_attempts: int | None = None
    retries: int = 0
    topology_level: str = ""
    topology_required: bool = True


def job_submit(
    *,
    submitter: AbstractBaseUser,
    team: Team,
    flavor: ResourceFlavor,
    ranks: int,
    gpus_per_rank: int,
    command: str,
    priority_class: PriorityClass | None = None,
    name: str = "",
    image: str = "",
    env: dict[str, str] | None = None,
    max_attempts: int | None = None,
    retries: int = 0,
    topology_level: str = "",
    topology_required: bool = True,
    ranks_min: int | None = None,
    rank_sizes: list[int] | None = None,
    tree: TeamTree | None = None,
) -> Job:
    """Queue a job of `ranks` × `gpus_per_rank` GPUs for a leaf team.

    Refuses, naming each field and why, what can never run: a class the team
    may not use, more GPUs than the flavor's nodes have, a rank larger than
    any node, environment names execve() or the runtime cannot accept, an
    image that is not a reference, oversized text, more than MAX_RETRIES
    retries (how often a job that fails on its own runs again), and a topology
    level the cluster does not have.

    `tree` is the team tree when the caller has just read it (the API reads it
    for the access check); otherwise it is read here.

    `topology_level` asks for all ranks inside one domain of that level (a rack,
    say); with `topology_required` False the engine only prefers it.

    `ranks_min` makes the job elastic: it may run at any size from `ranks_min` to
    `ranks`, or only at the sizes `rank_sizes` lists (from `ranks_min` to `ranks`,
    both included). A minimum equal to `ranks` is a fixed-size job.
    """
    request = JobRequest(
        team=team,
        flavor=flavor,
        ranks=ranks,
        gpus_per_rank=gpus_per_rank,
        command=command,
        priority_class=priority_class,
        name=name,
        image=image,
        env=env,
        max_attempts=max_attempts,
        retries=retries,
        topology_level=topology_level,
        topology_required=topology_required,
        ranks_min=ranks_min,
        rank_sizes=rank_sizes,
    )
    try:
        return job_submit_many(submitter=submitter, requests=[request], tree=tree)[0]
    except BatchValidationError as error:
        raise ValidationError(error.per_request[0]) from None


class BatchValidationError(ValidationError):
    """Some requests of a batch were refused: `per_request` holds, in the batch's
    order, each request's fields and reasons ({} for a request that was fine); the
    message dict names each as `<place>.<field>`."""

    def __init__(self, per_request: list[dict[str, list[str]]]) -> None:
        super().__init__(
            {
                f"{i}.{field}": reasons
                for i, errors in enumerate(per_request)
                for field, reasons in errors.items()
            }
        )
        self.per_request = per_request


def job_submit_many(
    *,
    submitter: AbstractBaseUser,
    requests: Sequence[JobRequest],
    tree: TeamTree | None = None,
) -> list[Job]:
    """Queue every job of `requests`, or none: a sweep or a job array is submitted
    whole, so a refusal never leaves half of it queued.

    Each request is checked as `job_submit` checks one, and a batch with any
    refused request raises `BatchValidationError` with every request's reasons.
    An image outside the allow-lists of the team and the teams above it is
    refused by request; a batch that would leave the submitter or a team with
    more waiting jobs than allowed raises `QueueLimitReached`, and nothing is queued.
    What the checks read (the tree, the teams' priority allowances, the flavors'
    nodes) is read once for the batch, and the jobs are written with one insert,
    so a batch costs a fixed number of queries whatever its size. The caller
    checks that `submitter` may submit to each request's team.
    """
    # One read of the tree serves every check that walks it.
    tree = tree or team_tree()
    allowances = priority_allowances(team_ids={r.team.pk for r in requests}, tree=tree)
    node_gpus: dict[int, list[int]] = defaultdict(list)
    for flavor_id, gpus in Node.objects.filter(
        flavor_id__in={r.flavor.pk for r in requests}
    ).values_list("flavor_id", "gpus"):
        node_gpus[flavor_id].append(gpus)
    levels = topology_levels()
    images = image_allow_lists(team_ids={r.team.pk for r in requests}, tree=tree)
    per_request: list[dict[str, list[str]]] = []
    classes: list[PriorityClass] = []
    for request in requests:
        errors, priority_class = _request_errors(
            request, tree, allowances[request.team.pk], node_gpus[request.flavor.pk], levels
        )
        if (
            "image" not in errors
            and isinstance(request.image, str)
            and request.image
            and (
                reasons := job_rules.image_allowlist_errors(request.image, images[request.team.pk])
            )
        ):
            errors["image"] = reasons
        per_request.append(errors)
        if not errors:
            assert priority_class is not None
            classes.append(priority_class)
    if any(per_request):
        raise BatchValidationError(per_request)
    # Only the writes share a transaction: on SQLite it holds the database's one
    # write lock from its start, and the checks above only read.
    with transaction.atomic():
        _check_queue_limits(submitter=submitter, requests=requests, tree=tree)
        jobs = Job.objects.bulk_create(
            [
                Job(
                    name=r.name,
                    team=r.team,
                    submitter=submitter,
                    priority_class=priority_class,
                    flavor=r.flavor,
                    ranks=r.ranks,
                    **_elastic_fields(r),
                    gpus_per_rank=r.gpus_per_rank,
                    command=r.command,
                    image=r.image,
                    env=r.env or {},
                    # The retries asked for are all run unless max_attempts says otherwise.
                    max_attempts=r.max_attempts or max(settings.QM_MAX_ATTEMPTS, r.retries + 1),
                    retries=r.retries,
                    topology_level=r.topology_level,
                    topology_required=r.topology_required,
                    waiting_reason="waiting for the next scheduling cycle",
                )
                for r, priority_class in zip(requests, classes, strict=True)
            ]
        )
        # The folder's name carries the job's number, known once the row exists.
        for job in jobs:
            job.checkpoint_dir = checkpoint_dir_for(job.pk)
        update_rows(jobs, ["checkpoint_dir"])
        queue_cycle()
    return jobs


def _elastic_fields(request: JobRequest) -> dict[str, Any]:
    """The Job's `ranks_min` and `rank_sizes` for a request whose sizes were checked:
    none for a fixed size (a minimum equal to the maximum), the sizes ascending."""
    sizes = sorted(set(request.rank_sizes or []))
    if request.ranks_min is None or request.ranks_min == request.ranks:
        return {"ranks_min": None, "rank_sizes": []}
    return {"ranks_min": request.ranks_min, "rank_sizes": sizes}


class QueueLimitReached(ValidationError):
    """Queuing these jobs would pass a limit on waiting jobs (the submitter's or
    a team's, like Slurm's MaxSubmitJobs); nothing was queued."""


def _check_queue_limits(
    *, submitter: AbstractBaseUser, requests: Sequence[JobRequest], tree: TeamTree
) -> None:
    """Refuse the whole submission if it would leave the submitter, or any team,
    with more jobs waiting (pending or requeued) than allowed.

    Runs in the writing transaction with the submitter's and the teams' rows
    locked (on SQLite the transaction holds the database's write lock anyway),
    so two submissions at once cannot both pass the same count."""
    adding = Counter(r.team.pk for r in requests)
    list(Team.objects.select_for_update().filter(pk__in=sorted(adding)).values_list("pk"))
    list(get_user_model().objects.select_for_update().filter(pk=submitter.pk).values_list("pk"))
    waiting = Job.objects.filter(state__in=WAITING_STATES)
    reasons: dict[str, list[str]] = {}
    user_limit = settings.QM_MAX_QUEUED_JOBS_PER_USER
    mine = waiting.filter(submitter_id=submitter.pk).count()
    if mine + len(requests) > user_limit:
        reasons["submitter"] = [
            f"You may have at most {user_limit} queued jobs (you have {mine}); "
            f"{len(requests)} more would pass the limit."
        ]
    limits = queued_job_limits(team_ids=adding, tree=tree)
    counts = dict(
        waiting.filter(team_id__in=adding)
        .values("team_id")
        .annotate(n=Count("id"))
        .values_list("team_id", "n")
    )
    slugs = {r.team.pk: r.team.slug for r in requests}
    for team_id, more in sorted(adding.items()):
        limit, has = limits[team_id], counts.get(team_id, 0)
        if has + more > limit.limit:
            where = (
                "" if limit.set_by in (None, slugs[team_id]) else f" (set on team {limit.set_by})"
            )
            reasons.setdefault("team", []).append(
                f"team {slugs[team_id]} may have at most {limit.limit} queued jobs (it has "
                f"{has}){where}; {more} more would pass the limit."
            )
    if reasons:
        raise QueueLimitReached(reasons)


def _request_errors(
    request: JobRequest,
    tree: TeamTree,
    allowance: PriorityAllowance,
    node_gpus: list[int],
    levels: dict[str, str],
) -> tuple[dict[str, list[str]], PriorityClass | None]:
    """What is wrong with one request, by field, and the priority class it gets."""
    r = request
    errors: dict[str, list[str]] = {}
    if not tree.is_leaf(r.team.pk):
        errors["team"] = [f"Team {r.team.slug} has sub-teams; jobs are submitted to leaf teams."]
    ranks_ok = (
        not isinstance(r.ranks, bool) and isinstance(r.ranks, int) and 1 <= r.ranks <= MAX_RANKS
    )
    if not ranks_ok:
        errors["ranks"] = [f"Must be a whole number from 1 to {MAX_RANKS} (got {r.ranks})."]
    elif reasons := job_rules.rank_range_errors(r.ranks, r.ranks_min, r.rank_sizes):
        errors["ranks"] = reasons
    elif r.topology_level and _elastic_fields(r)["ranks_min"] is not None:
        errors["topology_level"] = [ELASTIC_TOPOLOGY]
    if (
        isinstance(r.gpus_per_rank, bool)
        or not isinstance(r.gpus_per_rank, int)
        or r.gpus_per_rank < 1
    ):
        errors["gpus_per_rank"] = [f"Must be a whole number of at least 1 (got {r.gpus_per_rank})."]
    else:
        errors.update(
            _capacity_errors(r.flavor, node_gpus, r.ranks if ranks_ok else 0, r.gpus_per_rank)
        )
    if not r.command or not r.command.strip():
        errors["command"] = ["A command is required."]
    elif reasons := job_rules.text_errors(r.command, limit=MAX_COMMAND):
        errors["command"] = reasons
    if reasons := job_rules.text_errors(r.name, limit=job_rules.MAX_NAME):
        errors["name"] = reasons
    if reasons := job_rules.image_errors(r.image):
        errors["image"] = reasons
    if r.env is not None and (
        not isinstance(r.env, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in r.env.items())
    ):
        errors["env"] = ["Must be an object of string names to string values."]
    elif r.env and (reasons := job_rules.env_errors(r.env)):
        errors["env"] = reasons
    if r.max_attempts is not None and (
        isinstance(r.max_attempts, bool)
        or not isinstance(r.max_attempts, int)
        or not 1 <= r.max_attempts <= MAX_ATTEMPTS
    ):
        errors["max_attempts"] = [f"Must be a whole number from 1 to {MAX_ATTEMPTS}."]
    if (
        isinstance(r.retries, bool)
        or not isinstance(r.retries, int)
        or not 0 <= r.retries <= MAX_RETRIES
    ):
        errors["retries"] = [f"Must be a whole number from 0 to {MAX_RETRIES} (got {r.retries})."]
    errors.update(topology_errors(r.topology_level, r.topology_required, levels))
    priority_class = r.priority_class
    if priority_class is None:
        priority_class = allowance.default
        if priority_class is None:
            errors["priority_class"] = [
                f"Team {r.team.slug} may use no priority class; an admin must allow one."
            ]
    elif not allowance.allows(priority_class):
        errors["priority_class"] = [
            f"Team {r.team.slug} may not use {priority_class.name}; "
            f"it may use: {allowance.describe()}."
        ]
    return errors, priority_class


def topology_errors(
    level: object, required: object, levels: dict[str, str] | None = None
) -> dict[str, list[str]]:
    errors: dict[str, list[str]] = {}
    levels = topology_levels() if levels is None else levels
    if not isinstance(level, str):
        errors["topology_level"] = ["Must be the name of a topology level, or empty."]
    elif level and level not in levels:
        known = ", ".join(levels) or "none"
        errors["topology_level"] = [
            f"Unknown topology level {level!r}; this cluster's levels are: {known}."
        ]
    if not isinstance(required, bool):
        errors["topology_required"] = ["Must be true or false."]
    return errors


@transaction.atomic
def job_topology_set(
    *, actor: AbstractBaseUser | None, job: Job, level: str, required: bool
) -> Job:
    """Change where a waiting job's ranks must (or should) sit: one domain of
    `level`, or anywhere with an empty level. A job that already holds GPUs keeps
    its placement, so only a waiting one may change. The caller checks that the
    actor may act on the job (its submitter, a manager above its team, an admin)."""
    job = Job.objects.select_for_update().get(pk=job.pk)
    errors = topology_errors(level, required)
    if job.state not in WAITING_STATES:
        errors["state"] = [
            f"Job {job.pk} is {job.state}; only a waiting job's topology may change."
        ]
    if level and job.elastic:
        errors["topology_level"] = [ELASTIC_TOPOLOGY]
    if errors:
        raise ValidationError(errors)
    job.topology_level = level
    job.topology_required = required
    job.save(update_fields=["topology_level", "topology_required"])
    queue_cycle()
    return job


def _capacity_errors(
    flavor: ResourceFlavor, nodes: list[int], ranks: int, gpus_per_rank: int
) -> dict[str, list[str]]:
    """What the flavor's nodes (`nodes`: each one's GPUs) can never hold. Every node
    of the flavor counts, cordoned ones too: a job that fits once they are back may
    wait for them."""
    largest = max(nodes, default=0)
    if gpus_per_rank > largest:
        where = (
            f"the largest {flavor.name} node has {largest}"
            if nodes
            else (f"the cluster has no {flavor.name} node")
        )
        plural = "s" if gpus_per_rank != 1 else ""
        return {"gpus_per_rank": [f"Each rank needs {gpus_per_rank} GPU{plural}; {where}."]}
    if not ranks:
        return {}
    total, capacity = ranks * gpus_per_rank, sum(nodes)
    if total > capacity:
        return {
            "ranks": [
                f"Needs {total:,} {flavor.name} GPUs ({ranks:,} × {gpus_per_rank}); "
                f"the cluster has {capacity:,}."
            ]
        }
    # A rank never spans nodes, so a node of 8 GPUs holds one rank of 5.
    fitting = sum(gpus // gpus_per_rank for gpus in nodes)
    if ranks > fitting:
        return {
            "ranks": [
                f"Needs {ranks:,} ranks of {gpus_per_rank} GPUs; the {flavor.name} nodes "
                f"can hold at most {fitting:,} such ranks."
            ]
        }
    return {}


@transaction.atomic
def job_cancel(*, actor: AbstractBaseUser | None, job: Job) -> Job:
    """Cancel a job: a waiting one at once, a running one gracefully (the
    reconciler signals its ranks, waits out the grace, then kills)."""
    job = Job.objects.select_for_update().get(pk=job.pk)
    if job.state in FINAL_STATES:
        raise ValidationError({"state": [f"Job {job.pk} is already {job.state}."]})
    now = timezone.now()
    if job.state in WAITING_STATES:
        job.state = JobState.CANCELLED
        job.finished_at = now
        job.cancel_requested_at = now
        job.waiting_reason = ""
        job.save(update_fields=["state", "finished_at", "cancel_requested_at", "waiting_reason"])
        notify(job_id=job.pk, event="finished", payload={"state": "cancelled"})
    elif job.cancel_requested_at is None:
        job.cancel_requested_at = now
        job.save(update_fields=["cancel_requested_at"])
        request_stop(job=job, reason="manual", cause=f"cancelled by {actor or 'the system'}")
    queue_cycle()
    return job
