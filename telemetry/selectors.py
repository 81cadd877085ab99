"""Reads behind the dashboard, the telemetry page and /metrics, scoped to the asking user.

Every function aggregates in SQL (or over a bounded, recent slice of rows) and
returns plain dataclasses, so a page runs the same number of queries however
many jobs the cluster has seen.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import PurePath
from typing import Any

from django.db.models import Case, Count, F, IntegerField, Q, QuerySet, Sum, Value, When

from core.access import Access, TeamTree
from preemption.models import ACTIVE_STATES, WAITING_STATES, Attempt, Job, PreemptionEvent, Rank
from quotas.models import Node, Quota, ResourceFlavor, Team
from quotas.selectors import team_tree, topology_levels
from telemetry.mission import MISSION
from telemetry.models import DrillRun, SimulationRun, UtilizationSample

# Charts read at most this many recent rows of a kind, so a page stays fast
# after years of history; the figures say so in their titles.
RECENT_ROWS = 5000


def _team_filter(access: Access, lookup: str) -> Q:
    """A filter on `lookup` (a team id path) that keeps only the user's readable teams."""
    if access.is_admin:
        return Q()
    return Q(**{f"{lookup}__in": access.readable_teams})


# --- now: flavors and teams ------------------------------------------------


@dataclass(frozen=True)
class FlavorNow:
    """One flavor across the whole cluster at this moment."""

    flavor_id: int
    name: str
    capacity: int
    guaranteed: int
    used: int
    borrowed: int

    @property
    def idle(self) -> int:
        return max(self.capacity - self.used, 0)

    def percent(self, value: int) -> float:
        return round(100.0 * value / self.capacity, 1) if self.capacity else 0.0

    @property
    def used_percent(self) -> float:
        return self.percent(self.used)

    @property
    def borrowed_percent(self) -> float:
        return self.percent(self.borrowed)

    @property
    def guaranteed_percent(self) -> float:
        return min(self.percent(self.guaranteed), 100.0)


@dataclass
class TeamFlavorUsage:
    """A team's quota of one flavor next to what it uses now.

    `used` is what the team's subtree holds; `borrowed` is what it holds beyond
    its own guarantee, max(0, used - guarantee), read from `UsageNow` like every
    other page, the API and /metrics.
    """

    flavor: str
    guarantee: int = 0
    borrow_limit: int | None = None
    lend_limit: int | None = None
    used: int = 0
    borrowed: int = 0
    quota_id: int | None = None
    has_quota: bool = False

    @property
    def within_guarantee(self) -> int:
        return max(self.used - self.borrowed, 0)

    @property
    def idle_guarantee(self) -> int:
        return max(self.guarantee - self.within_guarantee, 0)

    def bar(self, scale: int) -> dict[str, float]:
        """Widths in percent of `scale` for the usage bar: the part of the usage
        inside the guarantee, the borrowed part, and where the guarantee ends."""
        if scale <= 0:
            return {"own": 0.0, "borrowed": 0.0, "guarantee": 0.0}
        return {
            "own": round(100.0 * self.within_guarantee / scale, 2),
            "borrowed": round(100.0 * self.borrowed / scale, 2),
            "guarantee": round(100.0 * self.guarantee / scale, 2),
        }


@dataclass
class TeamRow:
    """A readable team in tree order, with its usage per flavor."""

    team_id: int
    slug: str
    name: str
    depth: int
    is_leaf: bool
    parent_slug: str | None
    weight: float
    flavors: dict[str, TeamFlavorUsage] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return any(u.guarantee or u.used for u in self.flavors.values())


def flavor_names() -> list[str]:
    return list(ResourceFlavor.objects.order_by("name").values_list("name", flat=True))


def _used_by_team_flavor() -> dict[tuple[int, int], int]:
    rows = (
        Job.objects.filter(state__in=ACTIVE_STATES)
        .values("team_id", "flavor_id")
        .annotate(used=Sum(F("ranks") * F("gpus_per_rank")))
    )
    return {(row["team_id"], row["flavor_id"]): int(row["used"] or 0) for row in rows}


