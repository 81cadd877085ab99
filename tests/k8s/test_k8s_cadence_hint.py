"""The cadence hint on Kubernetes: a ConfigMap per gang, mounted read-only in every
rank where QM_PREEMPTION_MTBP_FILE points, patched while the gang runs (the node
agent refreshes the files as a kubelet does) and deleted with the gang."""

from __future__ import annotations

import dataclasses
import shlex
import sys
import textwrap
from collections.abc import Callable

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from preemption.runtimes.base import GangId
from preemption.runtimes.kubernetes import KubernetesRuntime
from preemption.runtimes.kubernetes.config import (
    GANG_LABEL,
    RISK_MOUNT_PATH,
    gang_name,
    pod_name,
    risk_config_map_name,
)
from tools.k8s.agent_state import ANNOTATION_RUN
from tools.k8s.gangs import all_in, gang_spec
from tools.k8s.wait import wait_for

MakeRuntime = Callable[..., KubernetesRuntime]

# Prints the hint each time it changes until the rank is stopped.
READER = textwrap.dedent(
    """
    import os, time
    seen = None
    while True:
        try:
            text = open(os.environ["QM_PREEMPTION_MTBP_FILE"]).read().strip()
        except OSError as error:
            text = f"unreadable {error.errno}"
        if text != seen:
            print("hint", text, flush=True)
            seen = text
        time.sleep(0.1)
    """
)


def logged(runtime: KubernetesRuntime, gang: GangId, ranks: int, text: bytes) -> bool:
    return all(text in runtime.read_log(gang, rank) for rank in range(ranks))


@pytest.mark.timeout(180)
def test_the_hint_config_map_is_created_mounted_updated_and_deleted_with_the_gang(
    make_runtime: MakeRuntime, k8s_api: client.ApiClient, namespace: str
) -> None:
    runtime = make_runtime(pod_annotations={ANNOTATION_RUN: "process"})
    core = client.CoreV1Api(k8s_api)
    command = f"{shlex.quote(sys.executable)} -c {shlex.quote(READER)}"
    spec = dataclasses.replace(
        gang_spec(601, {"gpu-node-0": 1, "gpu-node-1": 1}, command=command), mtbp_seconds=600.0
    )
    gang = spec.gang
    runtime.launch(spec)

    # Created with the estimate at launch, owned by the gang record, and not labelled
    # as a gang record itself (listings of records select by that label).
    name = risk_config_map_name(gang)
    hint = core.read_namespaced_config_map(name, namespace)
    record = core.read_namespaced_config_map(gang_name(gang), namespace)
    assert hint.data == {"mtbp": "600.0\n"}
    assert [o.uid for o in hint.metadata.owner_references] == [record.metadata.uid]
    assert GANG_LABEL not in hint.metadata.labels
    records = core.list_namespaced_config_map(namespace, label_selector=GANG_LABEL).items
    assert [r.metadata.name for r in records] == [gang_name(gang)]

    # Mounted read-only, only its one key, where the trap's variable points.
    for rank in range(2):
        pod = core.read_namespaced_pod(pod_name(gang, rank), namespace)
        volumes = {v.name: v for v in pod.spec.volumes}
        source = volumes["preemption-risk"].config_map
        assert source.name == name and [(i.key, i.path) for i in source.items] == [("mtbp", "mtbp")]
        mount = next(m for m in pod.spec.containers[0].volume_mounts if m.name == "preemption-risk")
        assert mount.mount_path == RISK_MOUNT_PATH and mount.read_only is True
        env = {e.name: e.value for e in pod.spec.containers[0].env}
        assert env["QM_PREEMPTION_MTBP_FILE"] == f"{RISK_MOUNT_PATH}/mtbp"

    wait_for(lambda: all_in(runtime, gang, "running", 2), timeout=60, what="2 ranks running")
    wait_for(lambda: logged(runtime, gang, 2, b"hint 600.0\n"), timeout=30, what="600 s read")
    assert len(runtime.observe(gang)) == 2

    # Updated while the gang runs: every rank reads the new value.
    runtime.publish_preemption_risk(gang, 120.0, team="vision")
    assert core.read_namespaced_config_map(name, namespace).data == {"mtbp": "120.0\n"}
    wait_for(lambda: logged(runtime, gang, 2, b"hint 120.0\n"), timeout=30, what="120 s read")
    # The same value again is not written again.
    version = core.read_namespaced_config_map(name, namespace).metadata.resource_version
    runtime.publish_preemption_risk(gang, 120.0, team="vision")
    assert core.read_namespaced_config_map(name, namespace).metadata.resource_version == version
    # A fresh runtime (a restarted worker) finds the gang and writes a new value.
    restarted = make_runtime(pod_annotations={ANNOTATION_RUN: "process"})
    restarted.publish_preemption_risk(gang, 3600.0, team="vision")
    assert core.read_namespaced_config_map(name, namespace).data == {"mtbp": "3600.0\n"}

    # Deleted with the gang.
    runtime.kill(gang)
    wait_for(lambda: all_in(runtime, gang, "exited", 2), timeout=60, what="2 ranks exited")
    runtime.forget(gang)
    with pytest.raises(ApiException) as gone:
        core.read_namespaced_config_map(name, namespace)
    assert gone.value.status == 404
    # A hint for a forgotten gang writes nothing and recreates nothing.
    restarted.publish_preemption_risk(gang, 60.0, team="vision")
    with pytest.raises(ApiException):
        core.read_namespaced_config_map(name, namespace)
