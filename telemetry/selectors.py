"""Reads behind the dashboard, the telemetry page and /metrics, scoped to the asking user:
the cluster now (flavors and teams), fragmentation and the queue.

Every function aggregates in SQL (or over a bounded, recent slice of rows) and
returns plain dataclasses, so a page runs the same number of queries however
many jobs the cluster has seen. The reads over time live in
telemetry.history_selectors, the preemption figures in
telemetry.preemption_selectors and the drill and simulation reports in
telemetry.report_selectors; none of these modules writes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from django.db.models import Case, F, IntegerField, Q, QuerySet, Sum, Value, When

from core.access import Access, TeamTree
from preemption.models import ACTIVE_STATES, WAITING_STATES, Attempt, Job, running_ranks
from quotas.models import Node, Quota, ResourceFlavor, Team
from quotas.selectors import team_tree, topology_levels

# Charts read at most this many recent rows of a kind, so a page stays fast
# after years of history; the figures say so in their titles.
RECENT_ROWS = 5000


def team_filter(access: Access, lookup: str) -> Q:
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
        .annotate(size=running_ranks())
        .values("team_id", "flavor_id")
        .annotate(used=Sum(F("size") * F("gpus_per_rank")))
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
