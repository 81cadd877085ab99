"""Every refusal of a quota field names the field's allowed range, in the quota
editor (save and live preview) and the API (change and preview) alike, in one
wording, and changes nothing.

The world: ml holds 16 GPUs of h100-80gb and nlp 8 of them, so vision's
guarantee may be 0 to 8; limits may be 0 to 1000000 or empty; a team's weight
0.001 to 1000000.
"""

from __future__ import annotations

import html
from typing import Any

import pytest
from django.urls import reverse

from quotas.models import Node
from tests.conftest import database_state
from tests.portal.pages.conftest import page_client

pytestmark = pytest.mark.django_db

GUARANTEE = (
    "Must be a whole number from 0 to 8: ml has 16 GPUs of h100-80gb and its other "
    "sub-teams hold 8 (got {})."
)
BORROW_LIMIT = "Must be a whole number from 0 to 1000000, or empty (no limit) (got {})."
LEND_LIMIT = "Must be a whole number from 0 to 1000000, or empty (lend all) (got {})."
WEIGHT = "Must be a number from 0.001 to 1000000 (got {})."

# (field, what a manager typed, the refusal) — one line per case.
TYPED = [
    ("guarantee", "-3", GUARANTEE.format("-3")),
    ("guarantee", "abc", GUARANTEE.format("abc")),
    ("guarantee", "1e20", GUARANTEE.format("1e20")),
    ("guarantee", "2.5", GUARANTEE.format("2.5")),
    ("guarantee", "", GUARANTEE.format("nothing")),
    ("guarantee", "12", GUARANTEE.format("12")),
    ("borrow_limit", "-3", BORROW_LIMIT.format("-3")),
    ("borrow_limit", "abc", BORROW_LIMIT.format("abc")),
    ("borrow_limit", "1e20", BORROW_LIMIT.format("1e20")),
    ("borrow_limit", "2.5", BORROW_LIMIT.format("2.5")),
    ("borrow_limit", "2000000", BORROW_LIMIT.format("2000000")),
    ("lend_limit", "-3", LEND_LIMIT.format("-3")),
    ("lend_limit", "abc", LEND_LIMIT.format("abc")),
    ("lend_limit", "1e20", LEND_LIMIT.format("1e20")),
    ("lend_limit", "2.5", LEND_LIMIT.format("2.5")),
]

# The same refusals for values sent as JSON numbers and null.
SENT = [
    ("guarantee", -3, GUARANTEE.format("-3")),
    ("guarantee", 1e20, GUARANTEE.format("1e+20")),
    ("guarantee", 2.5, GUARANTEE.format("2.5")),
    ("guarantee", None, GUARANTEE.format("nothing")),
    ("guarantee", True, GUARANTEE.format("True")),
    ("borrow_limit", -3, BORROW_LIMIT.format("-3")),
    ("borrow_limit", 2.5, BORROW_LIMIT.format("2.5")),
    ("lend_limit", 1e20, LEND_LIMIT.format("1e+20")),
    ("lend_limit", "eight", LEND_LIMIT.format("eight")),
]


def _form(field: str, typed: str) -> dict[str, str]:
    """The editor's fields as a manager leaves them: vision's values, one changed."""
    return {"guarantee": "8", "borrow_limit": "", "lend_limit": "", field: typed}


def _quota_row(world: Any) -> tuple[int, int | None, int | None]:
    quota = world.quota(world.vision)
    return (quota.guarantee, quota.borrow_limit, quota.lend_limit)


@pytest.mark.parametrize(("field", "typed", "message"), TYPED)
def test_the_editor_refuses_with_the_range_and_saves_nothing(
    world: Any, field: str, typed: str, message: str
) -> None:
    quota = world.quota(world.vision)
    client = page_client(world, "manager")
    before = database_state()
    saved = client.post(
        reverse("quota-edit", args=[quota.pk]), {**_form(field, typed), "action": "save"}
    )
    assert saved.status_code == 400
    assert (
        f'<p class="error" role="alert" data-error-for="{field}">{html.escape(message)}</p>'
        in saved.content.decode()
    )
    preview = client.post(reverse("quota-preview", args=[quota.pk]), _form(field, typed))
    assert preview.status_code == 400
    assert f'data-error-for="{field}" data-message="{html.escape(message)}"' in (
        preview.content.decode()
    )
    assert database_state() == before
    assert _quota_row(world) == (8, None, None)


