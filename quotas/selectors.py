"""Every read of the team tree and quotas, scoped to the asking user.

The tree is small (hundreds of teams), so it is loaded once per call as
(id, parent) pairs and walked in Python: a constant number of queries
however deep the tree.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from django.conf import settings
from django.db.models import QuerySet, Sum

from core.access import Access, TeamTree, User, access_of_memberships
from quotas.models import (
    AuditEntry,
    Membership,
    Node,
    PriorityClass,
    Quota,
    ResourceFlavor,
    SchedulingPolicy,
    Team,
)


def team_tree() -> TeamTree:
    """The whole team tree, in one query."""
    return TeamTree.from_pairs(Team.objects.values_list("id", "parent_id"))


def access_for(user: User) -> Access:
    """What `user` may see and do, from the team tree and their memberships."""
    tree = team_tree()
    if not user.is_authenticated:
        return Access(False, None, tree, frozenset(), frozenset())
    return access_of_memberships(
        is_admin=bool(user.is_staff),
        user_id=user.pk,
        tree=tree,
        memberships=Membership.objects.filter(user_id=user.pk).values_list("team_id", "role"),
    )


def team_list(*, user: User) -> QuerySet[Team]:
    access = access_for(user)
    queryset = Team.objects.select_related("parent").order_by("slug")
    if access.is_admin:
        return queryset
    return queryset.filter(id__in=access.readable_teams)


def quota_list(*, user: User, team: Team | None = None) -> QuerySet[Quota]:
    access = access_for(user)
    queryset = Quota.objects.select_related("team", "flavor")
    if not access.is_admin:
        queryset = queryset.filter(team_id__in=access.readable_teams)
    if team is not None:
        queryset = queryset.filter(team=team)
    return queryset


def flavor_list(*, user: User) -> QuerySet[ResourceFlavor]:
    return ResourceFlavor.objects.all()


def node_list(*, user: User) -> QuerySet[Node]:
    return Node.objects.select_related("flavor")


def priority_class_list(*, user: User) -> QuerySet[PriorityClass]:
    return PriorityClass.objects.all()


def scheduling_policy() -> SchedulingPolicy:
    """The cluster's scheduling policy: the saved row, or (unsaved) the deployment's
    settings until an admin first changes it. Every signed-in user may read it: it
    explains why jobs wait."""
    saved = SchedulingPolicy.objects.filter(pk=SchedulingPolicy.SINGLETON).first()
    if saved is not None:
        return saved
    return SchedulingPolicy(
        pk=SchedulingPolicy.SINGLETON,
        usage_strength=settings.QM_USAGE_STRENGTH,
        usage_half_life_seconds=settings.QM_USAGE_HALF_LIFE_SECONDS,
        priority_min_runtime_seconds=round(settings.QM_PRIORITY_MIN_RUNTIME_SECONDS),
        fair_share_min_runtime_seconds=round(settings.QM_FAIR_SHARE_MIN_RUNTIME_SECONDS),
        reclaim_min_runtime_seconds=round(settings.QM_RECLAIM_MIN_RUNTIME_SECONDS),
        consolidation_min_runtime_seconds=round(settings.QM_CONSOLIDATION_MIN_RUNTIME_SECONDS),
    )


def topology_levels() -> dict[str, str]:
    """The topology levels, outermost first, each with the node label it is read from."""
    return dict(settings.QM_TOPOLOGY_LABELS)


def node_topology(node: Node) -> dict[str, str]:
    """The node's domain at each topology level its labels name."""
    labels = node.labels if isinstance(node.labels, dict) else {}
    return {
        level: str(labels[key])
        for level, key in settings.QM_TOPOLOGY_LABELS.items()
        if key in labels
    }


