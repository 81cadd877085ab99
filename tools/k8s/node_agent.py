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

import base64
import contextlib
import datetime as dt
import http.server
import logging
import os
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("qm.node_agent")

ANNOTATION_RUN = "agent.quartermaster.dev/run"
ANNOTATION_TERM_SECONDS = "agent.quartermaster.dev/term-seconds"
ANNOTATION_EXIT_ON_TERM = "agent.quartermaster.dev/exit-code-on-term"
ANNOTATION_RUN_SECONDS = "agent.quartermaster.dev/run-seconds"
ANNOTATION_EXIT_CODE = "agent.quartermaster.dev/exit-code"
FLAVOR_LABEL = "quartermaster.dev/flavor"
GPU_RESOURCE = "nvidia.com/gpu"
LEASE_NAMESPACE = "kube-node-lease"
# A claim's folder as the administrator prepares the checkpoint volume's root
# (deploy/checkpoints.yaml): sticky, writable and passable by all, listable by none.
CLAIM_ROOT_MODE = 0o1733
INIT_TIMEOUT_SECONDS = 60.0


@dataclass(frozen=True)
class NodeSpec:
    """A GPU node the agent registers and plays the kubelet for."""

    name: str
    gpus: int
    flavor: str = "h100"


def _now_rfc3339(at: float | None = None) -> str:
    moment = dt.datetime.fromtimestamp(time.time() if at is None else at, tz=dt.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_time(at: float | None = None) -> str:
    moment = dt.datetime.fromtimestamp(time.time() if at is None else at, tz=dt.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class Container:
    """One pod's single container as the agent runs it."""

    namespace: str
    pod: str
    uid: str
    name: str
    image: str
    mode: str  # "process" | "simulated"
    node: str
    log_path: Path
    started_at: float
    term_seconds: float = 0.0
    exit_code_on_term: int = 143
    process: subprocess.Popen[bytes] | None = None
    exit_code: int | None = None
    finished_at: float | None = None
    term_sent_at: float | None = None
    kill_deadline: float | None = None
    reported_final: bool = False
    deleted_object: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    # (file on this host, ConfigMap name, key) of each ConfigMap volume file.
    config_files: list[tuple[Path, str, str]] = field(default_factory=list)


class NodeAgent:
    """Plays the kubelet for a set of Node objects on one control plane."""

    def __init__(
        self,
        api_client: client.ApiClient,
        nodes: Iterable[NodeSpec],
        *,
        work_dir: Path,
        serving_cert: tuple[Path, Path] | None = None,
        heartbeat_seconds: float = 2.0,
        local_rendezvous: bool = True,
        run_processes: bool = False,
        pullable_images: Iterable[str] | None = None,
        config_map_seconds: float = 1.0,
        run_as_pod_users: bool = False,
    ) -> None:
        self.api_client = api_client
        if run_as_pod_users and os.geteuid() != 0:
            raise PermissionError("run_as_pod_users needs the node agent to run as root")
        self.run_as_pod_users = run_as_pod_users
        self.pullable_images = None if pullable_images is None else tuple(pullable_images)
        self.core = client.CoreV1Api(api_client)
        self.coordination = client.CoordinationV1Api(api_client)
        self.nodes = {spec.name: spec for spec in nodes}
        self.work_dir = work_dir
        self.serving_cert = serving_cert
        self.heartbeat_seconds = heartbeat_seconds
        # Ranks running as local processes cannot resolve pod DNS names; point
        # their rendezvous at loopback with one free port per gang instead.
        self.local_rendezvous = local_rendezvous
        # Run every pod's command as a process, annotation or not (drills).
        self.run_processes = run_processes
        self.config_map_seconds = config_map_seconds
        self._rendezvous_ports: dict[tuple[str, str], int] = {}
        self._containers: dict[tuple[str, str], Container] = {}
        # Pods (by uid) whose image this agent cannot pull: they wait, never start.
        self._pull_failed: set[str] = set()
        # Pods (by uid) whose init container failed: terminal, never started again.
        self._init_failed: set[str] = set()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._lost_nodes: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._writer = ThreadPoolExecutor(max_workers=16, thread_name_prefix="agent-status")
        self._log_server: http.server.ThreadingHTTPServer | None = None
        self.log_port = 0

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
        now = _now_rfc3339()
        conditions = [
            {
                "type": kind,
                "status": "False",
                "reason": f"KubeletHas{reason}",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
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
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
        ]
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
        while not self._stop.wait(self.heartbeat_seconds):
            for name in self.nodes:
                if name in self._lost_nodes:
                    continue
                try:
                    self._renew_lease(name)
                except (ApiException, OSError) as error:
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

    # -- containers ----------------------------------------------------------
    def node_root(self, node: str) -> Path:
        """The folder that is ``/`` on ``node``."""
        return self.work_dir / "nodes" / node / "root"

    def claim_folder(self, namespace: str, claim: str) -> Path:
        """The shared folder behind a PersistentVolumeClaim, the same from every node."""
        return self.work_dir / "volumes" / namespace / claim

    def _prepared_claim_folder(self, namespace: str, claim: str) -> Path:
        folder = self.claim_folder(namespace, claim)
        with self._lock:
            if not folder.exists():
                folder.mkdir(parents=True)
                os.chmod(folder, CLAIM_ROOT_MODE)
        return folder

    def host_path(self, pod: Any, spec: Any, path: str) -> str:
        """Where a path inside ``pod``'s container lives on this host."""
        claims = {
            volume.name: volume.persistent_volume_claim.claim_name
            for volume in pod.spec.volumes or []
            if volume.persistent_volume_claim is not None
        }
        mounts = sorted(
            (m for m in spec.volume_mounts or [] if m.name in claims),
            key=lambda m: len(m.mount_path),
            reverse=True,
        )
        normal = os.path.normpath(path)
        for mount in mounts:
            base = os.path.normpath(mount.mount_path)
            if normal == base or normal.startswith(base.rstrip("/") + "/"):
                folder = self._prepared_claim_folder(pod.metadata.namespace, claims[mount.name])
                if mount.sub_path:
                    root_mode = folder.stat().st_mode & 0o7777
                    folder = folder / mount.sub_path
                    if not folder.exists():
                        # As the kubelet does: made by root, with the root's mode.
                        folder.mkdir(parents=True, exist_ok=True)
                        os.chmod(folder, root_mode)
                return str(folder / os.path.relpath(normal, base))
        return str(self.node_root(pod.spec.node_name) / normal.lstrip("/"))

    def _pullable(self, image: str) -> bool:
        return self.pullable_images is None or any(
            image.startswith(prefix) for prefix in self.pullable_images
        )

    def _start(self, pod: Any) -> Container | None:
        annotations = pod.metadata.annotations or {}
        spec = pod.spec.containers[0]
        namespace, name = pod.metadata.namespace, pod.metadata.name
        if not self._pullable(spec.image or ""):
            self._pull_failed.add(pod.metadata.uid)
            self._writer.submit(self._report_pull_failure, pod, spec)
            return None
        log_dir = self.work_dir / "logs" / namespace
        log_dir.mkdir(parents=True, exist_ok=True)
        container = Container(
            namespace=namespace,
            pod=name,
            uid=pod.metadata.uid,
            name=spec.name,
            image=spec.image or "",
            mode=(
                "process"
                if self.run_processes or annotations.get(ANNOTATION_RUN) == "process"
                else "simulated"
            ),
            node=pod.spec.node_name,
            log_path=log_dir / f"{name}_{spec.name}.log",
            started_at=time.time(),
            term_seconds=float(annotations.get(ANNOTATION_TERM_SECONDS, "0")),
            exit_code_on_term=int(annotations.get(ANNOTATION_EXIT_ON_TERM, "143")),
        )
        if container.mode == "process":
            # Before the rank's own paths are resolved: a kubelet makes a missing
            # subPath folder (as root) only when it starts that container.
            try:
                self._run_init_containers(pod)
            except _InitFailed as failed:
                self._init_failed.add(pod.metadata.uid)
                self._writer.submit(self._report_init_failure, pod, failed)
                return None
            try:
                env = self._resolve_env(pod, spec)
            except ApiException as error:
                self._writer.submit(self._report_failed_start, pod, f"env: {error.reason}")
                return None
            try:
                container.config_files = self._config_map_files(pod, spec)
                self._write_config_maps(container)
            except ApiException as error:
                self._writer.submit(
                    self._report_failed_start, pod, f"configMap volume: {error.reason}"
                )
                return None
            argv = list(spec.command or []) + list(spec.args or [])
            identity = self._identity(pod, spec)
            work = self._working_folder(pod, spec, name, identity)
            with open(container.log_path, "ab") as out:
                container.process = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=str(work),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    **identity,
                )
            waiter = threading.Thread(
                target=self._wait_process, args=(container,), daemon=True, name=f"wait-{name}"
            )
            waiter.start()
        else:
            with open(container.log_path, "ab") as out:
                out.write(
                    f"simulated container {spec.name} started on {pod.spec.node_name}\n".encode()
                )
            run_seconds = annotations.get(ANNOTATION_RUN_SECONDS)
            if run_seconds is not None:
                code = int(annotations.get(ANNOTATION_EXIT_CODE, "0"))
                timer = threading.Timer(float(run_seconds), self._exited, args=(container, code))
                timer.daemon = True
                timer.start()
        self._writer.submit(self._report_running, pod, container)
        return container

    def _identity(self, pod: Any, spec: Any) -> dict[str, Any]:
        """Popen's user, group and extra_groups for a container, as a container runtime
        sets them from the security contexts; nothing without ``run_as_pod_users``."""
        if not self.run_as_pod_users:
            return {}
        pod_context = pod.spec.security_context
        own = spec.security_context
        user = (own.run_as_user if own else None) or (
            pod_context.run_as_user if pod_context else None
        )
        group = (own.run_as_group if own else None) or (
            pod_context.run_as_group if pod_context else None
        )
        extra: list[int] = []
        if pod_context is not None:
            if pod_context.fs_group is not None:
                extra.append(int(pod_context.fs_group))
            extra.extend(int(g) for g in pod_context.supplemental_groups or [])
        identity: dict[str, Any] = {"extra_groups": sorted(set(extra))}
        if user is not None:
            identity["user"] = int(user)
        if group is not None:
            identity["group"] = int(group)
        return identity

    def _working_folder(self, pod: Any, spec: Any, name: str, identity: dict[str, Any]) -> Path:
        if identity:
            tmp = self.node_root(pod.spec.node_name) / "tmp"
            tmp.mkdir(parents=True, exist_ok=True)
            os.chmod(tmp, 0o1777)
        work = Path(self.host_path(pod, spec, spec.working_dir or f"/tmp/{name}"))
        work.mkdir(parents=True, exist_ok=True)
        if identity.get("user") is not None and not spec.working_dir:
            os.chown(work, identity["user"], identity.get("group", -1))
        return work

    def _run_init_containers(self, pod: Any) -> None:
        """Run each init container to its end, in order; raise _InitFailed on the first
        that fails (or cannot start). Runs on the watch thread: init containers here
        are short (the runtime's makes a folder)."""
        log_dir = self.work_dir / "logs" / pod.metadata.namespace
        for spec in pod.spec.init_containers or []:
            log_path = log_dir / f"{pod.metadata.name}_{spec.name}.log"
            try:
                env = self._resolve_env(pod, spec)
                identity = self._identity(pod, spec)
                work = self._working_folder(pod, spec, f"{pod.metadata.name}-{spec.name}", identity)
                with open(log_path, "ab") as out:
                    code = subprocess.run(
                        list(spec.command or []) + list(spec.args or []),
                        env=env,
                        cwd=str(work),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        timeout=INIT_TIMEOUT_SECONDS,
                        check=False,
                        **identity,
                    ).returncode
            except (ApiException, OSError, subprocess.TimeoutExpired) as error:
                log_path.parent.mkdir(parents=True, exist_ok=True)
                with open(log_path, "ab") as out:
                    out.write(f"init container {spec.name} did not run: {error}\n".encode())
                raise _InitFailed(spec.name, spec.image or "", 128) from error
            if code != 0:
                raise _InitFailed(spec.name, spec.image or "", 128 - code if code < 0 else code)

    def _report_init_failure(self, pod: Any, failed: _InitFailed) -> None:
        """A pod whose init container failed: Failed, as the kubelet reports it with
        restartPolicy Never, the rank's container never started."""
        now = _now_rfc3339()
        main = pod.spec.containers[0]
        body = {
            "status": {
                "phase": "Failed",
                "initContainerStatuses": [
                    {
                        "name": failed.name,
                        "image": failed.image,
                        "imageID": "",
                        "ready": False,
                        "restartCount": 0,
                        "state": {
                            "terminated": {
                                "exitCode": failed.exit_code,
                                "reason": "Error",
                                "startedAt": now,
                                "finishedAt": now,
                            }
                        },
                    }
                ],
                "containerStatuses": [
                    {
                        "name": main.name,
                        "image": main.image or "",
                        "imageID": "",
                        "ready": False,
                        "restartCount": 0,
                        "state": {"waiting": {"reason": "PodInitializing"}},
                    }
                ],
            }
        }
        with contextlib.suppress(ApiException):
            self.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, body)

    def _config_map_files(self, pod: Any, spec: Any) -> list[tuple[Path, str, str]]:
        """Where each file of the container's ConfigMap volumes lies on this host."""
        volumes = {
            volume.name: volume.config_map
            for volume in pod.spec.volumes or []
            if volume.config_map is not None
        }
        files = []
        for mount in spec.volume_mounts or []:
            source = volumes.get(mount.name)
            if source is None:
                continue
            folder = self.node_root(pod.spec.node_name) / mount.mount_path.lstrip("/")
            if source.items:
                pairs = [(item.path, item.key) for item in source.items]
            else:
                data = self.core.read_namespaced_config_map(source.name, pod.metadata.namespace)
                pairs = [(key, key) for key in sorted(data.data or {})]
            files.extend((folder / path, source.name, key) for path, key in pairs)
        return files

    def _write_config_maps(self, container: Container) -> None:
        """Write each ConfigMap volume file whose content changed, by rename, so a
        reader sees the old file or the new one, never half of one."""
        cache: dict[str, dict[str, str]] = {}
        for path, name, key in container.config_files:
            if name not in cache:
                found = self.core.read_namespaced_config_map(name, container.namespace)
                cache[name] = dict(found.data or {})
            text = cache[name].get(key, "")
            with contextlib.suppress(OSError):
                if path.read_text() == text:
                    continue
            path.parent.mkdir(parents=True, exist_ok=True)
            fresh = path.with_name(f".{path.name}.{os.getpid()}")
            fresh.write_text(text)
            os.replace(fresh, path)

    def _config_map_loop(self) -> None:
        while not self._stop.wait(self.config_map_seconds):
            with self._lock:
                running = [
                    c for c in self._containers.values() if c.config_files and not c.done.is_set()
                ]
            for container in running:
                try:
                    self._write_config_maps(container)
                except (ApiException, OSError) as error:
                    # As a kubelet does: the files keep their last content.
                    log.warning("configMap refresh for %s failed: %s", container.pod, error)

    def _resolve_env(self, pod: Any, spec: Any) -> dict[str, str]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/root"),
            "HOSTNAME": pod.spec.hostname or pod.metadata.name,
        }
        for var in spec.env or []:
            if var.value is not None and var.value.startswith("/"):
                env[var.name] = self.host_path(pod, spec, var.value)
            elif var.value is not None:
                env[var.name] = var.value
            elif var.value_from is not None and var.value_from.secret_key_ref is not None:
                ref = var.value_from.secret_key_ref
                secret = self.core.read_namespaced_secret(ref.name, pod.metadata.namespace)
                env[var.name] = base64.b64decode((secret.data or {})[ref.key]).decode()
            elif var.value_from is not None and var.value_from.field_ref is not None:
                env[var.name] = self._field(pod, var.value_from.field_ref.field_path)
            else:
                env[var.name] = ""
        if self.local_rendezvous and "MASTER_ADDR" in env:
            group = (pod.metadata.namespace, pod.spec.subdomain or env["MASTER_ADDR"])
            with self._lock:
                if group not in self._rendezvous_ports:
                    self._rendezvous_ports[group] = _free_port()
                env["MASTER_ADDR"] = "127.0.0.1"
                env["MASTER_PORT"] = str(self._rendezvous_ports[group])
        return env

    @staticmethod
    def _field(pod: Any, path: str) -> str:
        if path == "metadata.name":
            return str(pod.metadata.name)
        if path == "metadata.namespace":
            return str(pod.metadata.namespace)
        if path == "spec.nodeName":
            return str(pod.spec.node_name)
        if path in ("status.podIP", "status.hostIP"):
            return "127.0.0.1"
        if path.startswith("metadata.labels['") and path.endswith("']"):
            return str((pod.metadata.labels or {}).get(path[len("metadata.labels['") : -2], ""))
        return ""

    def _wait_process(self, container: Container) -> None:
        assert container.process is not None
        returncode = container.process.wait()
        # A process killed by signal N reports -N; containers report 128+N.
        self._exited(container, 128 - returncode if returncode < 0 else returncode)

    def _terminate(self, container: Container, grace: float) -> None:
        """Start graceful termination, or move its deadline earlier."""
        now = time.time()
        if container.done.is_set():
            return
        deadline = now + grace
        if container.term_sent_at is None:
            container.term_sent_at = now
            container.kill_deadline = deadline
            if grace <= 0:
                self._signal(container, signal.SIGKILL)
                return
            self._signal(container, signal.SIGTERM)
            timer = threading.Timer(grace, self._kill_at_deadline, args=(container,))
            timer.daemon = True
            timer.start()
        elif container.kill_deadline is not None and deadline < container.kill_deadline - 0.05:
            container.kill_deadline = deadline
            if grace <= 0:
                self._signal(container, signal.SIGKILL)
                return
            timer = threading.Timer(grace, self._kill_at_deadline, args=(container,))
            timer.daemon = True
            timer.start()

    def _kill_at_deadline(self, container: Container) -> None:
        if container.done.is_set() or container.kill_deadline is None:
            return
        if time.time() + 0.01 < container.kill_deadline:
            return
        self._signal(container, signal.SIGKILL)

    def _signal(self, container: Container, signum: signal.Signals) -> None:
        if container.done.is_set():
            return
        if container.process is not None:
            with contextlib.suppress(ProcessLookupError):
                if signum == signal.SIGKILL:
                    # Killing a container kills every process in it.
                    os.killpg(container.process.pid, signum)
                else:
                    # A container runtime signals the main process only.
                    os.kill(container.process.pid, signum)
            return
        if signum == signal.SIGKILL:
            self._exited(container, 128 + signal.SIGKILL)
        else:
            timer = threading.Timer(
                container.term_seconds,
                self._exited,
                args=(container, container.exit_code_on_term),
            )
            timer.daemon = True
            timer.start()

    def _exited(self, container: Container, code: int) -> None:
        with self._lock:
            if container.done.is_set():
                return
            container.exit_code = code
            container.finished_at = time.time()
            container.done.set()
        if container.process is None:
            with open(container.log_path, "ab") as out:
                out.write(f"simulated container exited with {code}\n".encode())
        if container.reported_final:
            return
        if not self._stop.is_set():
            self._writer.submit(self._report_exited, container)

    # -- status writes -------------------------------------------------------
    def _report_running(self, pod: Any, container: Container) -> None:
        started = _now_rfc3339(container.started_at)
        body = {
            "status": {
                "phase": "Running",
                "hostIP": "127.0.0.1",
                "hostIPs": [{"ip": "127.0.0.1"}],
                "podIP": "127.0.0.1",
                "podIPs": [{"ip": "127.0.0.1"}],
                "startTime": started,
                "conditions": [
                    {"type": kind, "status": "True", "lastTransitionTime": started}
                    for kind in (
                        "PodReadyToStartContainers",
                        "Initialized",
                        "ContainersReady",
                        "Ready",
                    )
                ],
                "containerStatuses": [
                    {
                        "name": container.name,
                        "image": container.image,
                        "imageID": "",
                        "containerID": f"qm-agent://{container.uid}",
                        "ready": True,
                        "started": True,
                        "restartCount": 0,
                        "state": {"running": {"startedAt": started}},
                    }
                ],
            }
        }
        with self._lock:
            if container.done.is_set():
                return
        try:
            self.core.patch_namespaced_pod_status(container.pod, container.namespace, body)
        except ApiException as error:
            if error.status != 404:
                log.warning("running status of %s failed: %s", container.pod, error)

    def _report_pull_failure(self, pod: Any, spec: Any) -> None:
        """Leave the pod Pending with its container waiting on an image it cannot pull."""
        for reason in ("ErrImagePull", "ImagePullBackOff"):
            body = {
                "status": {
                    "phase": "Pending",
                    "containerStatuses": [
                        {
                            "name": spec.name,
                            "image": spec.image or "",
                            "imageID": "",
                            "ready": False,
                            "started": False,
                            "restartCount": 0,
                            "state": {
                                "waiting": {
                                    "reason": reason,
                                    "message": f'failed to pull image "{spec.image}": not found',
                                }
                            },
                        }
                    ],
                }
            }
            with contextlib.suppress(ApiException):
                self.core.patch_namespaced_pod_status(
                    pod.metadata.name, pod.metadata.namespace, body
                )

    def _report_never_started(self, pod: Any) -> None:
        """A deleted pod whose container never ran: terminal, as the kubelet reports it."""
        spec = pod.spec.containers[0]
        now = _now_rfc3339()
        body = {
            "status": {
                "phase": "Failed",
                "containerStatuses": [
                    {
                        "name": spec.name,
                        "image": spec.image or "",
                        "imageID": "",
                        "ready": False,
                        "started": False,
                        "restartCount": 0,
                        "state": {
                            "terminated": {
                                "exitCode": 137,
                                "reason": "ContainerStatusUnknown",
                                "message": "The container could not be located when the pod "
                                "was deleted.",
                                "startedAt": now,
                                "finishedAt": now,
                            }
                        },
                    }
                ],
            }
        }
        with contextlib.suppress(ApiException):
            self.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, body)
        self._delete_now(pod.metadata.namespace, pod.metadata.name, pod.metadata.uid)

    def _report_failed_start(self, pod: Any, reason: str) -> None:
        body = {
            "status": {"phase": "Failed", "reason": "CreateContainerConfigError", "message": reason}
        }
        with contextlib.suppress(ApiException):
            self.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, body)

    def _report_exited(self, container: Container) -> None:
        code = container.exit_code
        assert code is not None and container.finished_at is not None
        finished = _now_rfc3339(container.finished_at)
        body = {
            "status": {
                "phase": "Succeeded" if code == 0 else "Failed",
                "conditions": [
                    {"type": kind, "status": "False", "lastTransitionTime": finished}
                    for kind in ("ContainersReady", "Ready")
                ],
                "containerStatuses": [
                    {
                        "name": container.name,
                        "image": container.image,
                        "imageID": "",
                        "containerID": f"qm-agent://{container.uid}",
                        "ready": False,
                        "started": False,
                        "restartCount": 0,
                        "state": {
                            "terminated": {
                                "exitCode": code,
                                "reason": "Completed" if code == 0 else "Error",
                                "startedAt": _now_rfc3339(container.started_at),
                                "finishedAt": finished,
                                "containerID": f"qm-agent://{container.uid}",
                            }
                        },
                    }
                ],
            }
        }
        try:
            pod = self.core.patch_namespaced_pod_status(container.pod, container.namespace, body)
        except ApiException as error:
            if error.status != 404:
                log.warning("final status of %s failed: %s", container.pod, error)
            return
        container.reported_final = True
        if pod.metadata.deletion_timestamp is not None and not container.deleted_object:
            container.deleted_object = True
            self._delete_now(container.namespace, container.pod, container.uid)

    def _delete_now(self, namespace: str, name: str, uid: str) -> None:
        """Remove the pod object once its final status is written, as the kubelet does."""
        body = client.V1DeleteOptions(
            grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid)
        )
        try:
            self.core.delete_namespaced_pod(name, namespace, body=body)
        except ApiException as error:
            if error.status not in (404, 409):
                log.warning("deleting %s failed: %s", name, error)

    # -- logs ------------------------------------------------------------------
    def _start_log_server(self) -> None:
        agent = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parsed = urllib.parse.urlparse(self.path)
                parts = parsed.path.strip("/").split("/")
                if len(parts) != 4 or parts[0] != "containerLogs":
                    self.send_error(404)
                    return
                _, namespace, pod, container = parts
                path = agent.work_dir / "logs" / namespace / f"{pod}_{container}.log"
                if not path.exists():
                    self.send_error(404)
                    return
                query = urllib.parse.parse_qs(parsed.query)
                if "tailLines" not in query:
                    # Streamed from the file, as a kubelet does: a reader of the
                    # first bytes of a big log never makes the agent hold it all.
                    size = path.stat().st_size
                    if "limitBytes" in query:
                        size = min(size, int(query["limitBytes"][0]))
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(size))
                    self.end_headers()
                    with open(path, "rb") as log:
                        while size > 0:
                            chunk = log.read(min(size, 64 * 1024))
                            if not chunk:
                                break
                            self.wfile.write(chunk)
                            size -= len(chunk)
                    return
                content = path.read_bytes()
                if "tailLines" in query:
                    lines = content.splitlines(keepends=True)
                    content = b"".join(lines[-int(query["tailLines"][0]) :])
                if "limitBytes" in query:
                    content = content[: int(query["limitBytes"][0])]
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            def log_message(self, format: str, *args: Any) -> None:
                return

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if self.serving_cert is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(self.serving_cert[0]), str(self.serving_cert[1]))
            server.socket = context.wrap_socket(server.socket, server_side=True)
        self.log_port = int(server.server_address[1])
        self._log_server = server
        thread = threading.Thread(target=server.serve_forever, daemon=True, name="agent-logs")
        thread.start()

    # -- inspection for tests ----------------------------------------------------
    def container(self, namespace: str, pod: str) -> Container | None:
        """The agent's record of a pod's container, if it ran here."""
        with self._lock:
            return self._containers.get((namespace, pod))


class _InitFailed(Exception):
    """An init container that exited non-zero or could not start."""

    def __init__(self, name: str, image: str, exit_code: int) -> None:
        super().__init__(f"init container {name} exited {exit_code}")
        self.name = name
        self.image = image
        self.exit_code = exit_code


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
