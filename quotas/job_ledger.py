"""What the quota rules need to know about jobs, asked through a protocol.

Some quota rules depend on the jobs that run: a node that still runs ranks
cannot be deleted, a team with jobs cannot get sub-teams or be deleted, and a
guarantee cannot drop below the team's running non-preemptible jobs. Jobs live
in the preemption layer above this one, which quotas must not import; so
quotas states the questions here and preemption answers them
(`preemption.job_ledger`), registered when Django loads the apps.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from django.core.exceptions import ImproperlyConfigured


class JobLedger(Protocol):
    def node_runs_active_ranks(self, node_name: str) -> bool:
        """Whether a rank of an active job's open attempt runs on the node."""
        ...

    def team_has_jobs(self, team_id: int) -> bool:
        """Whether the team ever had a job (its history included)."""
        ...

    def unfinished_job_ids(self, team_ids: Collection[int], *, limit: int) -> list[int]:
        """Up to `limit` ids of the teams' jobs that have not finished."""
        ...

    def active_non_preemptible(
        self, team_ids: Collection[int], *, flavor_id: int
    ) -> list[tuple[int, str, int]]:
        """(id, name, GPUs) of the teams' active non-preemptible jobs of a flavor, by id."""
        ...


_ledger: JobLedger | None = None


def register_job_ledger(ledger: JobLedger) -> None:
    global _ledger
    _ledger = ledger


def job_ledger() -> JobLedger:
    if _ledger is None:
        raise ImproperlyConfigured(
            "No job ledger is registered: the preemption app registers it when Django loads "
            "the apps, so it must be in INSTALLED_APPS."
        )
    return _ledger
