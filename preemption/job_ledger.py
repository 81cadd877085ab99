"""The answers to the quota rules' questions about jobs (`quotas.job_ledger`)."""

from __future__ import annotations

from collections.abc import Collection

from django.db.models import F

from preemption.models import ACTIVE_STATES, FINAL_STATES, Job, Rank, running_ranks


class DatabaseJobLedger:
    def node_runs_active_ranks(self, node_name: str) -> bool:
        return Rank.objects.filter(
            node=node_name, attempt__job__state__in=ACTIVE_STATES, attempt__ended_at__isnull=True
        ).exists()

    def team_has_jobs(self, team_id: int) -> bool:
        return Job.objects.filter(team_id=team_id).exists()

    def unfinished_job_ids(self, team_ids: Collection[int], *, limit: int) -> list[int]:
        return list(
            Job.objects.filter(team_id__in=team_ids)
            .exclude(state__in=FINAL_STATES)
            .values_list("id", flat=True)[:limit]
        )

    def active_non_preemptible(
        self, team_ids: Collection[int], *, flavor_id: int
    ) -> list[tuple[int, str, int]]:
        return list(
            Job.objects.filter(
                team_id__in=team_ids,
                flavor_id=flavor_id,
                state__in=ACTIVE_STATES,
                priority_class__preemptible=False,
            )
            .annotate(total=running_ranks() * F("gpus_per_rank"))
            .order_by("id")
            .values_list("id", "name", "total")
        )
