"""The PriorityClass reconciler against a real API server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from preemption.runtimes.kubernetes import PriorityClassSpec, reconcile_priority_classes
from preemption.runtimes.kubernetes.config import MANAGED_BY, MANAGED_BY_LABEL

UNOWNED = "someone-elses-class"


@pytest.fixture
def scheduling(k8s_api: client.ApiClient) -> Iterator[client.SchedulingV1Api]:
    """The scheduling API, with every class this test made removed afterwards."""
    api = client.SchedulingV1Api(k8s_api)
    api.create_priority_class(
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": UNOWNED},
            "value": 5,
            "description": "made by hand",
        }
    )
    yield api
    reconcile_priority_classes(k8s_api, [])
    try:
        api.delete_priority_class(UNOWNED)
    except ApiException as error:
        if error.status != 404:
            raise


def test_reconcile_creates_replaces_corrects_drift_and_leaves_unowned_alone(
    k8s_api: client.ApiClient, scheduling: client.SchedulingV1Api
):
    desired = [
        PriorityClassSpec("qm-research", 100, "PreemptLowerPriority", "research runs"),
        PriorityClassSpec("qm-batch", 10, "Never", "batch"),
        # Same name as a class someone made by hand: never touched.
        PriorityClassSpec(UNOWNED, 200, "PreemptLowerPriority"),
    ]
    first = reconcile_priority_classes(k8s_api, desired)
    assert first.created == ("qm-batch", "qm-research")
    assert first.unowned == (UNOWNED,)
    research = scheduling.read_priority_class("qm-research")
    assert research.value == 100
    assert research.preemption_policy == "PreemptLowerPriority"
    assert research.metadata.labels[MANAGED_BY_LABEL] == MANAGED_BY
    assert scheduling.read_priority_class("qm-batch").preemption_policy == "Never"
    hand_made = scheduling.read_priority_class(UNOWNED)
    assert hand_made.value == 5
    assert hand_made.description == "made by hand"

    again = reconcile_priority_classes(k8s_api, desired)
    assert not again.changed

    # value and preemptionPolicy are immutable: a change replaces the object.
    changed = [
        PriorityClassSpec("qm-research", 150, "PreemptLowerPriority", "research runs"),
        PriorityClassSpec("qm-batch", 10, "PreemptLowerPriority", "batch"),
    ]
    old_uid = research.metadata.uid
    replaced = reconcile_priority_classes(k8s_api, changed)
    assert replaced.replaced == ("qm-batch", "qm-research")
    research = scheduling.read_priority_class("qm-research")
    assert research.value == 150
    assert research.metadata.uid != old_uid
    assert scheduling.read_priority_class("qm-batch").preemption_policy == "PreemptLowerPriority"

    # Drift by someone else: an edited description and a deleted class.
    scheduling.patch_priority_class("qm-research", {"description": "edited by hand"})
    scheduling.delete_priority_class("qm-batch")
    corrected = reconcile_priority_classes(k8s_api, changed)
    assert corrected.updated == ("qm-research",)
    assert corrected.created == ("qm-batch",)
    assert scheduling.read_priority_class("qm-research").description == "research runs"

    # A class removed from the portal goes; the unowned one stays.
    removed = reconcile_priority_classes(k8s_api, changed[:1])
    assert removed.deleted == ("qm-batch",)
    names = {pc.metadata.name for pc in scheduling.list_priority_class().items}
    assert "qm-batch" not in names
    assert {"qm-research", UNOWNED} <= names
    assert scheduling.read_priority_class(UNOWNED).value == 5
