"""The node agent's vocabulary and state (tools.k8s.node_agent): the annotations that
shape a simulated pod, a node's and a container's records, the agent's own state,
the pod statuses it writes to the API server and the server of container logs.
Starts no container and watches nothing.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import http.server
import logging
import os
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

from kubernetes import client
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


def now_rfc3339(at: float | None = None) -> str:
    moment = dt.datetime.fromtimestamp(time.time() if at is None else at, tz=dt.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


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


class AgentState:
    """The state of one node agent, the pod statuses it writes and its log server."""

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

    # -- status writes -------------------------------------------------------
    def _report_running(self, pod: Any, container: Container) -> None:
        started = now_rfc3339(container.started_at)
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
        now = now_rfc3339()
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
        finished = now_rfc3339(container.finished_at)
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
                                "startedAt": now_rfc3339(container.started_at),
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
                if query.get("follow") == ["true"]:
                    self._follow(path, agent._containers.get((namespace, pod)))
                    return
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

            def _follow(self, path: Path, container: Container | None) -> None:
                """The log from its start and as it grows, until its container ends, as a
                kubelet follows one: the answer has no length and ends with the
                connection (HTTP/1.0)."""
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                with open(path, "rb") as log, contextlib.suppress(OSError):
                    while True:
                        ended = container is None or container.done.is_set()
                        chunk = log.read(64 * 1024)
                        if chunk:
                            self.wfile.write(chunk)
                            self.wfile.flush()
                            continue
                        if ended:
                            return
                        container.done.wait(0.1)

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
