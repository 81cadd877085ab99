"""Cluster DNS on real kubelets: a rank finds rank 0 by the name the runtime gives it.

The runtime hands every rank ``MASTER_ADDR=rank-0.<gang>.<namespace>.svc.cluster.local``,
a name of the gang's headless Service. Here CoreDNS serves it from the API server
(the EndpointSlice of that Service, published before rank 0 is ready), each
kubelet's ``clusterDNS`` points the pods at it, and the two ranks run on two nodes
as real containers: rank 1 resolves the name inside its container and sends a
line to a TCP port rank 0 listens on, which is what a rendezvous does first.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from kubernetes import client

from preemption.runtimes.kubernetes import KubernetesRuntime
from preemption.runtimes.kubernetes.config import gang_name, pod_name
from tools.k8s.gangs import all_in, gang_spec
from tools.k8s.images import BUSYBOX_APPLETS, RANK_REPOSITORY
from tools.k8s.realnodes import RealNodes
from tools.k8s.wait import wait_for

MakeRuntime = Callable[..., KubernetesRuntime]

# Rank 0 listens on MASTER_PORT until a connection brings a line, and prints it. Rank 1
# asks the cluster DNS for MASTER_ADDR until it answers (rank 0's pod may not have
# its address yet), then connects to it by name, again until rank 0 listens.
RENDEZVOUS = r"""
if [ "$RANK" = 0 ]; then
    echo "listening on $MASTER_PORT"
    # A connection that brings no line (seen now and then under load) does not end it.
    until got=$(nc -l -p "$MASTER_PORT") && [ -n "$got" ]; do :; done
    echo "$got"
    echo "rank 0 done"
else
    echo "first query $(date +%s.%N)"
    tries=0
    until nslookup "$MASTER_ADDR"; do
        tries=$((tries + 1)); [ "$tries" -lt 100 ] || exit 3
        sleep 0.2
    done
    echo "resolved $(date +%s.%N)"
    tries=0
    until echo "hello from rank 1 at $(date +%s.%N)" | nc -w 5 "$MASTER_ADDR" "$MASTER_PORT"; do
        tries=$((tries + 1)); [ "$tries" -lt 100 ] || exit 4
        sleep 0.2
    done
    echo "rank 1 sent"
    # Again, should a line have reached rank 0 empty, until rank 0 stops listening
    # (refused once it is done). Sending once more only left rank 0 waiting for ever
    # when that one arrived empty too (a make test run on a loaded machine).
    tries=0
    while [ "$tries" -lt 30 ]; do
        sleep 0.5
        echo "hello from rank 1 at $(date +%s.%N)" | nc -w 2 "$MASTER_ADDR" "$MASTER_PORT" || break
        tries=$((tries + 1))
    done
fi
"""


@pytest.fixture
def dns_runtime(make_runtime: MakeRuntime, real_nodes: RealNodes) -> KubernetesRuntime:
    """The runtime with the rank image, and requests two real nodes of 2 CPUs can hold."""
    return make_runtime(
        default_image=real_nodes.rank_image,
        default_cpu_per_gpu="50m",
        default_memory_per_gpu="32Mi",
        default_ephemeral_storage_per_gpu="32Mi",
    )


def test_rank_1_resolves_master_addr_through_cluster_dns_and_reaches_rank_0_on_the_other_node(
    dns_runtime: KubernetesRuntime,
    real_nodes: RealNodes,
    k8s_api: client.ApiClient,
    namespace: str,
) -> None:
    assert real_nodes.rank_image.startswith(RANK_REPOSITORY)
    assert real_nodes.rank_has_busybox, (
        f"the rank image has no {', '.join(BUSYBOX_APPLETS)}: bin/test-services installs "
        "Debian's busybox-static, which tools/k8s/images.py puts in it"
    )
    core = client.CoreV1Api(k8s_api)
    spec = gang_spec(911, {"real-node-0": 1, "real-node-1": 1}, command=RENDEZVOUS, grace_seconds=3)
    gang = spec.gang
    dns_runtime.launch(spec)
    try:
        wait_for(lambda: all_in(dns_runtime, gang, "exited", 2), timeout=90, what="both ranks exit")
    except TimeoutError as error:
        logs = {r: dns_runtime.read_log(gang, r).decode(errors="replace") for r in (0, 1)}
        raise AssertionError(f"{error}\nrank 0:\n{logs[0]}\nrank 1:\n{logs[1]}") from None

    pods = {r: core.read_namespaced_pod(pod_name(gang, r), namespace) for r in (0, 1)}
    assert {pods[r].spec.node_name for r in (0, 1)} == {"real-node-0", "real-node-1"}
    logs = {r: dns_runtime.read_log(gang, r).decode(errors="replace") for r in (0, 1)}
    print(f"rank 0:\n{logs[0]}\nrank 1:\n{logs[1]}")
    assert [o.exit_code for o in dns_runtime.observe(gang)] == [0, 0], logs

    # The kubelet pointed the pod's resolver at the cluster DNS, and that server
    # answered rank 0's name with rank 0's address on the other node.
    master_addr = f"rank-0.{gang_name(gang)}.{namespace}.svc.cluster.local"
    env = {e.name: e.value for e in pods[1].spec.containers[0].env}
    assert env["MASTER_ADDR"] == master_addr
    assert re.search(rf"Server:\s+{re.escape(real_nodes.dns_address)}", logs[1]), logs[1]
    answer = logs[1].split(f"Name:\t{master_addr}", 1)
    assert len(answer) == 2, logs[1]
    assert re.search(rf"Address: {re.escape(pods[0].status.pod_ip)}\b", answer[1]), logs[1]
    # Rank 1 may ask before rank 0's pod has an address (NXDOMAIN until then): the
    # wait a rendezvous must allow for.
    asked = float(re.findall(r"^first query (\d+\.\d+)$", logs[1], re.MULTILINE)[0])
    resolved = float(re.findall(r"^resolved (\d+\.\d+)$", logs[1], re.MULTILINE)[0])
    print(f"MASTER_ADDR resolved {resolved - asked:.2f} s after rank 1 first asked")
    # What rank 1 sent by name arrived at rank 0's port.
    assert "rank 1 sent" in logs[1]
    assert re.search(r"^hello from rank 1 at \d+\.\d+$", logs[0], re.MULTILINE), logs[0]
    dns_runtime.forget(gang)
