"""The quota editor in daily use: a refusal names the allowed maximum under
its field, a limit change that preempts nobody says when limits apply, an
optional reason is kept with the audit entry, and cancelling a job asks first.

The world: ml holds 16 GPUs of h100-80gb; vision and nlp 8 each; org 16 and
other 8 at the top of a 24-GPU cluster."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.urls import reverse

from preemption.models import Job, JobState
from quotas.models import AuditEntry
from tests.portal.pages.conftest import page_client

pytestmark = pytest.mark.django_db


def test_refusal_sits_under_its_field_with_the_allowed_maximum(world: Any) -> None:
    quota = world.quota(world.vision)
    before = AuditEntry.objects.count()
    response = page_client(world, "manager").post(
        reverse("quota-edit", args=[quota.pk]), {"guarantee": 12, "action": "save"}
    )
    assert response.status_code == 400
    body = response.content.decode()
    field = body[body.index('<label for="id_guarantee">') :]
    field = field[: field.index('<div class="field')]
    # ml has 16; nlp holds 8 of it, so vision may have at most 16 - 8 = 8.
    assert (
        '<p class="error" role="alert" data-error-for="guarantee">Must be a whole number from 0 '
        "to 8: ml has 16 GPUs of h100-80gb and its other sub-teams hold 8 (got 12).</p>"
    ) in field
    assert (world.quota(world.vision).guarantee, AuditEntry.objects.count()) == (8, before)


def test_live_preview_refusal_carries_the_field_and_message_for_the_editor(world: Any) -> None:
    quota = world.quota(world.nlp)
    response = page_client(world, "manager").post(
        reverse("quota-preview", args=[quota.pk]), {"guarantee": 10}
    )
    assert response.status_code == 400
    assert (
        'data-error-for="guarantee" data-message="Must be a whole number from 0 to 8: ml has 16 '
        'GPUs of h100-80gb and its other sub-teams hold 8 (got 10)."'
    ) in response.content.decode()


def test_top_level_refusal_names_the_cluster_maximum(world: Any) -> None:
    quota = world.quota(world.other)
    response = page_client(world, "admin").post(
        reverse("quota-preview", args=[quota.pk]), {"guarantee": 9}
    )
    # 24 GPUs in the cluster, org holds 16: other may have at most 8.
    assert (
        "Must be exactly 8: the sub-teams of other are guaranteed 8 GPUs of h100-80gb; the "
        "cluster has 24 GPUs of h100-80gb and the other top-level teams hold 16 (got 9)."
    ) in response.content.decode()


@pytest.mark.parametrize(
    ("change", "noted"),
    [
        ({"guarantee": 8, "borrow_limit": 2}, True),
        ({"guarantee": 8, "lend_limit": 0}, True),
        ({"guarantee": 6}, False),
    ],
)
def test_limit_change_says_limits_apply_to_new_admissions(
    world: Any, change: dict[str, Any], noted: bool
) -> None:
    quota = world.quota(world.vision)
    body = (
        page_client(world, "manager")
        .post(reverse("quota-preview", args=[quota.pk]), change)
        .content.decode()
    )
    assert 'id="no-reclaim"' in body
    assert ('id="limits-note"' in body) is noted
    assert "Fair shares that move" in body


def test_reason_is_kept_with_the_audit_entry_and_shown_in_the_history(world: Any) -> None:
    quota = world.quota(world.vision)
    client = page_client(world, "manager")
    response = client.post(
        reverse("quota-edit", args=[quota.pk]),
        {"guarantee": 6, "reason": "  vision's paper is submitted  ", "action": "save"},
    )
    assert response.status_code == 302
    entry = AuditEntry.objects.get(action="quota.set", object_id=str(quota.pk))
    assert (entry.reason, entry.after["guarantee"]) == ("vision's paper is submitted", 6)
    history = client.get(reverse("team-detail", args=["vision"])).content.decode()
    assert "Reason: vision&#x27;s paper is submitted" in history
    # Without a reason the entry has none and the history shows no reason line.
    client.post(reverse("quota-edit", args=[quota.pk]), {"guarantee": 7, "action": "save"})
    latest = AuditEntry.objects.filter(action="quota.set").order_by("-id").first()
    assert latest is not None and latest.reason == ""
    assert (
        client.get(reverse("team-detail", args=["vision"]))
        .content.decode()
        .count('class="audit-reason')
        == 1
    )


def test_a_reason_longer_than_300_characters_is_refused_and_nothing_saved(world: Any) -> None:
    quota = world.quota(world.vision)
    before = AuditEntry.objects.count()
    response = page_client(world, "manager").post(
        reverse("quota-edit", args=[quota.pk]),
        {"guarantee": 6, "reason": "x" * 301, "action": "save"},
    )
    assert response.status_code == 400
    assert re.search(
        r'data-error-for="reason">Ensure this value has at most 300', response.content.decode()
    )
    assert (world.quota(world.vision).guarantee, AuditEntry.objects.count()) == (8, before)


def test_cancel_asks_before_it_is_sent(world: Any) -> None:
    job = Job.objects.create(
        name="asks",
        team=world.vision,
        submitter=world.users["researcher"],
        priority_class=world.batch,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=1,
        command="true",
        state=JobState.PENDING,
    )
    body = (
        page_client(world, "researcher").get(reverse("job-detail", args=[job.pk])).content.decode()
    )
    assert (
        f'id="cancel-form" data-confirm="Cancel job #{job.pk} (asks)? This cannot be undone."'
        in body
    )
