"""What a team may ask of the shared cluster beyond its GPUs: how many jobs it
may have waiting, and which images its jobs may run (the match itself is
`preemption.job_rules.image_allowlist_errors`). Both are inherited down the
team tree as priority classes are (`quotas.selectors.priority_allowances`): a
team's own setting can only narrow what the teams above it allow, so moving a
team under a stricter parent makes it stricter too."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from django.conf import settings

from core.access import TeamTree
from quotas.models import Team


@dataclass(frozen=True)
class QueuedJobLimit:
    """The most jobs `team` may have waiting, and the team that set it (None:
    the site default, settings.QM_MAX_QUEUED_JOBS_PER_TEAM)."""

    limit: int
    set_by: str | None


def _chains(team_ids: Iterable[int], tree: TeamTree) -> dict[int, list[int]]:
    """Each team and its ancestors, from the team up."""
    return {team_id: [team_id, *tree.ancestors(team_id)] for team_id in team_ids}


def queued_job_limits(*, team_ids: Iterable[int], tree: TeamTree) -> dict[int, QueuedJobLimit]:
    """Each team's queued-job limit: the smallest one set on it or above it,
    else the site default. One query, whatever the number of teams."""
    chains = _chains(team_ids, tree)
    own = {
        team_id: (slug, limit)
        for team_id, slug, limit in Team.objects.filter(
            id__in={member for chain in chains.values() for member in chain},
            max_queued_jobs__isnull=False,
        ).values_list("id", "slug", "max_queued_jobs")
    }
    answers: dict[int, QueuedJobLimit] = {}
    for team_id, chain in chains.items():
        set_here = [own[member] for member in chain if member in own]
        if set_here:
            slug, limit = min(set_here, key=lambda pair: pair[1])
            answers[team_id] = QueuedJobLimit(limit=limit, set_by=slug)
        else:
            answers[team_id] = QueuedJobLimit(
                limit=settings.QM_MAX_QUEUED_JOBS_PER_TEAM, set_by=None
            )
    return answers


def image_allow_lists(
    *, team_ids: Iterable[int], tree: TeamTree
) -> dict[int, tuple[tuple[str, tuple[str, ...]], ...]]:
    """The image lists (settings.QM_K8S_IMAGE_ALLOWLIST, by team slug) that apply
    to each team, as (team, prefixes) from the top of the tree down: its own and
    every one above it, each of which must admit an image
    (`preemption.job_rules.image_allowlist_errors`). A team under none may run any image."""
    configured = settings.QM_K8S_IMAGE_ALLOWLIST
    chains = _chains(team_ids, tree)
    slugs: dict[int, str] = {}
    if configured:
        slugs = dict(
            Team.objects.filter(
                id__in={member for chain in chains.values() for member in chain}
            ).values_list("id", "slug")
        )
    return {
        team_id: tuple(
            (slugs[member], tuple(configured[slugs[member]]))
            for member in reversed(chain)
            if member in slugs and slugs[member] in configured
        )
        for team_id, chain in chains.items()
    }
