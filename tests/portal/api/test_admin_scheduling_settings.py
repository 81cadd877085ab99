"""The Django admin's forms for the engine's newer settings obey the API's rules: the
scheduling policy, a node's topology and a job's topology level. A refused form saves
nothing; a saved one is audited like the API's change."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from preemption.models import Job, JobState
from quotas.models import AuditEntry, Node, SchedulingPolicy
from tests import builders
from tests.conftest import database_state

RACK_KEY = "topology.quartermaster.io/rack"
BLOCK_KEY = "topology.quartermaster.io/block"


@pytest.fixture(autouse=True)
def _settings(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.QM_TOPOLOGY_LABELS = {"block": BLOCK_KEY, "rack": RACK_KEY}
    settings.QM_USAGE_HALF_LIFE_SECONDS = 7 * 86_400.0
    settings.QM_CONSOLIDATION_MIN_RUNTIME_SECONDS = 600.0


@pytest.fixture
def browser(world: Any) -> Client:
    client = Client()
    client.force_login(world.users["admin"])
    return client


POLICY_FORM = {
    "usage_strength": "1",
    "usage_half_life_seconds": "86400",
    "priority_min_runtime_seconds": "0",
    "fair_share_min_runtime_seconds": "60",
    "reclaim_min_runtime_seconds": "0",
    "consolidation_min_runtime_seconds": "600",
}


def test_the_policy_form_starts_from_the_deployments_settings(browser: Client) -> None:
    page = browser.get(reverse("admin:quotas_schedulingpolicy_add")).content.decode()
    assert 'name="usage_half_life_seconds" value="604800.0"' in page
    assert 'name="consolidation_min_runtime_seconds" value="600"' in page


def test_a_bad_policy_in_the_admin_is_refused_and_a_good_one_audited(browser: Client) -> None:
    url = reverse("admin:quotas_schedulingpolicy_add")
    before = database_state()
    refused = browser.post(url, {**POLICY_FORM, "usage_half_life_seconds": "30"})
    assert refused.status_code == 200
    assert "Must be from 60 seconds to 3.1536e+07 (a year) (got 30.0)." in refused.content.decode()
    assert database_state() == before
    saved = browser.post(url, POLICY_FORM)
    assert saved.status_code == 302
    policy = SchedulingPolicy.objects.get()
    assert (policy.usage_strength, policy.usage_half_life_seconds) == (1.0, 86400.0)
    assert AuditEntry.objects.filter(action="scheduling_policy.update").count() == 1
    # One row only: a second cannot be added.
    assert browser.get(url).status_code == 403


def test_a_nodes_topology_in_the_admin_becomes_its_labels(browser: Client) -> None:
    node = Node.objects.get(name="h100-node-2")
    url = reverse("admin:quotas_node_change", args=[node.pk])
    page = browser.get(url).content.decode()
    assert 'name="topology_rack"' in page and 'name="topology_block"' in page
    form = {
        "name": node.name,
        "flavor": node.flavor_id,
        "gpus": "8",
        "labels": "{}",
        "schedulable": "on",
        "topology_block": "b1",
        "topology_rack": "r 2",
    }
    before = database_state()
    refused = browser.post(url, form)
    assert refused.status_code == 200
    assert "The rack domain &#x27;r 2&#x27; is not a label value" in refused.content.decode()
    assert database_state() == before
    saved = browser.post(url, {**form, "topology_rack": "r2"})
    assert saved.status_code == 302
    node.refresh_from_db()
    assert node.labels == {BLOCK_KEY: "b1", RACK_KEY: "r2"}
    entry = AuditEntry.objects.filter(action="node.upsert").latest("id")
    assert entry.after is not None and entry.after["topology"] == {"block": "b1", "rack": "r2"}
    listing = browser.get(reverse("admin:quotas_node_changelist")).content.decode()
    assert "block b1 / rack r2" in listing


def test_a_jobs_unknown_topology_level_is_refused_in_the_admin(world: Any, browser: Client) -> None:
    job = builders.job(world, world.vision, state=JobState.PENDING)
    url = reverse("admin:preemption_job_change", args=[job.pk])
    page = browser.get(url)
    assert page.status_code == 200
    form = {
        field.html_name: field.value() if field.value() is not None else ""
        for field in page.context["adminform"].form
    }
    form = {key: value for key, value in form.items() if value is not False}
    form["env"] = "{}"
    for inline in page.context["inline_admin_formsets"]:
        management = inline.formset.management_form
        form.update({field.html_name: field.value() for field in management})
    form["topology_level"] = "row"
    before = database_state()
    refused = browser.post(url, form)
    assert refused.status_code == 200
    assert "Unknown topology level &#x27;row&#x27;" in refused.content.decode()
    assert database_state() == before
    form["topology_level"] = "rack"
    saved = browser.post(url, form)
    assert saved.status_code == 302
    assert Job.objects.get(pk=job.pk).topology_level == "rack"