@pytest.mark.parametrize(("field", "typed", "message"), TYPED)
def test_the_api_refuses_typed_values_in_the_editors_words(
    world: Any, field: str, typed: str, message: str
) -> None:
    quota = world.quota(world.vision)
    client = world.client("manager")
    before = database_state()
    for path in (f"/api/v1/quotas/{quota.pk}/", f"/api/v1/quotas/{quota.pk}/preview/"):
        method = client.patch if path.endswith(f"{quota.pk}/") else client.post
        response = method(path, {field: typed}, format="json")
        assert (path, response.status_code) == (path, 400)
        assert response.json() == {field: [message]}
    assert database_state() == before
    assert _quota_row(world) == (8, None, None)


@pytest.mark.parametrize(("field", "sent", "message"), SENT)
def test_the_api_refuses_json_values_with_the_range(
    world: Any, field: str, sent: Any, message: str
) -> None:
    quota = world.quota(world.vision)
    before = database_state()
    response = world.client("admin").patch(
        f"/api/v1/quotas/{quota.pk}/", {field: sent}, format="json"
    )
    assert (response.status_code, response.json()) == (400, {field: [message]})
    assert database_state() == before


def test_a_new_quota_without_a_guarantee_is_refused_with_its_range(world: Any) -> None:
    before = database_state()
    response = world.client("admin").post(
        "/api/v1/quotas/", {"team": "other", "flavor": "a100-40gb"}, format="json"
    )
    assert response.status_code == 400
    assert response.json() == {
        "guarantee": [
            "Must be a whole number from 0 to 8: the cluster has 8 GPUs of a100-40gb and the "
            "other top-level teams hold 0 (got nothing)."
        ]
    }
    assert database_state() == before


def test_every_refused_field_is_named_at_once(world: Any) -> None:
    quota = world.quota(world.vision)
    response = page_client(world, "manager").post(
        reverse("quota-preview", args=[quota.pk]),
        {"guarantee": "-1", "borrow_limit": "x", "lend_limit": "-2"},
    )
    body = response.content.decode()
    for field, message in (
        ("guarantee", GUARANTEE.format("-1")),
        ("borrow_limit", BORROW_LIMIT.format("x")),
        ("lend_limit", LEND_LIMIT.format("-2")),
    ):
        assert f'data-error-for="{field}" data-message="{html.escape(message)}"' in body


@pytest.mark.parametrize(
    ("sent", "shown"),
    [
        (0, "0"),
        (-1, "-1"),
        ("abc", "abc"),
        (None, "nothing"),
        (2e6, "2000000"),
        (True, "True"),
        (10**400, "1" + "0" * 38 + "…"),
    ],
)
def test_a_weight_is_refused_with_its_range(world: Any, sent: Any, shown: str) -> None:
    client = world.client("admin")
    quota = world.quota(world.vision)
    before = database_state()
    for method, path in (
        (client.patch, f"/api/v1/teams/{world.vision.pk}/"),
        (client.post, f"/api/v1/quotas/{quota.pk}/preview/"),
    ):
        response = method(path, {"weight": sent}, format="json")
        assert (path, response.status_code, response.json()) == (
            path,
            400,
            {"weight": [WEIGHT.format(shown)]},
        )
    assert database_state() == before


def test_an_over_committed_flavor_says_no_guarantee_fits(world: Any) -> None:
    # Draining a node leaves 16 GPUs for org's 16 and other's 8: other, whose
    # sub-team ops holds 8, can be given neither more nor less.
    Node.objects.filter(name="h100-node-2").update(schedulable=False)
    quota = world.quota(world.other)
    response = world.client("admin").patch(
        f"/api/v1/quotas/{quota.pk}/", {"guarantee": 4}, format="json"
    )
    assert response.json() == {
        "guarantee": [
            "No value fits now: it would have to be at least 8 and at most 0: the sub-teams of "
            "other are guaranteed 8 GPUs of h100-80gb; the cluster has 16 GPUs of h100-80gb and "
            "the other top-level teams hold 16 (got 4)."
        ]
    }
