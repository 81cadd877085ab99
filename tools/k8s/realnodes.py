"""Real kubelets as nodes of the test control plane.

``RealNodes`` starts, on this machine, one containerd and one kubelet v1.34 per
node, registered to a running ``ControlPlane``, and gives each Node
``nvidia.com/gpu`` capacity. Pods then run as real containers (runc, overlayfs,
a network namespace on a bridge), so a rank meets what a production kubelet
does to it: SIGTERM to the container's PID 1, SIGKILL at the end of
``terminationGracePeriodSeconds``, and an exit code the kubelet reports.

What each node gets (``/work/shared/REAL-NODES.md`` says why each item is there):

* containerd with its own root, state, sockets, runc root and opt folder; CRI
  config ``restrict_oom_score_adj = true`` (root here lacks CAP_SYS_RESOURCE),
  ``disable_apparmor``, ``netns_mounts_under_state_dir`` and the overlayfs
  snapshotter. The rank and pause images of ``tools.k8s.images`` are imported;
* a CNI ``bridge`` network with ``host-local`` addresses, ``isGateway`` and
  ``ipMasq`` off, so nothing host-wide changes. Both nodes share one bridge with
  a range of addresses each, so their pods reach one another. The bridge is made
  here, before any pod, with the host's address on it (``dns_address``, the
  first of the subnet), the one host address a pod reaches: its cluster DNS
  listens there. The subnet is a /16 of ``POD_SUBNETS`` that no route of this
  machine covers yet, so a second run beside this one gets its own;
* a kubelet with its own root folder, ports, cgroup root (created under every
  cgroup v1 hierarchy) and pod log folder, a client certificate from the test CA
  (``O=system:nodes``, ``CN=system:node:<name>``) and a serving certificate, on
  ``--node-ip`` = this machine's first non-loopback address. It accepts the API
  server's client certificate for logs; image garbage collection and disk
  eviction are set so they never fire on a shared disk.

Cluster DNS is real: CoreDNS (``tools/k8s/build-coredns.sh``) runs as a host
process bound to ``dns_address``, serving ``cluster.local`` from the API server
with its ``kubernetes`` plugin, and each kubelet's ``clusterDNS`` names it, so a
pod resolves the headless-Service names the runtime gives ``MASTER_ADDR``
(``rank-0.<gang>.<namespace>.svc.cluster.local``). CoreDNS reads those names from
EndpointSlices, which the test control plane does not make (its controller
manager runs only what the other tests need): a second controller manager,
running only the EndpointSlice controller, runs beside the nodes.

The kubelet sets a few kernel tunables when it starts (``vm.overcommit_memory``,
``kernel.panic``...); ``stop`` puts back the values it found. ``stop`` takes
everything down in this order: kubelets; every containerd task and container;
containerd (and any shim left); CoreDNS and the EndpointSlice controller; the
mounts under the run folder; the cgroups, deepest first; the bridge; the kernel
tunables; the Node objects.

``unavailable_reason()`` says why this machine cannot run real nodes (not root,
no overlayfs, no containerd...), for a test to skip with.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tools.k8s import images
from tools.k8s.controlplane import POD_SUBNETS
from tools.k8s.realnode_host import (
    BUILD_COREDNS,
    BUILD_KUBELET,
    CNI_BIN_DIR,
    GPU_RESOURCE,
    HOST_FOLDERS,
    KERNEL_TUNABLES,
    REQUIRED_COMMANDS,
    RealNode,
    RealNodeError,
    cgroup_v1_mounts,
    node_ip,
)
from tools.k8s.realnode_teardown import RealNodesTeardown


def unavailable_reason() -> str | None:
    """Why real nodes cannot run on this machine, or None when they can."""
    if os.geteuid() != 0:
        return "real nodes need root (containerd, mounts, cgroups, a bridge)"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "the kernel has no overlayfs for containerd's snapshotter"
    missing = [name for name in REQUIRED_COMMANDS if shutil.which(name) is None]
    if missing:
        return f"missing {', '.join(missing)}: bin/test-services installs containerd, runc"
    if not (CNI_BIN_DIR / "bridge").exists() or not (CNI_BIN_DIR / "host-local").exists():
        return (
            f"no CNI bridge and host-local plugins in {CNI_BIN_DIR} (containernetworking-plugins)"
        )
    if not cgroup_v1_mounts():
        return "no cgroup v1 hierarchy: these nodes are set up for cgroup v1 only"
    if not (shutil.which("gcc") or shutil.which("cc")):
        return "no C compiler for the pause image"
    if node_ip() is None:
        return "this machine has no non-loopback IPv4 address for --node-ip"
    return None


def build_kubelet() -> Path:
    """Build (or find in the cache) the kubelet; returns its path."""
    return _build(BUILD_KUBELET, "kubelet")


def build_coredns() -> Path:
    """Build (or find in the cache) CoreDNS; returns its path."""
    return _build(BUILD_COREDNS, "coredns")


def _build(script: Path, binary: str) -> Path:
    result = subprocess.run(["bash", str(script)], check=False, capture_output=True, text=True)
    if result.returncode != 0:
        raise RealNodeError(f"{script.name} failed:\n{result.stderr[-4000:]}")
    built = Path(result.stdout.strip().splitlines()[-1]) / binary
    if not built.exists():
        raise RealNodeError(f"{script.name} printed no folder holding {binary}: {built}")
    return built


def _free_pod_subnet() -> ipaddress.IPv4Network:
    """The first of ``POD_SUBNETS`` that no route of this machine overlaps."""
    result = subprocess.run(
        ["ip", "-j", "-4", "route", "show", "table", "all"],
        capture_output=True,
        text=True,
        check=False,
    )
    taken = []
    for route in json.loads(result.stdout or "[]") if result.returncode == 0 else []:
        with contextlib.suppress(ValueError):
            taken.append(ipaddress.IPv4Network(route.get("dst", ""), strict=False))
    for subnet in POD_SUBNETS:
        if not any(subnet.overlaps(route) for route in taken):
            return subnet
    raise RealNodeError(f"every pod subnet of {POD_SUBNETS[0]}..{POD_SUBNETS[-1]} is in use")


def _terminate(process: subprocess.Popen[bytes] | None, timeout: float = 15.0) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def _kill_pids(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class RealNodes(RealNodesTeardown):
    """Two (or more) real nodes of a running control plane."""

    # -- lifecycle ---------------------------------------------------------------
    def start(self, *, timeout: float = 120.0) -> None:
        """Start every node and wait until each is Ready with its GPUs; stop all on failure."""
        reason = unavailable_reason()
        if reason is not None:
            raise RealNodeError(reason)
        assert self.plane.state is not None
        begun = time.monotonic()
        kubelet, coredns = build_kubelet(), build_coredns()
        rank, pause = images.rank_image(), images.pause_image()
        self.rank_image = rank.name
        self.rank_has_busybox = images.static_busybox() is not None
        self.timings["build"] = time.monotonic() - begun
        self.run_dir.mkdir(parents=True, exist_ok=True)
        configuration = client.Configuration()
        config.load_kube_config(
            config_file=self.plane.state.kubeconfig, client_configuration=configuration
        )
        self._api = client.ApiClient(configuration)
        self._host_folders_before = {path for path in HOST_FOLDERS if path.exists()}
        self._kernel_tunables = {
            key: (Path("/proc/sys") / key).read_text().strip()
            for key in KERNEL_TUNABLES
            if (Path("/proc/sys") / key).exists()
        }
        try:
            self._pki()
            self.pod_subnet = _free_pod_subnet()
            self._make_bridge()
            started = time.monotonic()
            self._start_cluster_dns(coredns, started + timeout)
            self.timings["dns"] = time.monotonic() - started
            for index, name in enumerate(self.names):
                node = RealNode(name=name, index=index, dir=self.run_dir / name)
                self.nodes.append(node)
                self._start_containerd(node, pause.name)
            started = time.monotonic()
            for node in self.nodes:
                self._import(node, rank.archive)
                self._import(node, pause.archive)
                for alias in self.image_aliases:
                    self._tag(node, rank.name, alias)
                for archive in self.image_archives:
                    self._import(node, archive)
            self.timings["import"] = time.monotonic() - started
            for node in self.nodes:
                self._start_kubelet(node, kubelet)
            self._wait_ready(time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise
        self.timings["start"] = time.monotonic() - begun

    def stop(self) -> None:
        """Take every node down, leaving no process, mount, cgroup or bridge behind."""
        begun = time.monotonic()
        for node in self.nodes:
            _terminate(node.kubelet)
        for node in self.nodes:
            self._remove_containers(node)
        for node in self.nodes:
            _terminate(node.containerd)
            _kill_pids(self._leftover_processes(node))
        _terminate(self.coredns)
        _terminate(self.slice_controller)
        self._unmount_all()
        self._remove_cgroups()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
        for key, value in self._kernel_tunables.items():
            with contextlib.suppress(OSError):
                (Path("/proc/sys") / key).write_text(value)
        self._remove_log_links()
        self._remove_host_folders()
        if self._api is not None:
            core = client.CoreV1Api(self._api)
            for node in self.nodes:
                try:
                    core.delete_node(node.name)
                except ApiException as error:
                    if error.status != 404:
                        raise
            self._api.close()
            self._api = None
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.nodes = []
        self.timings["stop"] = time.monotonic() - begun

    def lose_node(self, name: str, *, with_containers: bool) -> None:
        """Lose a node as a crashed machine would: SIGKILL its kubelet and, with
        ``with_containers``, every container of it (pods' sandboxes too); containerd
        stays up, so ``restart_kubelet`` can bring the node back."""
        node = self._node(name)
        if node.kubelet is not None:
            node.kubelet.kill()
            node.kubelet.wait(10)
        if with_containers:
            tasks = self._ctr(node, "tasks", "ls", "-q", timeout=20).stdout.split()
            for task in tasks:
                self._ctr(node, "tasks", "kill", "-s", "SIGKILL", task, timeout=20)

    def restart_kubelet(self, name: str, *, timeout: float = 60.0) -> None:
        """Start a lost node's kubelet again and wait until it is Ready with its GPUs."""
        node = self._node(name)
        if node.kubelet is not None and node.kubelet.poll() is None:
            return
        self._run_kubelet(node)
        deadline = time.monotonic() + timeout
        self._wait_ready(deadline, [node])
        # A restarted kubelet zeroes the extended resources it has no device plugin
        # for, possibly after the patch above: patch until two reads a second apart agree.
        core = client.CoreV1Api(self._api)
        held = 0
        while held < 2:
            capacity = core.read_node(name).status.capacity or {}
            held = held + 1 if capacity.get(GPU_RESOURCE) == str(self.gpus) else 0
            if held == 0:
                self.give_gpus(name)
            if time.monotonic() > deadline:
                raise RealNodeError(f"{name} lost its {GPU_RESOURCE} again after its restart")
            time.sleep(0.5)

    def running_pods(self, name: str) -> set[str]:
        """Names of the pods that have a container running on node ``name``, as its
        containerd sees them (whatever the kubelet or the API server say)."""
        node = self._node(name)
        found = set()
        for line in self._ctr(node, "tasks", "ls", timeout=20).stdout.splitlines()[1:]:
            task, _, status = [*line.split(), "", "", ""][:3]
            if status != "RUNNING":
                continue
            info = self._ctr(node, "containers", "info", task, timeout=20)
            if info.returncode != 0:
                continue  # gone meanwhile
            labels = json.loads(info.stdout).get("Labels") or {}
            if labels.get("io.cri-containerd.kind") == "container":
                found.add(labels.get("io.kubernetes.pod.name", ""))
        return found

    def _node(self, name: str) -> RealNode:
        for node in self.nodes:
            if node.name == name:
                return node
        raise RealNodeError(f"no real node {name}")

    def log(self, name: str, component: str = "kubelet") -> str:
        """The tail of a node's kubelet or containerd log, for failure messages."""
        path = self.run_dir / name / f"{component}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""
