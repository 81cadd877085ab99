"""Every read of the team tree and quotas, scoped to the asking user.

The tree is small (hundreds of teams), so it is loaded once per call as
(id, parent) pairs and walked in Python: a constant number of queries
however deep the tree.
"""

from __future__ import annotations

from django.db.models import QuerySet

from core.access import Access, TeamTree, User, access_of_memberships
from quotas.models import AuditEntry, Membership, Node, PriorityClass, Quota, ResourceFlavor, Team


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