@dataclass(frozen=True)
class PriorityAllowance:
    """The priority classes a team's jobs may use, and the class of a job
    submitted without one.

    `allowed` is ordered by value, highest first. `source` is the slug of the
    team whose own list is in force (the team itself or the nearest ancestor
    with a list), or None where no team on the way up has one.
    """

    team: str
    allowed: tuple[PriorityClass, ...]
    default: PriorityClass | None
    source: str | None

    @property
    def names(self) -> list[str]:
        return [pc.name for pc in self.allowed]

    def allows(self, priority_class: PriorityClass) -> bool:
        return self.allows_class_id(priority_class.pk)

    def allows_class_id(self, class_id: int) -> bool:
        """`allows` for a class known by its id only (read with the jobs)."""
        return any(pc.pk == class_id for pc in self.allowed)

    def describe(self) -> str:
        """The allowed classes in words, for refusals: "a, b" or "no class"."""
        return ", ".join(self.names) or "no class"


def priority_allowance(*, team: Team, tree: TeamTree | None = None) -> PriorityAllowance:
    """What `team` may use, like Slurm's QOS per association.

    Walking from the top-level team down to `team`, each team with a list of its
    own keeps only those of its parent's classes that are on its list, so a
    sub-team can narrow its parent's classes but never widen them, even after it
    was moved under a narrower parent. A top-level team without a list may use
    the installation's default class only: a new team starts with the least.

    The default is, in this order: the nearest own default on the way up that is
    allowed here, the installation's default class if allowed here, and else the
    allowed class of the lowest value (the least a job can ask for).
    """
    return priority_allowances(team_ids=[team.pk], tree=tree)[team.pk]


def priority_allowances(
    *, team_ids: Iterable[int], tree: TeamTree | None = None
) -> dict[int, PriorityAllowance]:
    """`priority_allowance` of many teams, in a fixed number of queries."""
    tree = tree or team_tree()
    chains = {team_id: [team_id, *tree.ancestors(team_id)] for team_id in team_ids}
    involved = {member for chain in chains.values() for member in chain}
    own: dict[int, set[int]] = defaultdict(set)
    slugs: dict[int, str] = {}
    defaults: dict[int, int] = {}
    # One row per (team, class on its own list); a team without a list comes once,
    # with no class (the join is an outer one).
    for team_id, slug, default_id, class_id in Team.objects.filter(id__in=involved).values_list(
        "id", "slug", "default_priority_class_id", "priority_classes"
    ):
        slugs[team_id] = slug
        if default_id is not None:
            defaults[team_id] = default_id
        if class_id is not None:
            own[team_id].add(class_id)
    classes = {pc.pk: pc for pc in PriorityClass.objects.all()}
    installation_default = next((pc for pc in classes.values() if pc.is_default), None)
    answers: dict[int, PriorityAllowance] = {}
    for team_id, chain in chains.items():
        allowed: set[int] | None = None
        source: int | None = None
        for member in reversed(chain):
            if member in own:
                allowed = set(own[member]) if allowed is None else allowed & own[member]
                source = member
        if allowed is None:
            allowed = {installation_default.pk} if installation_default is not None else set()
        ordered = tuple(
            sorted((classes[pk] for pk in allowed), key=lambda pc: (-pc.value, pc.name))
        )
        default = next(
            (classes[defaults[m]] for m in chain if m in defaults and defaults[m] in allowed),
            None,
        )
        if (
            default is None
            and installation_default is not None
            and installation_default.pk in allowed
        ):
            default = installation_default
        if default is None and ordered:
            default = ordered[-1]
        answers[team_id] = PriorityAllowance(
            team=slugs.get(team_id, ""),
            allowed=ordered,
            default=default,
            source=slugs.get(source) if source is not None else None,
        )
    return answers


def audit_list(*, user: User, team: Team | None = None) -> QuerySet[AuditEntry]:
    access = access_for(user)
    queryset = AuditEntry.objects.select_related("actor", "team")
    if not access.is_admin:
        managed = access.tree.subtree(access.managed)
        queryset = queryset.filter(team_id__in=managed)
    if team is not None:
        queryset = queryset.filter(team=team)
    return queryset


