"""Reads of telemetry over time, scoped to the asking user: which teams a chart
shows, utilization points, GPU-hours and the telemetry page's window. Aggregates
in SQL and returns plain dataclasses; never writes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Q

from core.access import Access
from preemption.models import Attempt, attempt_ranks
from quotas.models import Team
from telemetry.models import UtilizationSample
from telemetry.selectors import team_filter

# --- telemetry over time -----------------------------------------------------


@dataclass(frozen=True)
class UtilizationPoint:
    """One sample of one team and flavor."""

    at: datetime
    team: str
    flavor: str
    used: int
    guarantee: int
    borrowed: int
    capacity: int


def overview_teams(*, access: Access, limit: int = 40) -> set[int]:
    """The teams the dashboard shows: the user's top readable teams, then each
    level below them as long as the total stays within `limit`, so a small tree
    shows whole and a large one shows its upper levels (the Teams page has all)."""
    tree = access.tree
    readable = set(tree.parent) if access.is_admin else access.readable_teams
    level = sorted(t for t in readable if tree.parent.get(t) not in readable)
    shown: set[int] = set()
    while level and len(shown) + len(level) <= limit:
        shown.update(level)
        level = [c for t in level for c in tree.children.get(t, ()) if c in readable]
    if not shown:
        # Even the top level is larger than the limit: show it anyway.
        shown.update(level)
    return shown


def chart_teams(*, access: Access, team_id: int | None = None) -> list[int]:
    """Which teams the utilization chart stacks: the user's top readable teams,
    or their children when there is only one, so a manager of one team sees
    its sub-teams side by side. A chosen team (any readable one, leaves
    included) is charted as its readable sub-teams, or alone when it has none;
    a team the user cannot read is ignored."""
    tree = access.tree
    readable = set(tree.parent) if access.is_admin else access.readable_teams
    if team_id is not None and team_id in readable:
        children = sorted(t for t in tree.children.get(team_id, ()) if t in readable)
        return children or [team_id]
    roots = sorted(t for t in readable if tree.parent.get(t) not in readable)
    if len(roots) == 1 and tree.children.get(roots[0]):
        return sorted(t for t in tree.children[roots[0]] if t in readable)
    return roots


def readable_team_slugs(*, access: Access) -> dict[str, int]:
    """Slug to id of every team the user may read, in slug order: the teams
    the telemetry page lets the reader chart, leaves included."""
    teams = Team.objects.order_by("slug")
    if not access.is_admin:
        teams = teams.filter(id__in=access.readable_teams)
    return dict(teams.values_list("slug", "id"))


# A utilization chart draws at most this many moments: about one per pixel of a wide
# chart. A day of samples every 15 s is 5,760 moments a team, and building and
# serialising the figure of every one of them took most of the telemetry page's time.
CHART_MOMENTS = 720


def utilization_points(
    *,
    access: Access,
    since: datetime,
    until: datetime,
    team_ids: Iterable[int],
    max_moments: int = CHART_MOMENTS,
) -> list[UtilizationPoint]:
    """The samples of the teams between `since` and `until`. Where there are more
    than `max_moments` sampling moments, the period is cut into that many equal
    slices and only each slice's last moment is kept: what a slower sampler would
    have recorded, every team at the same moment, so stacked series still add up."""
    samples = UtilizationSample.objects.filter(
        at__gte=since, at__lte=until, team_id__in=list(team_ids)
    ).filter(team_filter(access, "team_id"))
    # The moments first (one column, however many teams), then only the kept ones' rows.
    moments = list(samples.order_by("at").values_list("at", flat=True).distinct())
    if len(moments) > max_moments and until > since:
        width = (until - since) / max_moments
        last_of_slice = {(moment - since) // width: moment for moment in moments}
        samples = samples.filter(at__in=list(last_of_slice.values()))
    rows = samples.order_by("at", "team__slug", "flavor__name").values_list(
        "at", "team__slug", "flavor__name", "used", "guarantee", "borrowed", "capacity"
    )
    return [UtilizationPoint(*row) for row in rows]


def first_sample_at(*, access: Access, team_ids: Iterable[int]) -> datetime | None:
    """When the first utilization sample of these teams was taken, if any was."""
    first: datetime | None = (
        UtilizationSample.objects.filter(team_id__in=list(team_ids))
        .filter(team_filter(access, "team_id"))
        .order_by("at")
        .values_list("at", flat=True)
        .first()
    )
    return first


@dataclass(frozen=True)
class GpuHours:
    """GPU-hours one team ran on one flavor in a period."""

    team: str
    flavor: str
    gpu_hours: float
    borrowed_gpu_hours: float


def gpu_hours(*, access: Access, since: datetime, until: datetime) -> list[GpuHours]:
    """GPU-hours per team and flavor from the attempts that overlap the period,
    each counted only for the part of it inside the period."""
    rows = (
        Attempt.objects.filter(admitted_at__lt=until)
        .filter(Q(ended_at__isnull=True) | Q(ended_at__gt=since))
        .filter(team_filter(access, "job__team_id"))
        .values_list(
            "job__team__slug",
            "job__flavor__name",
            "admitted_at",
            "ended_at",
            attempt_ranks(),
            "job__gpus_per_rank",
            "borrowed_gpus",
        )
    )
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for team, flavor, admitted, ended, ranks, per_rank, borrowed in rows.iterator(chunk_size=2000):
        start = max(admitted, since)
        end = min(ended or until, until)
        hours = max((end - start).total_seconds(), 0.0) / 3600.0
        totals[(team, flavor)][0] += hours * ranks * per_rank
        totals[(team, flavor)][1] += hours * borrowed
    return [
        GpuHours(
            team=team, flavor=flavor, gpu_hours=round(total, 3), borrowed_gpu_hours=round(b, 3)
        )
        for (team, flavor), (total, b) in sorted(totals.items())
    ]


# The telemetry page's window when none is chosen ("auto"): back to the first sample,
# so a new cluster's few minutes fill the chart instead of a sliver of a day, but
# never less than an hour nor more than a day.
AUTO_PERIOD = "auto"
AUTO_SHORTEST = timedelta(hours=1)
AUTO_LONGEST = timedelta(hours=24)


def period_bounds(
    now: datetime, period: str, *, first_sample: datetime | None = None
) -> tuple[datetime, datetime]:
    """The (since, until) of a named period ending now. "auto" (and any unknown
    name) reaches back to `first_sample`, within AUTO_SHORTEST and AUTO_LONGEST."""
    spans = {
        "1h": timedelta(hours=1),
        "24h": timedelta(hours=24),
        "7d": timedelta(days=7),
        "30d": timedelta(days=30),
    }
    if period in spans:
        return now - spans[period], now
    reach = now - first_sample if first_sample is not None else AUTO_SHORTEST
    return now - min(max(reach, AUTO_SHORTEST), AUTO_LONGEST), now
