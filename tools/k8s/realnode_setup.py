"""How real nodes (tools.k8s.realnodes) are set up: the certificates, containerd and
its runtime spec, the CNI bridge, the cluster DNS, the images, the cgroups and the
kubelet, and the wait for the nodes to be Ready with their GPUs. Removes nothing
(tools.k8s.realnode_teardown does).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tools.k8s.controlplane import die_with_parent_process, issue_certificate, write_kubeconfig
from tools.k8s.realnode_host import (
    CLUSTER_DOMAIN,
    CNI_BIN_DIR,
    FLAVOR_LABEL,
    GPU_RESOURCE,
    RealNode,
    RealNodeError,
    RealNodesState,
    cgroup_v1_mounts,
)


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


class RealNodesSetup(RealNodesState):
    """Starts the parts of each real node, one at a time."""

    # -- set-up ------------------------------------------------------------------
    def _pki(self) -> None:
        """Node client and serving certificates from the test CA, in the run folder."""
        pki = self.run_dir / "pki"
        pki.mkdir(parents=True, exist_ok=True)
        for name in ("ca.crt", "ca.key"):
            shutil.copy(self.plane.pki / name, pki / name)
        assert self.plane.state is not None
        for name in self.names:
            issue_certificate(
                pki,
                f"{name}-client",
                f"/O=system:nodes/CN=system:node:{name}",
                "extendedKeyUsage=clientAuth\n",
            )
            issue_certificate(
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
            preexec_fn=die_with_parent_process if self.die_with_parent else None,
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
        """The nodes' own controllers (the EndpointSlice controller, and any more
        ``controllers`` names), and CoreDNS on the bridge; wait until it serves."""
        assert self.plane.state is not None
        folder = self.run_dir / "dns"
        folder.mkdir()
        controller_kubeconfig = self.plane.run_dir / "controller-manager.kubeconfig"
        self.slice_controller = self._spawn(
            folder,
            "controllers",
            [
                str(Path(self.plane.state.bin_dir) / "kube-controller-manager"),
                f"--kubeconfig={controller_kubeconfig}",
                f"--authentication-kubeconfig={controller_kubeconfig}",
                f"--authorization-kubeconfig={controller_kubeconfig}",
                f"--controllers={','.join(self.controllers)}",
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
                ("controllers", self.slice_controller),
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
        for mount in cgroup_v1_mounts():
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
        for mount in cgroup_v1_mounts():
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
