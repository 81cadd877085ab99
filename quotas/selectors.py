"""Every read of the team tree and quotas, scoped to the asking user.

The tree is small (hundreds of teams), so it is loaded once per call as
(id, parent) pairs and walked in Python: a constant number of queries
however deep the tree.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db.models import QuerySet

from quotas.models import AuditEntry, Membership, Node, PriorityClass, Quota, ResourceFlavor, Team

User = AbstractBaseUser | AnonymousUser


@dataclass(frozen=True)
class TeamTree:
    """Parent and children of every team, by id."""

    parent: dict[int, int | None]
    children: dict[int, list[int]]

    @classmethod
    def load(cls) -> TeamTree:
        parent: dict[int, int | None] = {}
        children: dict[int, list[int]] = defaultdict(list)
        for team_id, parent_id in Team.objects.values_list("id", "parent_id"):
            parent[team_id] = parent_id
            if parent_id is not None:
                children[parent_id].append(team_id)
        return cls(parent=parent, children=dict(children))

    def descendants(self, team_id: int) -> set[int]:
        """Strict descendants of a team."""
        found: set[int] = set()
        stack = list(self.children.get(team_id, ()))
        while stack:
            current = stack.pop()
            if current in found:
                continue
            found.add(current)
            stack.extend(self.children.get(current, ()))
        return found

    def subtree(self, team_ids: Iterable[int]) -> set[int]:
        found: set[int] = set()
        for team_id in team_ids:
            found.add(team_id)
            found |= self.descendants(team_id)
        return found

    def ancestors(self, team_id: int) -> list[int]:
        chain: list[int] = []
        current = self.parent.get(team_id)
        while current is not None and current not in chain:
            chain.append(current)
            current = self.parent.get(current)
        return chain

    def is_leaf(self, team_id: int) -> bool:
        return not self.children.get(team_id)

    def depth(self, team_id: int) -> int:
        return len(self.ancestors(team_id))


@dataclass(frozen=True)
class Access:
    """What one user may see and do, computed once per request."""

    is_admin: bool
    user_id: int | None
    tree: TeamTree
    managed: frozenset[int]  # teams the user manages directly
    member_of: frozenset[int]  # teams the user belongs to in any role

    @property
    def readable_teams(self) -> set[int]:
        """Teams whose quotas and jobs the user may read."""
        if self.is_admin:
            return set(self.tree.parent)
        return self.tree.subtree(self.managed) | set(self.member_of)

    def can_read_team(self, team_id: int) -> bool:
        return self.is_admin or team_id in self.readable_teams

    def can_manage_team(self, team_id: int) -> bool:
        """Managers act on their team and everything below it."""
        return self.is_admin or team_id in self.tree.subtree(self.managed)

    def can_edit_quota_of(self, team_id: int) -> bool:
        """A team's own quota belongs to a manager above it (or an admin)."""
        if self.is_admin:
            return True
        return any(ancestor in self.managed for ancestor in self.tree.ancestors(team_id))

    def can_submit_to(self, team_id: int) -> bool:
        return self.is_admin or team_id in self.member_of or self.can_manage_team(team_id)

    def can_cancel(self, *, team_id: int, submitter_id: int) -> bool:
        return self.is_admin or submitter_id == self.user_id or self.can_manage_team(team_id)


def access_for(user: User) -> Access:
    tree = TeamTree.load()
    if not user.is_authenticated:
        return Access(False, None, tree, frozenset(), frozenset())
    memberships = list(Membership.objects.filter(user_id=user.pk).values_list("team_id", "role"))
    return Access(
        is_admin=bool(user.is_staff),
        user_id=user.pk,
        tree=tree,
        managed=frozenset(t for t, role in memberships if role == Membership.Role.MANAGER),
        member_of=frozenset(t for t, _ in memberships),
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
