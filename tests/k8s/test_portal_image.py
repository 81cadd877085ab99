"""The pure parts of the portal image build (tools/k8s/portal_image.py): which files
``.containerignore`` leaves in the context, and that the image's hash follows its
inputs. The build itself (mmdebstrap, buildah, minutes) is ``make image``'s."""

from __future__ import annotations

import pytest

from tools.k8s.portal_image import REPO_ROOT, ContextFile, ignore_rules, is_ignored, portal_tag

RULES = ignore_rules(
    """
    # a comment, then a blank line

    .git
    **/__pycache__
    **/*.pyc
    tests
    fairshare/_build
    docs/*.md
    !docs/keep.md
    /build
    """
)

IGNORE_CASES = [
    # (path, ignored), one line per case
    (".git", True),
    (".git/config", True),
    (".gitignore", False),  # a name that starts like a rule's is not below it
    ("portal/__pycache__/urls.cpython-311.pyc", True),
    ("__pycache__/x.pyc", True),  # ** also matches no folder at all
    ("core/deep/er/mod.pyc", True),
    ("core/deep/er/mod.py", False),
    ("tests/k8s/test_portal_image.py", True),
    ("portal/tests.py", False),  # a rule without ** is anchored at the root
    ("fairshare/_build/abc/engine.so", True),
    ("fairshare/native.py", False),
    ("docs/real-nodes.md", True),
    ("docs/sub/real-nodes.md", False),  # * stops at a slash
    ("docs/keep.md", False),  # the later ! rule re-includes it
    ("build/lib/x.py", True),  # a leading slash changes nothing
]


@pytest.mark.parametrize(("path", "ignored"), IGNORE_CASES, ids=[c[0] for c in IGNORE_CASES])
def test_containerignore_rule(path: str, ignored: bool) -> None:
    assert is_ignored(path, RULES) is ignored


def test_the_repository_context_is_the_containerfiles() -> None:
    rules = ignore_rules((REPO_ROOT / ".containerignore").read_text())
    assert not is_ignored("manage.py", rules)
    assert not is_ignored("gracetrap/src/gracetrap/__init__.py", rules)
    assert is_ignored("tools/k8s/portal_image.py", rules)
    assert is_ignored("Containerfile", rules)


def _files(**contents: str) -> list[ContextFile]:
    return [ContextFile(path, 0o644, text.encode()) for path, text in sorted(contents.items())]


BASE = "quartermaster.test/python-base:0123456789abcdef"
SAME = portal_tag(_files(a="1", b="2"), b"FROM x", BASE)


@pytest.mark.parametrize(
    ("case", "tag", "equal"),
    [
        ("the same inputs", portal_tag(_files(a="1", b="2"), b"FROM x", BASE), True),
        ("a file's content", portal_tag(_files(a="1", b="3"), b"FROM x", BASE), False),
        ("a file more", portal_tag(_files(a="1", b="2", c=""), b"FROM x", BASE), False),
        ("the Containerfile", portal_tag(_files(a="1", b="2"), b"FROM y", BASE), False),
        ("the base", portal_tag(_files(a="1", b="2"), b"FROM x", BASE + "0"), False),
        (
            "a file's mode",
            portal_tag(
                [ContextFile("a", 0o755, b"1"), ContextFile("b", 0o644, b"2")], b"FROM x", BASE
            ),
            False,
        ),
    ],
)
def test_portal_tag_follows_its_inputs(case: str, tag: str, equal: bool) -> None:
    assert (tag == SAME) is equal, case