def cluster_gpus(*, flavor_id: int) -> int:
    return sum(
        Node.objects.filter(flavor_id=flavor_id, schedulable=True).values_list("gpus", flat=True)
    )


@dataclass(frozen=True)
class ClassTeams:
    """One branch of the team tree whose jobs may use a priority class: its top
    team, and the top teams of the sub-branches below it that may not."""

    team: str
    excluded: tuple[str, ...]


def priority_class_teams(*, access: Access) -> dict[int, list[ClassTeams]]:
    """For each priority class id, the teams the user reads whose jobs may use it.

    A class open to a whole branch is told once, as the branch's top team, with
    the teams below it that may not use it named as exceptions, so the answer
    stays short on a large tree. Classes no readable team may use are absent."""
    tree = access.tree
    readable = set(tree.parent) if access.is_admin else access.readable_teams
    allowances = priority_allowances(team_ids=readable, tree=tree)
    allowed: dict[int, set[int]] = defaultdict(set)
    for team_id, allowance in allowances.items():
        for priority_class in allowance.allowed:
            allowed[priority_class.pk].add(team_id)
    answers: dict[int, list[ClassTeams]] = {}
    for class_id, teams in allowed.items():
        branches = []
        for top in teams:
            if tree.parent.get(top) in teams:
                continue
            excluded = sorted(
                allowances[below].team
                for below in tree.descendants(top)
                if below in readable and below not in teams and tree.parent.get(below) in teams
            )
            branches.append(ClassTeams(team=allowances[top].team, excluded=tuple(excluded)))
        answers[class_id] = sorted(branches, key=lambda branch: branch.team)
    return answers


@dataclass(frozen=True)
class CapacityShortfall:
    """A flavor whose top-level guarantees exceed the GPUs the engine may place on
    now: some guarantees cannot all be honoured at once, typically while nodes are
    drained (`schedulable` false). Cluster-wide figures with node names only, no
    team, so every signed-in user may read them."""

    flavor: str
    guaranteed: int
    schedulable: int
    drained: int
    drained_nodes: tuple[str, ...]

    @property
    def missing(self) -> int:
        return self.guaranteed - self.schedulable

    @property
    def words(self) -> str:
        """ "32 GPUs of h100 guaranteed, 24 schedulable: 8 drained on node-4"."""
        text = f"{self.guaranteed} GPUs of {self.flavor} guaranteed, {self.schedulable} schedulable"
        if self.drained:
            text += f": {self.drained} drained on {', '.join(self.drained_nodes)}"
        return text


def capacity_shortfalls() -> list[CapacityShortfall]:
    """Every flavor whose top-level teams are guaranteed more GPUs than its
    schedulable nodes hold, by flavor name; two queries."""
    schedulable: dict[int, int] = defaultdict(int)
    drained: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for flavor_id, name, gpus, is_schedulable in Node.objects.order_by("name").values_list(
        "flavor_id", "name", "gpus", "schedulable"
    ):
        if is_schedulable:
            schedulable[flavor_id] += gpus
        elif gpus:
            drained[flavor_id].append((name, gpus))
    guaranteed = (
        Quota.objects.filter(team__parent__isnull=True)
        .values("flavor_id", "flavor__name")
        .annotate(total=Sum("guarantee"))
        .order_by("flavor__name")
    )
    return [
        CapacityShortfall(
            flavor=row["flavor__name"],
            guaranteed=int(row["total"]),
            schedulable=schedulable[row["flavor_id"]],
            drained=sum(gpus for _, gpus in drained[row["flavor_id"]]),
            drained_nodes=tuple(name for name, _ in drained[row["flavor_id"]]),
        )
        for row in guaranteed
        if (row["total"] or 0) > schedulable[row["flavor_id"]]
    ]