def borrowed_gpus(*, used: int, guarantee: int) -> int:
    """GPUs a team holds beyond its own guarantee: max(0, used - guarantee).

    The figure is taken now, from what the team holds now, never from what an
    attempt borrowed when it was admitted: once a sibling's job ends, the same
    running job may sit inside the guarantee again.
    """
    return max(used - guarantee, 0)


@dataclass(frozen=True)
class UsageNow:
    """GPUs in use and borrowed per (team id, flavor id) for every team of the
    tree, and the flavors by id: the one read behind every "used" and
    "borrowed" figure (dashboard, team pages, the usage API, /metrics and the
    utilization samples).

    `used` of an inner team is the sum over its subtree. `borrowed` of every
    team, leaf or inner, is `borrowed_gpus` of its own used and guarantee. So a
    parent's borrowed is at most the sum of its sub-teams' borrowed: the
    difference is what sub-teams borrow inside the parent (a sibling's idle
    guarantee, or the parent's guarantee beyond its children's), which the
    parent does not borrow from anyone. `cluster_borrowed` per flavor is the
    sum over top-level teams: the GPUs lent between top-level teams, next to
    the top-level guarantees the cluster card shows.
    """

    used: dict[tuple[int, int], int]
    guarantee: dict[tuple[int, int], int]
    borrowed: dict[tuple[int, int], int]
    cluster_borrowed: dict[int, int]
    top_level: frozenset[int]
    flavors: dict[int, str]

    @classmethod
    def load(cls, tree: TeamTree | None = None) -> UsageNow:
        tree = tree or team_tree()
        used: dict[tuple[int, int], int] = defaultdict(int)
        for (team_id, flavor_id), gpus in _used_by_team_flavor().items():
            # Roll every team's usage up the whole tree, so an inner team shows
            # its subtree's usage even where a user sees only one branch.
            for holder in [team_id, *tree.ancestors(team_id)]:
                used[(holder, flavor_id)] += gpus
        guarantee = {
            (team_id, flavor_id): gpus
            for team_id, flavor_id, gpus in Quota.objects.values_list(
                "team_id", "flavor_id", "guarantee"
            )
        }
        borrowed = {
            key: borrowed_gpus(used=gpus, guarantee=guarantee.get(key, 0))
            for key, gpus in used.items()
        }
        top_level = frozenset(team_id for team_id, parent in tree.parent.items() if parent is None)
        cluster_borrowed: dict[int, int] = defaultdict(int)
        for (team_id, flavor_id), gpus in borrowed.items():
            if team_id in top_level:
                cluster_borrowed[flavor_id] += gpus
        return cls(
            used=dict(used),
            guarantee=guarantee,
            borrowed=borrowed,
            cluster_borrowed=dict(cluster_borrowed),
            top_level=top_level,
            flavors=dict(ResourceFlavor.objects.order_by("name").values_list("id", "name")),
        )


def flavors_now(usage: UsageNow | None = None) -> list[FlavorNow]:
    """Per flavor: schedulable GPUs, top-level guarantees, GPUs in use and
    borrowed between top-level teams (see `UsageNow`).

    These are cluster-wide totals without team names, shown to every signed-in user.
    """
    capacity = dict(
        Node.objects.filter(schedulable=True)
        .values_list("flavor_id")
        .annotate(total=Sum("gpus"))
        .values_list("flavor_id", "total")
    )
    guaranteed = dict(
        Quota.objects.filter(team__parent__isnull=True)
        .values_list("flavor_id")
        .annotate(total=Sum("guarantee"))
        .values_list("flavor_id", "total")
    )
    usage = usage or UsageNow.load()
    # Every team's usage rolls up to its top-level team, so the top-level
    # teams' sum is the whole cluster's.
    used: dict[int, int] = defaultdict(int)
    for (team_id, flavor_id), gpus in usage.used.items():
        if team_id in usage.top_level:
            used[flavor_id] += gpus
    return [
        FlavorNow(
            flavor_id=flavor_id,
            name=name,
            capacity=int(capacity.get(flavor_id) or 0),
            guaranteed=int(guaranteed.get(flavor_id) or 0),
            used=used[flavor_id],
            borrowed=usage.cluster_borrowed.get(flavor_id, 0),
        )
        for flavor_id, name in usage.flavors.items()
    ]


