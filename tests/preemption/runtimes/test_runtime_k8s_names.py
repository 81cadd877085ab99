"""Team namespaces are valid DNS-1123 labels, distinct per team slug, and short enough."""

from __future__ import annotations

import re

import pytest

from preemption.runtimes.kubernetes.config import team_namespace

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
PREFIX = "qm-team-"

CASES = [
    # (slug, expected namespace)
    ("vision", "qm-team-vision"),
    ("team-a", "qm-team-team-a"),
    ("nlp2", "qm-team-nlp2"),
    # Not a valid label as it is: cleaned, plus sha256(slug)[:8] so none collide.
    ("Team_A", "qm-team-team-a-e61a5482"),
    ("team_a", "qm-team-team-a-112cd0cb"),
    ("TEAM-A", "qm-team-team-a-b53e3bb2"),
    # 63 characters with the prefix: still fits as it is.
    ("a" * 55, "qm-team-" + "a" * 55),
    # 64: cut to 54 characters, then the hash.
    ("a" * 56, "qm-team-" + "a" * 46 + "-b35439a4"),
]


@pytest.mark.parametrize(("slug", "expected"), CASES, ids=[c[0][:20] for c in CASES])
def test_team_namespace_table(slug: str, expected: str) -> None:
    name = team_namespace(PREFIX, slug)
    assert DNS_LABEL.match(name), name
    assert len(name) <= 63
    assert name == expected


def test_slugs_that_differ_get_different_namespaces() -> None:
    slugs = ["Team_A", "team_a", "team-a", "TEAM-A", "team.a", "a" * 56, "a" * 57, "a" * 80]
    names = [team_namespace(PREFIX, slug) for slug in slugs]
    assert len(set(names)) == len(slugs), names
    for name in names:
        assert DNS_LABEL.match(name) and len(name) <= 63, name


def test_an_unusable_slug_still_yields_a_label() -> None:
    name = team_namespace(PREFIX, "___")
    assert DNS_LABEL.match(name) and len(name) <= 63
    assert team_namespace(PREFIX, "___") == name  # stable across calls
