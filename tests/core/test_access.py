"""Roles and team-tree access, as pure data: who reads, manages, edits the
quota of, submits to and cancels in which team."""

from __future__ import annotations

from core.access import Access, Role, TeamTree, access_of_memberships, navigation_role

# org(1) ── ml(2) ── vision(3), nlp(4);  other(5) ── ops(6)
TREE = TeamTree.from_pairs([(1, None), (2, 1), (3, 2), (4, 2), (5, None), (6, 5)])


def test_the_tree_walks_down_and_up() -> None:
    assert TREE.descendants(1) == {2, 3, 4}
    assert TREE.subtree([2, 6]) == {2, 3, 4, 6}
    assert TREE.ancestors(3) == [2, 1]
    assert (TREE.is_leaf(3), TREE.is_leaf(2)) == (True, False)
    assert TREE.depth(4) == 2


def test_a_manager_acts_below_their_team_and_edits_quotas_only_below_it() -> None:
    manager = access_of_memberships(
        is_admin=False, user_id=7, tree=TREE, memberships=[(2, Role.MANAGER)]
    )
    assert manager.readable_teams == {2, 3, 4}
    assert manager.can_manage_team(3) and not manager.can_manage_team(6)
    # A team's own quota belongs to a manager above it.
    assert manager.can_edit_quota_of(3) and not manager.can_edit_quota_of(2)
    assert manager.can_cancel(team_id=4, submitter_id=99)
    assert not manager.can_cancel(team_id=6, submitter_id=99)


def test_a_researcher_submits_to_their_team_and_cancels_their_own_jobs() -> None:
    researcher = access_of_memberships(
        is_admin=False, user_id=8, tree=TREE, memberships=[(3, Role.RESEARCHER)]
    )
    assert researcher.readable_teams == {3}
    assert researcher.can_submit_to(3) and not researcher.can_submit_to(4)
    assert researcher.can_cancel(team_id=3, submitter_id=8)
    assert not researcher.can_cancel(team_id=3, submitter_id=9)
    assert not researcher.can_edit_quota_of(3)


def test_an_admin_reads_and_manages_everything() -> None:
    admin = Access(True, 1, TREE, frozenset(), frozenset())
    assert admin.readable_teams == {1, 2, 3, 4, 5, 6}
    assert admin.can_edit_quota_of(1) and admin.can_cancel(team_id=6, submitter_id=2)


def test_the_navigation_names_the_strongest_role() -> None:
    assert navigation_role(is_admin=True, roles=[]) == "admin"
    assert navigation_role(is_admin=False, roles=["researcher", "manager"]) == "manager"
    assert navigation_role(is_admin=False, roles=["researcher"]) == "researcher"
    assert navigation_role(is_admin=False, roles=[]) == "researcher"