def team_rows(
    *, access: Access, only_team_ids: Iterable[int] | None = None, usage: UsageNow | None = None
) -> list[TeamRow]:
    """The readable part of the team tree in depth-first order, each team with
    its quota and current usage per flavor (inner teams sum their subtree)."""
    tree = access.tree
    readable = set(tree.parent) if access.is_admin else access.readable_teams
    if only_team_ids is not None:
        readable &= set(only_team_ids)
    teams = {
        team["id"]: team
        for team in Team.objects.filter(id__in=readable).values("id", "slug", "name", "weight")
    }
    usage = usage or UsageNow.load(tree)
    flavors = usage.flavors

    rows: dict[int, TeamRow] = {}
    slugs = {team_id: team["slug"] for team_id, team in teams.items()}
    for team_id, team in teams.items():
        parent_id = tree.parent.get(team_id)
        rows[team_id] = TeamRow(
            team_id=team_id,
            slug=team["slug"],
            name=team["name"],
            depth=tree.depth(team_id),
            is_leaf=tree.is_leaf(team_id),
            parent_slug=slugs.get(parent_id) if parent_id is not None else None,
            weight=team["weight"],
        )
        for flavor_name in flavors.values():
            rows[team_id].flavors[flavor_name] = TeamFlavorUsage(flavor=flavor_name)
    for quota in Quota.objects.filter(team_id__in=teams).values(
        "id", "team_id", "flavor_id", "guarantee", "borrow_limit", "lend_limit"
    ):
        figures = rows[quota["team_id"]].flavors[flavors[quota["flavor_id"]]]
        figures.guarantee = quota["guarantee"]
        figures.borrow_limit = quota["borrow_limit"]
        figures.lend_limit = quota["lend_limit"]
        figures.quota_id = quota["id"]
        figures.has_quota = True
    for team_id, row in rows.items():
        for flavor_id, flavor_name in flavors.items():
            figures = row.flavors[flavor_name]
            figures.used = usage.used.get((team_id, flavor_id), 0)
            figures.borrowed = usage.borrowed.get((team_id, flavor_id), 0)

    # Depth-first order; a readable team whose parent is not readable starts a tree.
    ordered: list[TeamRow] = []
    children: dict[int | None, list[int]] = defaultdict(list)
    for team_id in rows:
        parent_id = tree.parent.get(team_id)
        children[parent_id if parent_id in rows else None].append(team_id)
    for siblings in children.values():
        siblings.sort(key=lambda team_id: rows[team_id].slug)
    stack = list(reversed(children[None]))
    while stack:
        team_id = stack.pop()
        ordered.append(rows[team_id])
        stack.extend(reversed(children.get(team_id, [])))
    return ordered


# --- fragmentation ---------------------------------------------------------

# The level of a single node, beside the topology levels of QM_TOPOLOGY_LABELS.
NODE_LEVEL = "node"


@dataclass(frozen=True)
class FreeBlock:
    """The largest block of free GPUs of one flavor inside one domain of a level: what
    the biggest gang that needs that level could get now without preempting.

    `domain` names the domain that has it ("" where none has a free GPU); `domains`
    counts the flavor's domains at the level and `free` its free GPUs in all, so that
    `largest` far below `free` shows the free GPUs scattered across domains.
    """

    flavor: str
    level: str
    largest: int
    domain: str
    domains: int
    free: int


def free_gpus_by_node() -> dict[str, int]:
    """Every schedulable node's GPUs not held by an open attempt of an active job."""
    held: dict[str, int] = defaultdict(int)
    attempts = Attempt.objects.filter(
        ended_at__isnull=True, job__state__in=ACTIVE_STATES
    ).values_list("placement", "job__gpus_per_rank")
    for placement, gpus_per_rank in attempts:
        for entry in placement or []:
            held[str(entry["node"])] += int(entry["ranks"]) * gpus_per_rank
    return {
        name: max(0, gpus - held[name])
        for name, gpus in Node.objects.filter(schedulable=True).values_list("name", "gpus")
    }


