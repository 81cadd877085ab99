"""Writes to jobs from people: submit and cancel. The scheduling cycle and the
reconcilers, which act for the system, live in cycle.py and reconcile.py."""

from __future__ import annotations

import secrets
from pathlib import Path

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from preemption.models import FINAL_STATES, WAITING_STATES, Job, JobState
from preemption.reconcile import request_stop
from preemption.wakeup import queue_cycle
from preemption.webhooks import notify
from quotas.models import Node, PriorityClass, ResourceFlavor, Team
from quotas.selectors import team_tree

MAX_RANKS = 4096
MAX_COMMAND = 20_000


@transaction.atomic
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
) -> Job:
    errors: dict[str, list[str]] = {}
    if not team_tree().is_leaf(team.pk):
        errors["team"] = [f"Team {team.slug} has sub-teams; jobs are submitted to leaf teams."]
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
        errors["ranks"] = [f"Must be a whole number from 1 to {MAX_RANKS} (got {ranks})."]
    if isinstance(gpus_per_rank, bool) or not isinstance(gpus_per_rank, int) or gpus_per_rank < 1:
        errors["gpus_per_rank"] = [f"Must be a whole number of at least 1 (got {gpus_per_rank})."]
    else:
        largest = max(Node.objects.filter(flavor=flavor).values_list("gpus", flat=True), default=0)
        if gpus_per_rank > largest:
            errors["gpus_per_rank"] = [
                f"No node of flavor {flavor.name} has {gpus_per_rank} GPUs (the largest has {largest})."
            ]
    if not command or not command.strip():
        errors["command"] = ["A command is required."]
    elif len(command) > MAX_COMMAND:
        errors["command"] = [f"Must be at most {MAX_COMMAND} characters."]
    if env is not None and (
        not isinstance(env, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        errors["env"] = ["Must be an object of string names to string values."]
    if priority_class is None:
        priority_class = PriorityClass.objects.filter(is_default=True).first()
        if priority_class is None:
            errors["priority_class"] = ["No priority class given and none is the default."]
    if errors:
        raise ValidationError(errors)
    assert priority_class is not None
    job = Job.objects.create(
        name=name[:120],
        team=team,
        submitter=submitter,
        priority_class=priority_class,
        flavor=flavor,
        ranks=ranks,
        gpus_per_rank=gpus_per_rank,
        command=command,
        image=image,
        env=env or {},
        events_token=secrets.token_urlsafe(24),
        max_attempts=max_attempts or settings.QM_MAX_ATTEMPTS,
        waiting_reason="waiting for the next scheduling cycle",
    )
    job.checkpoint_dir = str(Path(settings.QM_CHECKPOINTS_DIR) / f"job-{job.pk}")
    job.save(update_fields=["checkpoint_dir"])
    queue_cycle()
    return job


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
