"""Builders of the rows many tests start from: teams with their quotas, jobs,
their attempts and ranks, and a job already running on an open attempt.

Each builder writes real rows and takes every field a test cares about as a
keyword, so a test states only what matters to it. Attempts are numbered by
`preemption.models.next_attempt_number`, like the scheduling cycle numbers them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.utils import timezone

from preemption.models import Attempt, Job, JobState, Rank, next_attempt_number
from quotas.models import Quota, ResourceFlavor, Team


def team(
    slug: str,
    *,
    name: str | None = None,
    parent: Team | None = None,
    quotas: dict[ResourceFlavor, int] | None = None,
    **fields: Any,
) -> Team:
    """A team, with a guarantee of each given flavor."""
    created = Team.objects.create(slug=slug, name=name or slug, parent=parent, **fields)
    for flavor, guarantee in (quotas or {}).items():
        Quota.objects.create(team=created, flavor=flavor, guarantee=guarantee)
    return created


def job(
    world: Any,
    team: Team,
    *,
    state: str = JobState.RUNNING,
    ranks: int = 1,
    gpus_per_rank: int = 1,
    submitter: Any = None,
    priority_class: Any = None,
    flavor: ResourceFlavor | None = None,
    command: str = "sleep 60",
    **fields: Any,
) -> Job:
    """A job of `team` in `state`, written directly (not through the services):
    by default a researcher's preemptible one-GPU job on h100."""
    return Job.objects.create(
        team=team,
        submitter=submitter or world.users["researcher"],
        priority_class=priority_class or world.batch,
        flavor=flavor or world.h100,
        ranks=ranks,
        gpus_per_rank=gpus_per_rank,
        command=command,
        state=state,
        **fields,
    )


def attempt(
    job: Job,
    *,
    node: str = "h100-node-0",
    admitted_at: datetime | None = None,
    number: int | None = None,
    **fields: Any,
) -> Attempt:
    """The job's next attempt, by default of the job's size (`ranks` says another, an
    elastic job's) with every rank placed on `node`."""
    fields.setdefault("ranks", job.ranks)
    fields.setdefault("placement", [{"node": node, "ranks": fields["ranks"]}])
    return Attempt.objects.create(
        job=job,
        number=number if number is not None else next_attempt_number(job.pk),
        admitted_at=admitted_at or timezone.now(),
        **fields,
    )


def ranks(
    attempt: Attempt, *, node: str = "h100-node-0", state: str = Rank.State.RUNNING, **fields: Any
) -> list[Rank]:
    """One rank per rank of the attempt, all on `node` in `state`."""
    return [
        Rank.objects.create(attempt=attempt, index=index, node=node, state=state, **fields)
        for index in range(attempt.world_size)
    ]


def running_job(
    world: Any,
    team: Team,
    *,
    node: str = "h100-node-0",
    admitted_at: datetime | None = None,
    borrowed: int = 0,
    attempt_fields: dict[str, Any] | None = None,
    rank_fields: dict[str, Any] | None = None,
    **job_fields: Any,
) -> Job:
    """A running job on an open attempt placed on `node`, both admitted at
    `admitted_at` (now by default); with `rank_fields` (even empty) its ranks
    are written too, running."""
    if admitted_at is not None:
        job_fields.setdefault("admitted_at", admitted_at)
    running = job(world, team, state=JobState.RUNNING, **job_fields)
    opened = attempt(
        running,
        node=node,
        admitted_at=admitted_at,
        borrowed_gpus=borrowed,
        **(attempt_fields or {}),
    )
    if rank_fields is not None:
        ranks(opened, node=node, **rank_fields)
    return running
