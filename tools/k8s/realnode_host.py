"""What real nodes (tools.k8s.realnodes) need of this machine and keep of their own:
the constants, the refusal (RealNodeError), the cgroup mounts, the node address,
one node's record and the settings of a set of nodes. Starts and removes nothing.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client

from tools.k8s.controlplane import POD_SUBNETS, REPO_ROOT, ControlPlane

BUILD_KUBELET = REPO_ROOT / "tools" / "k8s" / "build-kubelet.sh"
BUILD_COREDNS = REPO_ROOT / "tools" / "k8s" / "build-coredns.sh"
CNI_BIN_DIR = Path("/usr/lib/cni")
GPU_RESOURCE = "nvidia.com/gpu"
FLAVOR_LABEL = "quartermaster.dev/flavor"
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


def cgroup_v1_mounts() -> list[Path]:
    """Mount points of every cgroup v1 hierarchy."""
    return cgroup_mounts(("cgroup",))


def cgroup_mounts(kinds: tuple[str, ...]) -> list[Path]:
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] in kinds:
            mounts.append(Path(left.split()[4]))
    return mounts


def node_ip() -> str | None:
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
class RealNodesState:
    """The settings and state of a set of real nodes; see ``tools.k8s.realnodes.RealNodes``."""

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
    # More image archives (OCI layouts in a tar, as ``ctr images import`` reads
    # them) imported into every node: the portal's own image, say.
    image_archives: tuple[Path, ...] = ()
    # What a second controller manager beside the nodes runs (the test control
    # plane's runs only what every test needs): the EndpointSlice controller, which
    # the cluster DNS reads, and for a Helm install the Deployment and ReplicaSet
    # controllers, which make a Deployment's pods.
    controllers: tuple[str, ...] = ("endpointslice-controller",)
    coredns: subprocess.Popen[bytes] | None = None
    slice_controller: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        token = uuid.uuid4().hex[:6]
        self.bridge = f"qmbr{token}"
        self.cgroup_root = f"qm-realnodes-{token}"
        self.node_ip = node_ip() or ""
        self.pod_subnet = POD_SUBNETS[0]
        self._kernel_tunables: dict[str, str] = {}
        self._host_folders_before: set[Path] = set()
        self._api: client.ApiClient | None = None
        self._kubelet_binary = Path()

    @property
    def dns_address(self) -> str:
        """The host's address on the pods' bridge, where the cluster DNS listens."""
        return str(self.pod_subnet.network_address + 1)
