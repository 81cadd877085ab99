"""Roles and team-tree access: who may read, manage, submit to and cancel in
which team. Pure data over (team, parent) pairs and a user's memberships; the
quotas app loads them from the database (`quotas.selectors.access_for`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db import models

User = AbstractBaseUser | AnonymousUser


class Role(models.TextChoices):
    """A person's role in a team. Platform admins are Django staff instead."""

    MANAGER = "manager", "Manager"
    RESEARCHER = "researcher", "Researcher"


@dataclass(frozen=True)
class TeamTree:
    """Parent and children of every team, by id."""

    parent: dict[int, int | None]
    children: dict[int, list[int]]

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[int, int | None]]) -> TeamTree:
        """The tree from (team id, parent id) pairs, as `quotas.selectors.team_tree` reads them."""
        parent: dict[int, int | None] = {}
        children: dict[int, list[int]] = defaultdict(list)
        for team_id, parent_id in pairs:
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


def access_of_memberships(
    *, is_admin: bool, user_id: int | None, tree: TeamTree, memberships: Iterable[tuple[int, str]]
) -> Access:
    """A user's access from their (team id, role) memberships."""
    pairs = list(memberships)
    return Access(
        is_admin=is_admin,
        user_id=user_id,
        tree=tree,
        managed=frozenset(team for team, role in pairs if role == Role.MANAGER),
        member_of=frozenset(team for team, _ in pairs),
    )


def navigation_role(*, is_admin: bool, roles: Iterable[str]) -> str:
    """The role the navigation shows: admin, manager (of any team) or researcher."""
    if is_admin:
        return "admin"
    return "manager" if Role.MANAGER in set(roles) else "researcher"
