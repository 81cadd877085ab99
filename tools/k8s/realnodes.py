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
import socket
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tools.k8s import images
from tools.k8s.controlplane import (
    REPO_ROOT,
    ControlPlane,
    _die_with_parent,
    _issue_certificate,
    write_kubeconfig,
)

BUILD_KUBELET = REPO_ROOT / "tools" / "k8s" / "build-kubelet.sh"
BUILD_COREDNS = REPO_ROOT / "tools" / "k8s" / "build-coredns.sh"
CNI_BIN_DIR = Path("/usr/lib/cni")
GPU_RESOURCE = "nvidia.com/gpu"
FLAVOR_LABEL = "quartermaster.dev/flavor"
# The /16s a run may take for its pods: each node gets 10.<b>.<10 + index>.0/24 of it,
# and the host 10.<b>.0.1, outside every node's range.
POD_SUBNETS = tuple(ipaddress.IPv4Network(f"10.{b}.0.0/16") for b in range(213, 233))
CLUSTER_DOMAIN = "cluster.local"
# Set by the kubelet at start (pkg/kubelet/cm: setupKernelTunables); put back by stop().
KERNEL_TUNABLES = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
# Host folders the kubelet (device-plugins socket, log links) and containerd's shims
# (their sockets) create wherever they are rooted; removed by stop() when this run
# made them and they are empty again.
HOST_FOLDERS = (
    Path("/var/lib/kubelet/device-plugins"),
    Path("/var/lib/kubelet"),
    Path("/var/log/containers"),
    Path("/run/containerd/s"),
    Path("/run/containerd"),
)
REQUIRED_COMMANDS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "ip", "openssl")


class RealNodeError(RuntimeError):
    """Real nodes could not be built, started or reached."""


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
    if not _cgroup_v1_mounts():
        return "no cgroup v1 hierarchy: these nodes are set up for cgroup v1 only"
    if not (shutil.which("gcc") or shutil.which("cc")):
        return "no C compiler for the pause image"
    if _node_ip() is None:
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


def _cgroup_v1_mounts() -> list[Path]:
    """Mount points of every cgroup v1 hierarchy."""
    return _cgroup_mounts(("cgroup",))


def _cgroup_mounts(kinds: tuple[str, ...]) -> list[Path]:
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] in kinds:
            mounts.append(Path(left.split()[4]))
    return mounts