def free_blocks() -> list[FreeBlock]:
    """Per flavor and level (each node, then each topology level from the innermost
    out): the largest free block, from the nodes' labels and the open attempts'
    placements. A node without a label at a level is in no domain of it, since a gang
    that needs that level cannot use it. Cluster-wide figures without team names."""
    free = free_gpus_by_node()
    levels = list(topology_levels().items())
    by_flavor: dict[str, list[tuple[str, int, dict[str, str]]]] = defaultdict(list)
    for name, flavor, labels in (
        Node.objects.filter(schedulable=True)
        .order_by("name")
        .values_list("name", "flavor__name", "labels")
    ):
        by_flavor[flavor].append((name, free[name], labels if isinstance(labels, dict) else {}))
    blocks = []
    for flavor, nodes in sorted(by_flavor.items()):
        total = sum(gpus for _, gpus, _ in nodes)
        domain_levels = [(NODE_LEVEL, None), *reversed(levels)]
        for level, key in domain_levels:
            room: dict[str, int] = defaultdict(int)
            for name, gpus, labels in nodes:
                if key is None:
                    room[name] += gpus
                elif key in labels:
                    room[str(labels[key])] += gpus
            # The fullest domain; ties go to the first name, so the figure is stable.
            domain, largest = min(
                room.items(), key=lambda item: (-item[1], item[0]), default=("", 0)
            )
            blocks.append(
                FreeBlock(
                    flavor=flavor,
                    level=level,
                    largest=largest,
                    domain=domain if largest else "",
                    domains=len(room),
                    free=total,
                )
            )
    return blocks


def topology_free_blocks() -> list[FreeBlock]:
    """`free_blocks` for the dashboard: empty where no schedulable node carries a
    label of any topology level. Without a topology every level but the node's has
    no domain, and a table of zeros would read as a cluster with nothing free."""
    blocks = free_blocks()
    if any(block.level != NODE_LEVEL and block.domains for block in blocks):
        return blocks
    return []


# --- the queue and preemptions -----------------------------------------------


def pending_jobs(
    *, jobs: QuerySet[Job], limit: int = 50, first_submitter_id: int | None = None
) -> tuple[list[Job], int]:
    """The oldest waiting jobs with their reasons, and how many wait in all.
    With `first_submitter_id` that user's own jobs come first (oldest first
    among them), so a researcher finds their jobs at the top of a long queue."""
    waiting = jobs.filter(state__in=WAITING_STATES)
    ordering: list[Any] = ["submitted_at", "id"]
    if first_submitter_id is not None:
        waiting = waiting.annotate(
            is_theirs=Case(
                When(submitter_id=first_submitter_id, then=Value(0)),
                default=Value(1),
                output_field=IntegerField(),
            )
        )
        ordering.insert(0, "is_theirs")
    return list(waiting.order_by(*ordering)[:limit]), waiting.count()


def own_jobs(*, jobs: QuerySet[Job], submitter_id: int, limit: int = 8) -> tuple[list[Job], int]:
    """The dashboard's "My jobs": the user's own jobs that still run or wait
    (newest first), then their latest finished ones, and how many they submitted
    in all. `jobs` is already scoped to what the user may read."""
    own = jobs.filter(submitter_id=submitter_id)
    live = Case(
        When(state__in=[*ACTIVE_STATES, *WAITING_STATES], then=Value(0)),
        default=Value(1),
        output_field=IntegerField(),
    )
    recent = own.annotate(finished=live).order_by("finished", "-submitted_at", "-id")
    return list(recent[:limit]), own.count()


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
    ).filter(_team_filter(access, "team_id"))
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
        .filter(_team_filter(access, "team_id"))
        .order_by("at")
        .values_list("at", flat=True)
        .first()
    )
    return first


def signal_latencies(*, access: Access) -> list[float]:
    """Seconds from each preemption decision to each rank's signal_received,
    for the most recent ranks that were signalled."""
    rows = (
        Rank.objects.filter(signal_received_at__isnull=False, attempt__preemption__isnull=False)
        .exclude(attempt__preemption__reason=PreemptionEvent.Reason.MANUAL)
        .filter(_team_filter(access, "attempt__job__team_id"))
        .order_by("-signal_received_at")
        .values_list("signal_received_at", "attempt__preemption__decided_at")[:RECENT_ROWS]
    )
    return [(received - decided).total_seconds() for received, decided in rows]


