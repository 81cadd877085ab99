"""The Django admin: every model is registered and its pages render for a
platform admin; quota edits there obey the same rules as the API."""

from __future__ import annotations

from typing import Any

import pytest
from django.apps import apps
from django.contrib import admin
from django.test import Client
from django.urls import reverse

from quotas.models import AuditEntry, Quota

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
        "The sub-teams of ml would be guaranteed 17 GPUs of h100-80gb, more than its own 16."
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
