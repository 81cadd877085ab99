"""The Django admin: every model is registered and its pages render for a
platform admin; quota edits there obey the same rules as the API."""

from __future__ import annotations

from typing import Any

import pytest
from django.apps import apps
from django.contrib import admin
from django.test import Client
from django.urls import reverse

from quotas.models import AuditEntry, Quota, Team
from quotas.selectors import priority_allowance

APPS = ("portal", "quotas", "preemption", "telemetry")


@pytest.fixture(autouse=True)
def _fast_passwords(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def test_every_model_is_in_the_admin() -> None:
    models = [model for label in APPS for model in apps.get_app_config(label).get_models()]
    missing = [model._meta.label for model in models if not admin.site.is_registered(model)]
    assert not missing, f"models without an admin: {missing}"


def test_every_admin_page_renders_for_an_admin(world: Any) -> None:
    browser = Client()
    browser.force_login(world.users["admin"])
    for label in APPS:
        for model in apps.get_app_config(label).get_models():
            opts = model._meta
            changelist = browser.get(
                reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
            )
            assert changelist.status_code == 200, opts.label
            first = model.objects.first()
            if first is not None:
                change = browser.get(
                    reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[first.pk])
                )
                assert change.status_code == 200, opts.label
    # People who are not staff do not get in at all.
    outsider = Client()
    outsider.force_login(world.users["manager"])
    assert outsider.get(reverse("admin:quotas_quota_changelist")).status_code == 302


def test_a_quota_edit_in_the_admin_obeys_the_rules_and_is_audited(world: Any) -> None:
    browser = Client()
    browser.force_login(world.users["admin"])
    quota = world.quota(world.vision)
    url = reverse("admin:quotas_quota_change", args=[quota.pk])
    form = {
        "team": world.vision.pk,
        "flavor": world.h100.pk,
        "guarantee": 9,
        "borrow_limit": "",
        "lend_limit": "",
    }
    refused = browser.post(url, form)
    assert refused.status_code == 200
    assert (
        "Must be a whole number from 0 to 8: ml has 16 GPUs of h100-80gb and its other sub-teams hold 8 (got 9)."
        in refused.content.decode()
    )
    assert Quota.objects.get(pk=quota.pk).guarantee == 8
    saved = browser.post(url, {**form, "guarantee": 6})
    assert saved.status_code == 302
    assert Quota.objects.get(pk=quota.pk).guarantee == 6
    entry = AuditEntry.objects.filter(action="quota.set").first()
    assert (
        entry is not None and entry.actor == world.users["admin"] and entry.after["guarantee"] == 6
    )


def test_a_teams_priority_classes_edited_in_the_admin_obey_the_tree_and_are_audited(
    world: Any,
) -> None:
    browser = Client()
    browser.force_login(world.users["admin"])
    world.ml.priority_classes.set([world.batch])
    url = reverse("admin:quotas_team_change", args=[world.vision.pk])
    form = {
        "slug": "vision",
        "name": "Vision",
        "parent": world.ml.pk,
        "weight": 1.0,
        "priority_classes": [world.critical.pk],
        "default_priority_class": "",
        **{
            f"{prefix}-{key}": value
            for prefix in ("quotas", "memberships")
            for key, value in (
                ("TOTAL_FORMS", 0),
                ("INITIAL_FORMS", 0),
                ("MIN_NUM_FORMS", 0),
                ("MAX_NUM_FORMS", 1000),
            )
        },
    }
    refused = browser.post(url, form)
    assert refused.status_code == 200
    assert (
        "A sub-team can only narrow its parent&#x27;s classes: ml may use ai-batch-preemptible, "
        "not ai-prod-critical." in refused.content.decode()
    )
    assert not world.vision.priority_classes.exists()
    assert not AuditEntry.objects.filter(action="team.priority_classes").exists()
    saved = browser.post(
        url,
        {**form, "priority_classes": [world.batch.pk], "default_priority_class": world.batch.pk},
    )
    assert saved.status_code == 302, saved.content.decode()[:2000]
    assert list(world.vision.priority_classes.all()) == [world.batch]
    entry = AuditEntry.objects.get(action="team.priority_classes")
    assert entry.actor == world.users["admin"] and entry.team == world.vision
    assert entry.before["priority_classes"] is None
    assert entry.after == {
        "priority_classes": ["ai-batch-preemptible"],
        "default_priority_class": "ai-batch-preemptible",
        "allowed": ["ai-batch-preemptible"],
        "default": "ai-batch-preemptible",
    }


def test_a_team_added_in_the_admin_starts_with_its_parents_classes(world: Any) -> None:
    browser = Client()
    browser.force_login(world.users["admin"])
    url = reverse("admin:quotas_team_add")
    page = browser.get(url).content.decode()
    assert 'name="slug"' in page and 'name="priority_classes"' not in page
    inline = {
        f"{prefix}-{key}": value
        for prefix in ("quotas", "memberships")
        for key, value in (
            ("TOTAL_FORMS", 0),
            ("INITIAL_FORMS", 0),
            ("MIN_NUM_FORMS", 0),
            ("MAX_NUM_FORMS", 1000),
        )
    }
    added = browser.post(
        url, {"slug": "speech", "name": "Speech", "parent": world.ml.pk, "weight": 1.0, **inline}
    )
    assert added.status_code == 302, added.content.decode()[:2000]
    speech = Team.objects.get(slug="speech")
    assert not speech.priority_classes.exists() and speech.default_priority_class is None
    assert priority_allowance(team=speech).names == ["ai-prod-critical", "ai-batch-preemptible"]