@dataclass(frozen=True)
class CheckpointAgainstGrace:
    """What one preemption's checkpoint took next to the grace window it had."""

    job_id: int
    decided_at: datetime
    grace_seconds: float
    checkpoint_seconds: float
    outcome: str


def checkpoints_against_grace(*, access: Access) -> list[CheckpointAgainstGrace]:
    rows = (
        PreemptionEvent.objects.preemptions()
        .filter(checkpoint_seconds__isnull=False)
        .filter(_team_filter(access, "job__team_id"))
        .order_by("-decided_at")
        .values_list("job_id", "decided_at", "grace_seconds", "checkpoint_seconds", "outcome")[
            :RECENT_ROWS
        ]
    )
    return [CheckpointAgainstGrace(*row) for row in reversed(rows)]


def exit_codes(*, access: Access) -> list[tuple[int, str, int]]:
    """(exit code, how the attempt ended, number of ranks) over every ended rank."""
    rows = (
        Rank.objects.filter(exit_code__isnull=False)
        .filter(_team_filter(access, "attempt__job__team_id"))
        .values("exit_code", "attempt__end_reason")
        .annotate(ranks=Count("id"))
        .order_by("exit_code", "attempt__end_reason")
    )
    return [
        (row["exit_code"], row["attempt__end_reason"] or "running", row["ranks"]) for row in rows
    ]


