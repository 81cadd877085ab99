"""Writes to jobs from people: submit and cancel. The scheduling cycle and the
reconcilers, which act for the system, live in cycle.py and reconcile.py."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from core.access import TeamTree
from preemption import job_rules
from preemption.models import FINAL_STATES, WAITING_STATES, Job, JobState
from preemption.reconcile import request_stop
from preemption.runtime import checkpoint_dir_for
from preemption.wakeup import queue_cycle
from preemption.webhooks import notify
from quotas.models import Node, PriorityClass, ResourceFlavor, Team
from quotas.selectors import priority_allowance, team_tree, topology_levels

MAX_RANKS = 4096
MAX_COMMAND = job_rules.MAX_COMMAND
MAX_ATTEMPTS = 100
MAX_RETRIES = 20


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
    """
    errors: dict[str, list[str]] = {}
    # One read of the tree serves both checks that walk it.
    tree = tree or team_tree()
    if not tree.is_leaf(team.pk):
        errors["team"] = [f"Team {team.slug} has sub-teams; jobs are submitted to leaf teams."]
    ranks_ok = not isinstance(ranks, bool) and isinstance(ranks, int) and 1 <= ranks <= MAX_RANKS
    if not ranks_ok:
        errors["ranks"] = [f"Must be a whole number from 1 to {MAX_RANKS} (got {ranks})."]
    if isinstance(gpus_per_rank, bool) or not isinstance(gpus_per_rank, int) or gpus_per_rank < 1:
        errors["gpus_per_rank"] = [f"Must be a whole number of at least 1 (got {gpus_per_rank})."]
    else:
        errors.update(_capacity_errors(flavor, ranks if ranks_ok else 0, gpus_per_rank))
    if not command or not command.strip():
        errors["command"] = ["A command is required."]
    elif reasons := job_rules.text_errors(command, limit=MAX_COMMAND):
        errors["command"] = reasons
    if reasons := job_rules.text_errors(name, limit=job_rules.MAX_NAME):
        errors["name"] = reasons
    if reasons := job_rules.image_errors(image):
        errors["image"] = reasons
    if env is not None and (
        not isinstance(env, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        errors["env"] = ["Must be an object of string names to string values."]
    elif env and (reasons := job_rules.env_errors(env)):
        errors["env"] = reasons
    if max_attempts is not None and (
        isinstance(max_attempts, bool)
        or not isinstance(max_attempts, int)
        or not 1 <= max_attempts <= MAX_ATTEMPTS
    ):
        errors["max_attempts"] = [f"Must be a whole number from 1 to {MAX_ATTEMPTS}."]
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
        errors["retries"] = [f"Must be a whole number from 0 to {MAX_RETRIES} (got {retries})."]
    errors.update(topology_errors(topology_level, topology_required))
    allowance = priority_allowance(team=team, tree=tree)
    if priority_class is None:
        priority_class = allowance.default
        if priority_class is None:
            errors["priority_class"] = [
                f"Team {team.slug} may use no priority class; an admin must allow one."
            ]
    elif not allowance.allows(priority_class):
        errors["priority_class"] = [
            f"Team {team.slug} may not use {priority_class.name}; "
            f"it may use: {allowance.describe()}."
        ]
    if errors:
        raise ValidationError(errors)
    assert priority_class is not None
    # Only the writes share a transaction: on SQLite it holds the database's one
    # write lock from its start, and the checks above only read.
    with transaction.atomic():
        job = Job.objects.create(
            name=name,
            team=team,
            submitter=submitter,
            priority_class=priority_class,
            flavor=flavor,
            ranks=ranks,
            gpus_per_rank=gpus_per_rank,
            command=command,
            image=image,
            env=env or {},
            # The retries asked for are all run unless max_attempts says otherwise.
            max_attempts=max_attempts or max(settings.QM_MAX_ATTEMPTS, retries + 1),
            retries=retries,
            topology_level=topology_level,
            topology_required=topology_required,
            waiting_reason="waiting for the next scheduling cycle",
        )
        job.checkpoint_dir = checkpoint_dir_for(job.pk)
        job.save(update_fields=["checkpoint_dir"])
        queue_cycle()
    return job


def topology_errors(level: object, required: object) -> dict[str, list[str]]:
    errors: dict[str, list[str]] = {}
    levels = topology_levels()
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
    if errors:
        raise ValidationError(errors)
    job.topology_level = level
    job.topology_required = required
    job.save(update_fields=["topology_level", "topology_required"])
    queue_cycle()
    return job


def _capacity_errors(
    flavor: ResourceFlavor, ranks: int, gpus_per_rank: int
) -> dict[str, list[str]]:
    """What the flavor's nodes can never hold. Every node of the flavor counts,
    cordoned ones too: a job that fits once they are back may wait for them."""
    nodes = list(Node.objects.filter(flavor=flavor).values_list("gpus", flat=True))
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
