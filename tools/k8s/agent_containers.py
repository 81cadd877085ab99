"""How the node agent runs a pod's containers (tools.k8s.node_agent): each node's root
folder and the claims' folders, init containers, ConfigMap files, the environment,
the process itself and its ending by signal or deadline. Neither registers nodes nor
watches pods.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from tools.k8s.agent_state import (
    ANNOTATION_EXIT_CODE,
    ANNOTATION_EXIT_ON_TERM,
    ANNOTATION_RUN,
    ANNOTATION_RUN_SECONDS,
    ANNOTATION_TERM_SECONDS,
    CLAIM_ROOT_MODE,
    INIT_TIMEOUT_SECONDS,
    AgentState,
    Container,
    now_rfc3339,
)

log = logging.getLogger("qm.node_agent")


class ContainerRunner(AgentState):
    """Runs and stops the containers of the pods bound to the agent's nodes."""

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
        now = now_rfc3339()
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