def recovery_seconds(*, access: Access) -> list[tuple[int, float]]:
    """(job id, seconds from the preemption decision to the resumed attempt)."""
    rows = (
        PreemptionEvent.objects.preemptions()
        .filter(resumed_at__isnull=False)
        .filter(_team_filter(access, "job__team_id"))
        .order_by("-decided_at")
        .values_list("job_id", "decided_at", "resumed_at")[:RECENT_ROWS]
    )
    return [(job_id, (resumed - decided).total_seconds()) for job_id, decided, resumed in rows]


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
        .filter(_team_filter(access, "job__team_id"))
        .values_list(
            "job__team__slug",
            "job__flavor__name",
            "admitted_at",
            "ended_at",
            "job__ranks",
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


# --- the mission matrix --------------------------------------------------------


@dataclass(frozen=True)
class MissionCriterion:
    """One row of the mission's matrix, measured over the latest drills."""

    name: str
    target: str
    latest: str
    over_runs: str
    passed: bool | None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    return None


def _count(value: Any) -> int | None:
    if isinstance(value, list | tuple | dict):
        return len(value)
    number = _number(value)
    return None if number is None else int(number)


def _utilization(value: Any) -> float | None:
    """A drill's utilization as a fraction: a number, or a mapping holding one."""
    number = _number(value)
    if number is None and isinstance(value, dict):
        for key in ("mean", "average", "during", "value", "utilization"):
            number = _number(value.get(key))
            if number is not None:
                break
    if number is not None and number > 1.0:
        number /= 100.0
    return number


def latest_drills(limit: int = 10) -> list[DrillRun]:
    return list(DrillRun.objects.filter(finished_at__isnull=False).order_by("-started_at")[:limit])


def mission_matrix(drills: list[DrillRun]) -> list[MissionCriterion]:
    """The mission's criteria, filled from the `--json` figures each drill stored."""
    if not drills:
        return []
    results = [drill.result or {} for drill in drills]
    runs = len(results)

    def seconds(value: float | None) -> str:
        return "—" if value is None else f"{value:.2f} s"

    propagation = [_number(r.get("signal_propagation_seconds")) for r in results]
    known_propagation = [p for p in propagation if p is not None]
    ckpt = [
        (
            _number(r.get("checkpoint_seconds")),
            _number(r.get("grace_seconds")) or drill.grace_seconds,
        )
        for r, drill in zip(results, drills, strict=True)
    ]
    inside = [c is not None and MISSION.checkpoint_met(c, g) for c, g in ckpt]
    committed = [bool(r.get("checkpoint_committed")) for r in results]
    codes = [list(r.get("exit_codes") or []) for r in results]
    clean_exits = [bool(c) and all(code == 0 for code in c) for c in codes]
    orphans = [_count(r.get("orphaned_ports")) for r in results]
    integrity = [r.get("restart_integrity") for r in results]
    recovery = [_number(r.get("recovery_seconds")) for r in results]
    known_recovery = [r for r in recovery if r is not None]
    utilization = [_utilization(r.get("utilization")) for r in results]
    known_utilization = [u for u in utilization if u is not None]

    latest_ckpt, latest_grace = ckpt[0]
    return [
        MissionCriterion(
            "Signal reaches every rank",
            MISSION.signal_text,
            seconds(propagation[0]),
            f"worst {max(known_propagation):.2f} s" if known_propagation else "—",
            all(MISSION.signal_met(p) for p in known_propagation) if known_propagation else None,
        ),
        MissionCriterion(
            "Graceful window: checkpoint inside the grace",
            MISSION.checkpoint_text,
            f"{seconds(latest_ckpt)} of {latest_grace:.0f} s",
            f"{sum(inside)} of {runs} runs inside",
            all(inside),
        ),
        MissionCriterion(
            "Checkpoint success rate",
            "100 %",
            "committed" if committed[0] else "not committed",
            f"{100.0 * sum(committed) / runs:.0f} % of {runs} runs",
            all(committed),
        ),
        MissionCriterion(
            "Every rank exits 0",
            "no 137",
            ", ".join(str(c) for c in sorted(set(codes[0]))) or "—",
            f"{sum(clean_exits)} of {runs} runs clean",
            all(clean_exits),
        ),
        MissionCriterion(
            "Orphaned sockets",
            "0",
            "—" if orphans[0] is None else str(orphans[0]),
            f"{sum(o or 0 for o in orphans)} in {runs} runs",
            all(o == 0 for o in orphans),
        ),
        MissionCriterion(
            "Restart integrity",
            "max abs diff 0.0",
            "exact" if integrity[0] is True else ("differs" if integrity[0] is False else "—"),
            f"{sum(1 for i in integrity if i is True)} of {runs} runs exact",
            all(i is True for i in integrity),
        ),
        MissionCriterion(
            "Utilization",
            "GPUs kept busy",
            "—" if utilization[0] is None else f"{100.0 * utilization[0]:.0f} %",
            f"mean {100.0 * sum(known_utilization) / len(known_utilization):.0f} %"
            if known_utilization
            else "—",
            None,
        ),
        MissionCriterion(
            "Recovery time",
            MISSION.recovery_text,
            seconds(recovery[0]),
            f"worst {max(known_recovery):.1f} s" if known_recovery else "—",
            all(MISSION.recovery_met(r) for r in known_recovery) if known_recovery else None,
        ),
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


# --- simulation reports ----------------------------------------------------------


@dataclass(frozen=True)
class SimulationReport:
    """One stored trace replay of `manage.py simulate` (a SimulationRun row)."""

    run_id: int
    name: str
    modified: datetime
    report: dict[str, Any]

    @property
    def policy(self) -> str:
        return str(self.report.get("run", {}).get("policy", "?"))

    @property
    def allocation(self) -> float | None:
        return _number((self.report.get("allocation") or {}).get("overall"))

    @property
    def completion(self) -> dict[str, Any]:
        return self.report.get("completion_time_seconds") or {}

    @property
    def queueing(self) -> dict[str, Any]:
        return self.report.get("queueing_delay_seconds") or {}


def simulation_reports(limit: int = 20) -> list[SimulationReport]:
    """The newest stored simulation runs whose report has the documented shape."""
    reports = []
    rows = SimulationRun.objects.order_by("-created_at", "-id").values_list(
        "id", "trace", "created_at", "report"
    )[:limit]
    for run_id, trace, created_at, report in rows:
        if not isinstance(report, dict) or "allocation" not in report or "teams" not in report:
            continue
        name = f"#{run_id} {PurePath(trace).name}" if trace else f"#{run_id}"
        reports.append(
            SimulationReport(run_id=run_id, name=name, modified=created_at, report=report)
        )
    return reports
