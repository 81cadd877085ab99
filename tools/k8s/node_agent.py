"""A test-side kubelet for GPU nodes that exist only as API objects.

The control plane for tests has no kubelet and no container runtime. This agent
registers Node objects with ``nvidia.com/gpu`` capacity, keeps them Ready by
renewing their Leases, and runs the pods kube-scheduler binds to them:

* a pod annotated ``agent.quartermaster.dev/run: process`` (every pod, with
  ``run_processes``) runs its container's command and args as a real local
  process (its own process group, env resolved from values, Secrets and field
  references, output in a log file);
* any other pod is a simulated container: it runs until it is deleted, then
  exits ``agent.quartermaster.dev/exit-code-on-term`` (default 143, what a
  process without a SIGTERM handler returns) after
  ``agent.quartermaster.dev/term-seconds`` (default 0); with
  ``agent.quartermaster.dev/run-seconds`` it exits by itself with
  ``agent.quartermaster.dev/exit-code`` (default 0) after that long.

Each node has its own root filesystem, a folder ``<work_dir>/nodes/<node>/root``,
as real machines do: an absolute path a process pod gets through its
environment (``QM_CHECKPOINT_DIR``, say) is taken inside that folder, unless it
lies under one of the container's volume mounts of a PersistentVolumeClaim,
whose files live in one folder per claim (``<work_dir>/volumes/<namespace>/
<claim>``) that every node sees. So a file written outside a declared volume
on one node is not there on another. (The command itself and its
interpreter are the host's: the agent's "image" is the host.) A volume mount's
``subPath`` is honoured: the container's path is that folder of the claim, and
a missing one is created as the kubelet does (by root, with the mode of the
claim's root). A claim's folder starts out as an administrator prepares the real
checkpoint volume: owned by root, mode 1733 (anyone may create an entry, no one
may list the folder or remove someone else's entry).

A process pod's init containers run first, one after another, each to its end
(their output is their own container log); one that fails fails the pod, with
its exit code in ``initContainerStatuses``, and the main container never starts.
With ``run_as_pod_users`` (the agent must run as root) every process runs as the
pod's ``runAsUser`` and ``runAsGroup`` (a container's own override the pod's),
with ``fsGroup`` and ``supplementalGroups`` as its supplementary groups, as a
container runtime starts it; ids are numbers, nothing needs to exist in
/etc/passwd. Each node's ``/tmp`` is then mode 1777 and the working folder
belongs to that user. It is off by default because the older process-mode tests
hand their ranks root-only temporary folders.

A ConfigMap volume is written into the node's root filesystem at its mount
path before the process starts (each key, or each of ``items``, a file), and
rewritten by replacing the file whenever the ConfigMap changes, checked every
``config_map_seconds`` (a real kubelet takes up to about a minute; tests want
less). A ConfigMap that does not exist keeps the pod from starting
(``CreateContainerConfigError``), as on a real node.

An image must be in ``pullable_images`` (by prefix) when that is given: any
other pod is left waiting with ``ErrImagePull`` then ``ImagePullBackOff``, as
a kubelet that cannot pull it would leave it.

Deletion is honoured like the kubelet does: SIGTERM at once (to the main
process only, as a container runtime does), SIGKILL to all its processes when the
grace period ends (a later, shorter grace period moves the deadline), then the
final container status with its exit code is written and the pod object is
deleted with grace 0. Container logs are served on the kubelet's
``/containerLogs`` path over TLS, so ``kubectl logs`` and the pod log API work.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from tools.k8s.agent_containers import ContainerRunner
from tools.k8s.agent_state import (
    FLAVOR_LABEL,
    GPU_RESOURCE,
    LEASE_NAMESPACE,
    Container,
    NodeSpec,
    now_rfc3339,
)

log = logging.getLogger("qm.node_agent")


# How often the agent posts its nodes' status besides renewing their leases.
NODE_STATUS_SECONDS = 10.0


def _micro_time(at: float | None = None) -> str:
    moment = dt.datetime.fromtimestamp(time.time() if at is None else at, tz=dt.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class NodeAgent(ContainerRunner):
    """Plays the kubelet for a set of Node objects on one control plane."""

    # -- lifecycle -----------------------------------------------------------
    def start(self, *, timeout: float = 60.0) -> None:
        """Register the nodes, start heartbeats, the log server and the pod watch."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._start_log_server()
        for spec in self.nodes.values():
            self._register(spec)
        for target, name in (
            (self._heartbeat_loop, "heartbeat"),
            (self._watch_loop, "watch"),
            (self._config_map_loop, "config-maps"),
        ):
            thread = threading.Thread(target=target, name=f"agent-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        self.wait_schedulable(timeout=timeout)

    def stop(self) -> None:
        """Kill every container, stop the threads and remove the nodes and their leases."""
        self._stop.set()
        with self._lock:
            containers = list(self._containers.values())
        for container in containers:
            self._signal(container, signal.SIGKILL)
        for thread in self._threads:
            thread.join(timeout=70)
        self._writer.shutdown(wait=True)
        for name in self.nodes:
            with contextlib.suppress(ApiException):
                self.core.delete_node(name)
            with contextlib.suppress(ApiException):
                self.coordination.delete_namespaced_lease(name, LEASE_NAMESPACE)
        if self._log_server is not None:
            self._log_server.shutdown()
            self._log_server.server_close()

    def wait_schedulable(self, *, timeout: float = 60.0) -> None:
        """Wait until every node is Ready and free of the not-ready taint."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pending = []
            for name in self.nodes:
                node = self.core.read_node(name)
                taints = [t.key for t in node.spec.taints or []]
                if taints:
                    pending.append(f"{name} {taints}")
            if not pending:
                return
            time.sleep(0.2)
        raise TimeoutError(f"nodes still tainted: {pending}")

    def lose_node(self, name: str) -> None:
        """Simulate losing a node: its containers vanish and its heartbeats stop."""
        with self._lock:
            self._lost_nodes.add(name)
            lost = [c for c in self._containers.values() if c.node == name]
        for container in lost:
            # A lost machine reports nothing: the processes just die with it.
            container.reported_final = True
            self._signal(container, signal.SIGKILL)

    # -- nodes and heartbeats ------------------------------------------------
    def _register(self, spec: NodeSpec) -> None:
        capacity = {
            "cpu": "64",
            "memory": "512Gi",
            "pods": "110",
            "ephemeral-storage": "1Ti",
            GPU_RESOURCE: str(spec.gpus),
        }
        conditions = _conditions(now_rfc3339())
        status = {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": conditions,
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": spec.name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.log_port}},
            "nodeInfo": {
                "machineID": spec.name,
                "systemUUID": spec.name,
                "bootID": spec.name,
                "kernelVersion": os.uname().release,
                "osImage": "quartermaster node agent",
                "containerRuntimeVersion": "qm-agent://1",
                "kubeletVersion": "v1.34.4",
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": spec.name,
                "labels": {
                    "kubernetes.io/hostname": spec.name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    FLAVOR_LABEL: spec.flavor,
                },
            },
            "status": status,
        }
        with contextlib.suppress(ApiException):
            self.core.delete_node(spec.name)
        self.core.create_node(body)
        # Status set at creation is kept for nodes, but write it through the
        # status subresource as well so no admission default can shadow it.
        self.core.patch_node_status(spec.name, {"status": status})
        self._renew_lease(spec.name)

    def _renew_lease(self, name: str) -> None:
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": name, "namespace": LEASE_NAMESPACE},
            "spec": {
                "holderIdentity": name,
                "leaseDurationSeconds": 40,
                "renewTime": _micro_time(),
            },
        }
        try:
            self.coordination.patch_namespaced_lease(name, LEASE_NAMESPACE, {"spec": body["spec"]})
        except ApiException as error:
            if error.status != 404:
                raise
            self.coordination.create_namespaced_lease(LEASE_NAMESPACE, body)

    def _heartbeat_loop(self) -> None:
        posted = time.monotonic()
        while not self._stop.wait(self.heartbeat_seconds):
            # A kubelet posts its node's status every 10 s as well as its lease: the
            # node lifecycle controller marks a node whose lease lapsed (8 s here, on a
            # machine busy enough to delay a renewal) Unknown and taints it, and only a
            # Ready status posted again brings it back.
            post_status = time.monotonic() - posted >= NODE_STATUS_SECONDS
            if post_status:
                posted = time.monotonic()
            for name in self.nodes:
                if name in self._lost_nodes:
                    continue
                if post_status:
                    try:
                        self.core.patch_node_status(
                            name,
                            {
                                "status": {
                                    "conditions": _conditions(now_rfc3339(), transition=False)
                                }
                            },
                        )
                    except Exception as error:
                        log.warning("status of %s not posted: %s", name, error)
                # Nothing may end this loop but stop(): a kubelet whose heartbeat dies
                # leaves its nodes NotReady and tainted for the rest of the session, and
                # every later test on them fails. On a loaded machine the client raised
                # urllib3's own errors (not OSError) and did just that.
                try:
                    self._renew_lease(name)
                except Exception as error:
                    log.warning("lease renewal for %s failed: %s", name, error)

    # -- pod watch -----------------------------------------------------------
    def _watch_loop(self) -> None:
        resource_version = ""
        while not self._stop.is_set():
            try:
                if not resource_version:
                    listing = self.core.list_pod_for_all_namespaces()
                    for pod in listing.items:
                        self._on_pod("ADDED", pod)
                    resource_version = listing.metadata.resource_version
                stream = watch.Watch().stream(
                    self.core.list_pod_for_all_namespaces,
                    resource_version=resource_version,
                    timeout_seconds=5,
                    allow_watch_bookmarks=True,
                )
                for event in stream:
                    if self._stop.is_set():
                        break
                    pod = event["object"]
                    if event["type"] == "ERROR":
                        resource_version = ""
                        break
                    if event["type"] == "BOOKMARK":
                        # Bookmarks arrive as plain dicts: they only move the version on.
                        resource_version = pod["metadata"]["resourceVersion"]
                        continue
                    resource_version = pod.metadata.resource_version
                    self._on_pod(event["type"], pod)
            except ApiException as error:
                # 410 Gone: the resourceVersion fell out of the watch window.
                resource_version = ""
                if error.status != 410:
                    log.warning("pod watch failed: %s", error)
                    time.sleep(0.5)
            except Exception:
                log.exception("pod watch failed")
                resource_version = ""
                time.sleep(0.5)

    def _on_pod(self, kind: str, pod: Any) -> None:
        node = pod.spec.node_name
        if node not in self.nodes or node in self._lost_nodes:
            return
        key = (pod.metadata.namespace, pod.metadata.name)
        with self._lock:
            container = self._containers.get(key)
            if container is not None and container.uid != pod.metadata.uid:
                container = None
            if kind == "DELETED":
                if container is not None:
                    self._signal(container, signal.SIGKILL)
                    self._containers.pop(key, None)
                return
            if container is None and pod.metadata.uid in self._pull_failed:
                if pod.metadata.deletion_timestamp is not None:
                    self._pull_failed.discard(pod.metadata.uid)
                    self._writer.submit(self._report_never_started, pod)
                return
            if container is None and pod.metadata.uid in self._init_failed:
                if pod.metadata.deletion_timestamp is not None:
                    self._init_failed.discard(pod.metadata.uid)
                    self._writer.submit(
                        self._delete_now,
                        pod.metadata.namespace,
                        pod.metadata.name,
                        pod.metadata.uid,
                    )
                return
            if container is None:
                if pod.metadata.deletion_timestamp is not None:
                    # Never started here (or finished before this agent
                    # started): nothing to stop, so the object can go.
                    self._writer.submit(
                        self._delete_now,
                        pod.metadata.namespace,
                        pod.metadata.name,
                        pod.metadata.uid,
                    )
                    return
                if pod.status.phase in ("Succeeded", "Failed"):
                    return
                container = self._start(pod)
                if container is None:
                    return
                self._containers[key] = container
            if pod.metadata.deletion_timestamp is not None:
                grace = pod.metadata.deletion_grace_period_seconds or 0
                self._terminate(container, float(grace))
                if (
                    container.done.is_set()
                    and container.reported_final
                    and not container.deleted_object
                ):
                    container.deleted_object = True
                    self._writer.submit(
                        self._delete_now, container.namespace, container.pod, container.uid
                    )

    # -- inspection for tests ----------------------------------------------------
    def container(self, namespace: str, pod: str) -> Container | None:
        """The agent's record of a pod's container, if it ran here."""
        with self._lock:
            return self._containers.get((namespace, pod))


def _conditions(now: str, *, transition: bool = True) -> list[dict[str, str]]:
    """A healthy node's conditions, as a kubelet posts them: no pressure, and Ready;
    ``transition`` sets their lastTransitionTime too (at registration)."""
    healthy = [
        {"type": kind, "status": "False", "reason": f"KubeletHas{reason}"}
        for kind, reason in (
            ("MemoryPressure", "SufficientMemory"),
            ("DiskPressure", "NoDiskPressure"),
            ("PIDPressure", "SufficientPID"),
        )
    ] + [
        {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "quartermaster node agent is posting ready status",
        }
    ]
    for condition in healthy:
        condition["lastHeartbeatTime"] = now
        if transition:
            condition["lastTransitionTime"] = now
    return healthy


def parse_node(text: str) -> NodeSpec:
    """Parse ``NAME:GPUS[:FLAVOR]`` as given on the command line."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[1].isdigit():
        raise ValueError(f"node must be NAME:GPUS[:FLAVOR], got {text!r}")
    return NodeSpec(parts[0], int(parts[1]), parts[2] if len(parts) == 3 else "h100")


def main(argv: list[str] | None = None) -> int:
    """Run the agent in the foreground until SIGTERM or SIGINT.

    ``python -m tools.k8s.node_agent --node gpu-node-0:8 --node gpu-node-1:8``
    uses the control plane started by ``python -m tools.k8s.controlplane up``.
    """
    import argparse

    from kubernetes import config as kube_config

    from tools.k8s.controlplane import ControlPlane

    parser = argparse.ArgumentParser(prog="python -m tools.k8s.node_agent")
    parser.add_argument("--node", action="append", type=parse_node, required=True)
    parser.add_argument("--kubeconfig", default=None)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument(
        "--run-processes",
        action="store_true",
        help="run every pod's command as a local process, not only annotated ones",
    )
    args = parser.parse_args(argv)
    plane = ControlPlane.attach()
    kubeconfig = args.kubeconfig or (plane.state.kubeconfig if plane and plane.state else None)
    if kubeconfig is None:
        parser.error("no --kubeconfig and no control plane is up")
    configuration = client.Configuration()
    kube_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    configuration.connection_pool_maxsize = 32
    api = client.ApiClient(configuration)
    serving = None
    if plane is not None:
        serving = (plane.pki / "apiserver.crt", plane.pki / "apiserver.key")
    work_dir = args.work_dir or Path(f"/tmp/qm-node-agent-{os.getpid()}")
    agent = NodeAgent(
        api, args.node, work_dir=work_dir, serving_cert=serving, run_processes=args.run_processes
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    agent.start()
    print(f"node agent ready: {', '.join(agent.nodes)}", flush=True)
    stop.wait()
    agent.stop()
    api.close()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    raise SystemExit(main())
