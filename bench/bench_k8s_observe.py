"""Benchmark: API requests per reconcile cycle at 1,000 running rank pods,
observing by listing versus through the pod watch.

Launches 10 gangs of 100 simulated ranks on 10 nodes of a real control plane,
waits until all 1,000 run, then runs reconcile cycles (``observe(None)`` and
``guard_victims()``, what ``reconcile_jobs`` asks of the runtime) with each
observation mode and prints the requests per cycle by verb and resource and
the cycle time, and the size of one pod listing.

Usage: .venv/bin/python bench/bench_k8s_observe.py [--gangs 10] [--ranks 100] [--cycles 5]
Needs a control plane started with ``python -m tools.k8s.controlplane up``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kubernetes import client, config  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402

from preemption.runtimes.kubernetes import (  # noqa: E402
    KubernetesRuntime,
    KubernetesRuntimeConfig,
)
from tools.k8s.agent_state import NodeSpec  # noqa: E402
from tools.k8s.controlplane import ControlPlane  # noqa: E402
from tools.k8s.gangs import gang_spec  # noqa: E402
from tools.k8s.node_agent import NodeAgent  # noqa: E402
from tools.k8s.requests import Recorder  # noqa: E402
from tools.k8s.wait import wait_for  # noqa: E402

PRIORITY_CLASS = "qm-bench-observe"


def api_client(kubeconfig: str, pool: int = 32) -> client.ApiClient:
    configuration = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    configuration.connection_pool_maxsize = pool
    return client.ApiClient(configuration)


def run(gangs: int, ranks: int, cycles: int) -> None:
    plane = ControlPlane.attach()
    if plane is None or plane.state is None:
        raise SystemExit("no control plane: run python -m tools.k8s.controlplane up")
    kubeconfig = plane.state.kubeconfig
    admin = api_client(kubeconfig)
    core = client.CoreV1Api(admin)
    namespace = f"qm-bench-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": namespace}})
    scheduling = client.SchedulingV1Api(admin)
    with contextlib.suppress(ApiException):
        scheduling.create_priority_class(
            {"metadata": {"name": PRIORITY_CLASS}, "value": 1, "preemptionPolicy": "Never"}
        )
    nodes = [NodeSpec(f"obs-node-{i}", gpus=ranks) for i in range(gangs)]
    agent_api = api_client(kubeconfig, pool=32)
    pki = plane.pki
    agent = NodeAgent(
        agent_api,
        nodes,
        work_dir=Path(tempfile.mkdtemp(prefix="qm-bench-observe-")),
        serving_cert=(pki / "apiserver.crt", pki / "apiserver.key"),
    )
    agent.start()
    # Small CPU and memory requests: the simulated nodes have 64 CPUs each.
    settings = {
        "namespace": namespace,
        "default_image": "none",
        "default_cpu_per_gpu": "10m",
        "default_memory_per_gpu": "10Mi",
    }
    launcher = KubernetesRuntime.from_kubeconfig(kubeconfig, KubernetesRuntimeConfig(**settings))
    try:
        while True:
            try:
                core.read_namespaced_service_account("default", namespace)
                break
            except ApiException:
                time.sleep(0.2)
        started = time.monotonic()
        for index, node in enumerate(nodes):
            launcher.launch(
                gang_spec(9000 + index, {node.name: ranks}, priority_class=PRIORITY_CLASS)
            )
        total = gangs * ranks

        def running() -> bool:
            return sum(o.phase == "running" for o in launcher.observe()) == total

        wait_for(running, timeout=900, interval=2.0, what=f"{total} ranks running")
        print(f"{total} rank pods running after {time.monotonic() - started:.0f} s")
        listing = core.list_namespaced_pod(namespace, _preload_content=False)
        print(f"one listing of the pods is {len(listing.data) / 1e6:.1f} MB of JSON")
        for mode, watch in (("listing", False), ("watch", True)):
            runtime = KubernetesRuntime.from_kubeconfig(
                kubeconfig, KubernetesRuntimeConfig(**settings, watch_pods=watch)
            )
            recorder = Recorder(runtime.api_client)
            runtime.observe()  # warm up (the watch's one listing happens here)
            wait_for(runtime.pod_watch_in_sync if watch else (lambda: True), timeout=120)
            before = len(recorder.log)
            cycle_started = time.monotonic()
            for _ in range(cycles):
                observations = runtime.observe(None)
                runtime.guard_victims()
                assert len(observations) == total
            seconds = (time.monotonic() - cycle_started) / cycles
            kinds = Counter(f"{verb} {resource}" for _, resource, verb in recorder.log[before:])
            per_cycle = {kind: count / cycles for kind, count in sorted(kinds.items())}
            print(
                f"{mode:8} {sum(kinds.values()) / cycles:.1f} requests per cycle {per_cycle}, "
                f"{seconds:.2f} s per cycle"
            )
            runtime.close()
    finally:
        launcher.close()
        agent.stop()
        agent_api.close()
        core.delete_namespace(namespace)
        for pod in core.list_namespaced_pod(namespace).items:
            with contextlib.suppress(ApiException):
                core.patch_namespaced_pod(
                    pod.metadata.name,
                    namespace,
                    [{"op": "replace", "path": "/metadata/finalizers", "value": []}],
                )
        with contextlib.suppress(ApiException):
            scheduling.delete_priority_class(PRIORITY_CLASS)
        admin.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gangs", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=100)
    parser.add_argument("--cycles", type=int, default=5)
    args = parser.parse_args()
    run(args.gangs, args.ranks, args.cycles)


if __name__ == "__main__":
    main()