def _node_ip() -> str | None:
    result = subprocess.run(
        ["ip", "-j", "-4", "addr", "show", "scope", "global"],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        return None
    for link in json.loads(result.stdout or "[]"):
        for address in link.get("addr_info", []):
            if address.get("local"):
                return str(address["local"])
    return None


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


def _full_reference(image: str) -> str:
    """An image name as the CRI normalizes it: ``python:3.11`` is
    ``docker.io/library/python:3.11``."""
    first, _, rest = image.partition("/")
    if not rest:
        return f"docker.io/library/{image}"
    if "." in first or ":" in first or first == "localhost":
        return image
    return f"docker.io/{image}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


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


@dataclass
class RealNode:
    """One node: its folders, ports and processes."""

    name: str
    index: int
    dir: Path
    kubelet_port: int = 0
    healthz_port: int = 0
    containerd: subprocess.Popen[bytes] | None = None
    kubelet: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        """containerd's gRPC socket."""
        return self.dir / "containerd" / "containerd.sock"

    @property
    def kubelet_root(self) -> Path:
        """The kubelet's --root-dir."""
        return self.dir / "kubelet"


@dataclass
class RealNodes:
    """Two (or more) real nodes of a running control plane."""

    plane: ControlPlane
    run_dir: Path
    names: tuple[str, ...] = ("real-node-0", "real-node-1")
    gpus: int = 8
    flavor: str = "h100"
    die_with_parent: bool = True
    nodes: list[RealNode] = field(default_factory=list)
    rank_image: str = ""
    # Whether the rank image has busybox's nc and nslookup (see tools.k8s.images).
    rank_has_busybox: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    # Host folders every container of these nodes sees at the same path: (path,
    # writable). For ranks that run the host's Python and virtual environment
    # (read-only) and write where the test reads (see ``_base_runtime_spec``).
    host_mounts: tuple[tuple[str, bool], ...] = ()
    # More names for the rank image on every node, so pods asking for an image by
    # one of these names (a runtime's default image, say) run it without a pull.
    image_aliases: tuple[str, ...] = ()
    coredns: subprocess.Popen[bytes] | None = None
    slice_controller: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        token = uuid.uuid4().hex[:6]
        self.bridge = f"qmbr{token}"
        self.cgroup_root = f"qm-realnodes-{token}"
        self.node_ip = _node_ip() or ""
        self.pod_subnet = POD_SUBNETS[0]
        self._kernel_tunables: dict[str, str] = {}
        self._host_folders_before: set[Path] = set()
        self._api: client.ApiClient | None = None
        self._kubelet_binary = Path()

    @property
    def dns_address(self) -> str:
        """The host's address on the pods' bridge, where the cluster DNS listens."""
        return str(self.pod_subnet.network_address + 1)

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

    # -- set-up ------------------------------------------------------------------
    def _pki(self) -> None:
        """Node client and serving certificates from the test CA, in the run folder."""
        pki = self.run_dir / "pki"
        pki.mkdir(parents=True, exist_ok=True)
        for name in ("ca.crt", "ca.key"):
            shutil.copy(self.plane.pki / name, pki / name)
        assert self.plane.state is not None
        for name in self.names:
            _issue_certificate(
                pki,
                f"{name}-client",
                f"/O=system:nodes/CN=system:node:{name}",
                "extendedKeyUsage=clientAuth\n",
            )
            _issue_certificate(
                pki,
                f"{name}-serving",
                f"/CN={name}",
                f"subjectAltName=IP:{self.node_ip},DNS:{name}\nextendedKeyUsage=serverAuth\n",
            )
            write_kubeconfig(
                self.run_dir / f"{name}.kubeconfig",
                server=self.plane.state.server,
                pki=pki,
                user=f"{name}-client",
            )

    def _spawn(self, folder: Path, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        # Appended to: a restarted kubelet adds to its node's log.
        log = open(folder / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        process = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if self.die_with_parent else None,
        )
        log.close()
        return process

    def _check_alive(self, node: RealNode, name: str) -> None:
        process = node.containerd if name == "containerd" else node.kubelet
        if process is not None and process.poll() is not None:
            tail = (node.dir / f"{name}.log").read_text(errors="replace")[-3000:]
            raise RealNodeError(f"{name} of {node.name} exited with {process.returncode}:\n{tail}")

    def _containerd_config(self, node: RealNode, pause_image: str) -> str:
        base = node.dir / "containerd"
        cri = '[plugins."io.containerd.grpc.v1.cri"]'
        base_spec = ""
        if self.host_mounts:
            base_spec = f'  base_runtime_spec = "{self._base_runtime_spec(node)}"\n\n'
        return f"""version = 2
root = "{base / "root"}"
state = "{base / "state"}"
oom_score = 0
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
]

[grpc]
  address = "{node.socket}"

[ttrpc]
  address = "{node.socket}.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{base / "opt"}"

{cri}
  sandbox_image = "{pause_image}"
  disable_apparmor = true
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false

{cri[:-1]}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

{cri[:-1]}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

{base_spec}{cri[:-1]}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "{base / "runc"}"

{cri[:-1]}.cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{node.dir / "cni"}"
  max_conf_num = 1
"""

    def _base_runtime_spec(self, node: RealNode) -> Path:
        """containerd's default OCI spec plus ``host_mounts``, as every container's base.

        This is how a node gives all its containers something of the host, as
        the NVIDIA container toolkit gives them the driver's libraries: the pods
        do not ask for it. Here it lets a rank run the host's Python, torch and
        the project without baking gigabytes into an image (a one-machine test
        cluster only: a production node has its image's Python).
        """
        result = subprocess.run(["ctr", "oci", "spec"], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RealNodeError(f"ctr oci spec: {result.stderr.strip()}")
        spec = json.loads(result.stdout)
        # The CRI plugin's own default has no /run of its own; it adds what a pod needs.
        spec["mounts"] = [m for m in spec["mounts"] if m["destination"] != "/run"]
        for path, writable in self.host_mounts:
            spec["mounts"].append(
                {
                    "destination": path,
                    "type": "bind",
                    "source": path,
                    "options": ["rbind", "rw" if writable else "ro", "nosuid", "nodev"],
                }
            )
        target = node.dir / "base-runtime-spec.json"
        target.write_text(json.dumps(spec, indent=2))
        return target

    def _cni_config(self, node: RealNode) -> dict[str, object]:
        base = self.pod_subnet.network_address
        first, last = base + ((10 + node.index) << 8) + 2, base + ((10 + node.index) << 8) + 254
        return {
            "cniVersion": "0.4.0",
            "name": "quartermaster-real-nodes",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": False,
                    "ipMasq": False,
                    "hairpinMode": False,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": str(node.dir / "ipam"),
                        "ranges": [
                            [
                                {
                                    "subnet": str(self.pod_subnet),
                                    "rangeStart": str(first),
                                    "rangeEnd": str(last),
                                }
                            ]
                        ],
                    },
                },
                {"type": "loopback"},
            ],
        }

    def _make_bridge(self) -> None:
        """The pods' bridge, with the host's address on it for the cluster DNS."""
        prefix = self.pod_subnet.prefixlen
        for command in (
            ["ip", "link", "add", "name", self.bridge, "type", "bridge"],
            ["ip", "addr", "add", f"{self.dns_address}/{prefix}", "dev", self.bridge],
            ["ip", "link", "set", self.bridge, "up"],
        ):
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise RealNodeError(f"{' '.join(command)}: {result.stderr.strip()}")

    def _corefile(self, health_port: int, ready_port: int) -> str:
        assert self.plane.state is not None
        # No upstream: a rank needs the cluster's names only, and this machine may
        # have no resolver a pod could reach. Records carry a TTL of 0, so a name
        # asked for before its pod had an address is not remembered empty.
        return f""".:53 {{
    bind {self.dns_address}
    errors
    health 127.0.0.1:{health_port}
    ready 127.0.0.1:{ready_port}
    kubernetes {CLUSTER_DOMAIN} {{
        kubeconfig {self.plane.state.kubeconfig}
        ttl 0
    }}
}}
"""

    def _start_cluster_dns(self, coredns: Path, deadline: float) -> None:
        """The EndpointSlice controller, and CoreDNS on the bridge; wait until it serves."""
        assert self.plane.state is not None
        folder = self.run_dir / "dns"
        folder.mkdir()
        controller_kubeconfig = self.plane.run_dir / "controller-manager.kubeconfig"
        self.slice_controller = self._spawn(
            folder,
            "endpointslice-controller",
            [
                str(Path(self.plane.state.bin_dir) / "kube-controller-manager"),
                f"--kubeconfig={controller_kubeconfig}",
                f"--authentication-kubeconfig={controller_kubeconfig}",
                f"--authorization-kubeconfig={controller_kubeconfig}",
                "--controllers=endpointslice-controller",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                "--secure-port=0",
                "--use-service-account-credentials=false",
                "--v=1",
            ],
        )
        health_port, ready_port = _free_port(), _free_port()
        corefile = folder / "Corefile"
        corefile.write_text(self._corefile(health_port, ready_port))
        self.coredns = self._spawn(folder, "coredns", [str(coredns), "-conf", str(corefile)])
        # /ready answers 200 once the kubernetes plugin has listed what it serves.
        while True:
            for name, process in (
                ("coredns", self.coredns),
                ("endpointslice-controller", self.slice_controller),
            ):
                if process.poll() is not None:
                    tail = (folder / f"{name}.log").read_text(errors="replace")[-3000:]
                    raise RealNodeError(f"{name} exited with {process.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ready_port}/ready", timeout=2):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                tail = (folder / "coredns.log").read_text(errors="replace")[-3000:]
                raise RealNodeError(f"CoreDNS was not ready in time:\n{tail}")
            time.sleep(0.1)

    def _ctr(
        self, node: RealNode, *args: str, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ctr", "--address", str(node.socket), "--namespace", "k8s.io", *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
        )

    def _start_containerd(self, node: RealNode, pause_image: str) -> None:
        (node.dir / "containerd").mkdir(parents=True)
        (node.dir / "cni").mkdir()
        (node.dir / "cni" / "10-bridge.conflist").write_text(json.dumps(self._cni_config(node)))
        config_file = node.dir / "containerd.toml"
        config_file.write_text(self._containerd_config(node, pause_image))
        node.containerd = self._spawn(
            node.dir, "containerd", ["containerd", "--config", str(config_file)]
        )
        deadline = time.monotonic() + 30
        while True:
            self._check_alive(node, "containerd")
            if node.socket.exists() and self._ctr(node, "version", timeout=10).returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RealNodeError(f"containerd of {node.name} did not answer within 30 s")
            time.sleep(0.1)

    def _import(self, node: RealNode, archive: Path) -> None:
        result = self._ctr(node, "images", "import", str(archive))
        if result.returncode != 0:
            raise RealNodeError(f"ctr images import {archive} on {node.name}: {result.stderr}")

    def _tag(self, node: RealNode, image: str, alias: str) -> None:
        reference = _full_reference(alias)
        self._ctr(node, "images", "rm", reference)  # a tag left by an earlier alias
        result = self._ctr(node, "images", "tag", image, reference)
        if result.returncode != 0:
            raise RealNodeError(
                f"ctr images tag {image} {reference} on {node.name}: {result.stderr}"
            )

    def _create_cgroups(self) -> None:
        for mount in _cgroup_v1_mounts():
            folder = mount / self.cgroup_root
            folder.mkdir(exist_ok=True)
            if (mount / "cpuset.cpus").exists():
                for name in ("cpuset.cpus", "cpuset.mems"):
                    (folder / name).write_text((mount / name).read_text())

    def _kubelet_config(self, node: RealNode) -> dict[str, object]:
        pki = self.run_dir / "pki"
        never = {
            "memory.available": "1Mi",
            "nodefs.available": "1Mi",
            "nodefs.inodesFree": "1",
            "imagefs.available": "1Mi",
            "imagefs.inodesFree": "1",
        }
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": self.node_ip,
            "port": node.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": node.healthz_port,
            "tlsCertFile": str(pki / f"{node.name}-serving.crt"),
            "tlsPrivateKeyFile": str(pki / f"{node.name}-serving.key"),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(pki / "ca.crt")},
            },
            # Only the API server (system:masters) holds a certificate of the test CA
            # that it presents to kubelets.
            "authorization": {"mode": "AlwaysAllow"},
            "containerRuntimeEndpoint": f"unix://{node.socket}",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{self.cgroup_root}/{node.name}",
            "failSwapOn": False,
            "failCgroupV1": False,
            "makeIPTablesUtilChains": False,
            "hairpinMode": "none",
            "podLogsDir": str(node.dir / "pod-logs"),
            "resolvConf": "/etc/resolv.conf",
            "clusterDNS": [self.dns_address],
            "clusterDomain": CLUSTER_DOMAIN,
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": never,
            "evictionPressureTransitionPeriod": "5s",
            # The control plane calls a node lost 8 s after it last heard of it
            # (--node-monitor-grace-period): renew the lease every 2.5 s (a quarter
            # of its 10 s duration) and report status every 4 s, never slower.
            "nodeLeaseDurationSeconds": 10,
            "nodeStatusUpdateFrequency": "2s",
            "nodeStatusReportFrequency": "4s",
            "rotateCertificates": False,
            "serverTLSBootstrap": False,
            "registerNode": True,
            "maxPods": 60,
        }

    def _start_kubelet(self, node: RealNode, kubelet: Path) -> None:
        self._create_cgroups()
        for mount in _cgroup_v1_mounts():
            folder = mount / self.cgroup_root / node.name
            folder.mkdir(exist_ok=True)
            if (mount / "cpuset.cpus").exists():
                for name in ("cpuset.cpus", "cpuset.mems"):
                    (folder / name).write_text((mount / name).read_text())
        node.kubelet_port, node.healthz_port = _free_port(), _free_port()
        node.kubelet_root.mkdir(parents=True)
        (node.dir / "pod-logs").mkdir()
        config_file = node.dir / "kubelet.json"
        config_file.write_text(json.dumps(self._kubelet_config(node), indent=2))
        self._kubelet_binary = kubelet
        self._run_kubelet(node)

    def _run_kubelet(self, node: RealNode) -> None:
        config_file = node.dir / "kubelet.json"
        node.kubelet = self._spawn(
            node.dir,
            "kubelet",
            [
                str(self._kubelet_binary),
                f"--config={config_file}",
                f"--kubeconfig={self.run_dir / f'{node.name}.kubeconfig'}",
                f"--root-dir={node.kubelet_root}",
                f"--cert-dir={node.dir / 'kubelet-pki'}",
                f"--node-ip={self.node_ip}",
                f"--hostname-override={node.name}",
                f"--node-labels={FLAVOR_LABEL}={self.flavor}",
                "--v=2",
            ],
        )

    def _wait_ready(self, deadline: float, nodes: list[RealNode] | None = None) -> None:
        core = client.CoreV1Api(self._api)
        waiting = {node.name: node for node in (self.nodes if nodes is None else nodes)}
        while waiting:
            for node in waiting.values():
                self._check_alive(node, "kubelet")
                self._check_alive(node, "containerd")
            for name in list(waiting):
                try:
                    found = core.read_node(name)
                except ApiException as error:
                    if error.status != 404:
                        raise
                    continue
                ready = [c for c in found.status.conditions or [] if c.type == "Ready"]
                if ready and ready[0].status == "True":
                    self.give_gpus(name)
                    del waiting[name]
            if waiting and time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- {node.name}:\n"
                    + (node.dir / "kubelet.log").read_text(errors="replace")[-2000:]
                    for node in waiting.values()
                )
                raise RealNodeError(f"nodes {sorted(waiting)} not Ready in time:\n{tails}")
            time.sleep(0.2)

    def give_gpus(self, name: str) -> None:
        """Patch ``nvidia.com/gpu`` into the Node's capacity (again after a kubelet restart)."""
        gpus = str(self.gpus)
        client.CoreV1Api(self._api).patch_node_status(
            name,
            {"status": {"capacity": {GPU_RESOURCE: gpus}, "allocatable": {GPU_RESOURCE: gpus}}},
        )

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

    # -- teardown ----------------------------------------------------------------
    def _remove_containers(self, node: RealNode) -> None:
        if node.containerd is None or node.containerd.poll() is not None:
            return
        try:
            listing = self._ctr(node, "tasks", "ls", "-q", timeout=20)
            for task in listing.stdout.split():
                self._ctr(node, "tasks", "kill", "-s", "SIGKILL", task, timeout=20)
            for task in listing.stdout.split():
                self._ctr(node, "tasks", "delete", "-f", task, timeout=20)
            containers = self._ctr(node, "containers", "ls", "-q", timeout=20).stdout.split()
            if containers:
                self._ctr(node, "containers", "rm", *containers, timeout=60)
        except subprocess.TimeoutExpired:
            pass  # containerd is stopped next; leftover processes are killed after it

    def _leftover_processes(self, node: RealNode) -> set[int]:
        """Shims of this node's containerd and anything still in this run's cgroups."""
        found: set[int] = set()
        marker = str(node.socket).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"containerd-shim" in cmdline and marker in cmdline:
                found.add(int(entry.name))
        for mount in _cgroup_v1_mounts():
            root = mount / self.cgroup_root / node.name
            if root.exists():
                for procs in root.rglob("cgroup.procs"):
                    try:
                        found |= {int(p) for p in procs.read_text().split()}
                    except OSError:
                        continue
        return found

    def _unmount_all(self) -> None:
        """Unmount everything under the run folder, deepest first."""
        prefix = str(self.run_dir.resolve())
        for _ in range(5):
            points = []
            for line in Path("/proc/self/mountinfo").read_text().splitlines():
                point = line.split()[4].replace("\\040", " ")
                if point == prefix or point.startswith(prefix + "/"):
                    points.append(point)
            if not points:
                return
            for point in sorted(set(points), key=lambda p: p.count("/"), reverse=True):
                result = subprocess.run(["umount", point], capture_output=True, check=False)
                if result.returncode != 0:
                    subprocess.run(["umount", "-l", point], capture_output=True, check=False)

    def _remove_cgroups(self) -> None:
        # The kubelet's libcontainer also makes its cgroups in a hybrid host's
        # cgroup2 hierarchy ("unified"), not only under the v1 controllers.
        for mount in _cgroup_mounts(("cgroup", "cgroup2")):
            root = mount / self.cgroup_root
            if not root.exists():
                continue
            folders = sorted(
                (p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
            )
            for folder in [*folders, root]:
                for _ in range(50):
                    try:
                        folder.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        time.sleep(0.1)  # a process just killed is still leaving it

    def _remove_log_links(self) -> None:
        """The kubelet links container logs from /var/log/containers; drop this run's links."""
        folder = Path("/var/log/containers")
        if not folder.is_dir():
            return
        prefix = str(self.run_dir)
        for link in folder.iterdir():
            if link.is_symlink() and os.readlink(link).startswith(prefix):
                link.unlink()

    def _remove_host_folders(self) -> None:
        """Remove the host folders this run's kubelets and shims made, once empty."""
        if not self.nodes:
            return
        made = [path for path in HOST_FOLDERS if path not in self._host_folders_before]
        socket_path = Path("/var/lib/kubelet/device-plugins/kubelet.sock")
        if socket_path.parent in made and socket_path.is_socket():
            socket_path.unlink()
        for path in made:  # deepest first, as HOST_FOLDERS lists them
            with contextlib.suppress(OSError):  # not empty: something else uses it now
                path.rmdir()
