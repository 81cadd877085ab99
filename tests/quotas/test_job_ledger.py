"""The quota rules that depend on jobs ask preemption's job ledger, and refuse
with nothing changed: a node that runs ranks, a team with unfinished jobs or a
job history, a guarantee below the running non-preemptible GPUs."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ValidationError

from preemption.models import JobState
from quotas import services
from quotas.models import AuditEntry, Node, Quota, Team
from tests import builders

pytestmark = pytest.mark.django_db


def _unchanged() -> tuple[int, int, int, int]:
    return (
        Node.objects.count(),
        Team.objects.count(),
        Quota.objects.count(),
        AuditEntry.objects.count(),
    )


def test_a_node_running_ranks_is_not_deleted(world: Any) -> None:
    builders.running_job(world, world.vision, node="h100-node-1", rank_fields={})
    before = _unchanged()
    with pytest.raises(ValidationError, match="still runs ranks of active jobs"):
        services.node_delete(actor=world.users["admin"], node=Node.objects.get(name="h100-node-1"))
    assert _unchanged() == before
    services.node_delete(actor=world.users["admin"], node=Node.objects.get(name="h100-node-2"))
    assert not Node.objects.filter(name="h100-node-2").exists()


def test_a_team_with_unfinished_jobs_or_a_history_is_not_deleted(world: Any) -> None:
    job = builders.running_job(world, world.vision)
    before = _unchanged()
    with pytest.raises(ValidationError, match=f"unfinished jobs \\(job {job.pk}\\)"):
        services.team_delete(actor=world.users["admin"], team=world.vision)
    job.state = JobState.SUCCEEDED
    job.save(update_fields=["state"])
    with pytest.raises(ValidationError, match="has a job history"):
        services.team_delete(actor=world.users["admin"], team=world.vision)
    with pytest.raises(ValidationError, match="has jobs of its own"):
        services.team_create(actor=world.users["admin"], slug="sub", name="", parent=world.vision)
    assert _unchanged() == before


def test_a_guarantee_does_not_drop_below_running_non_preemptible_jobs(world: Any) -> None:
    job = builders.running_job(
        world, world.vision, name="serve", priority_class=world.critical, gpus_per_rank=6
    )
    before = _unchanged()
    with pytest.raises(ValidationError, match=f"job {job.pk} \\(serve\\)"):
        services.quota_update(
            actor=world.users["admin"], quota=world.quota(world.vision), guarantee=4
        )
    assert _unchanged() == before
    assert world.quota(world.vision).guarantee == 8
