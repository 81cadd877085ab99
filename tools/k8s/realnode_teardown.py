"""How real nodes (tools.k8s.realnodes) are taken down: their containers, leftover
processes, mounts, cgroups, log links and host folders. Starts nothing.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

from tools.k8s.realnode_host import HOST_FOLDERS, RealNode, cgroup_mounts, cgroup_v1_mounts
from tools.k8s.realnode_setup import RealNodesSetup


class RealNodesTeardown(RealNodesSetup):
    """Removes what the set-up of real nodes left on this machine."""

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
        for mount in cgroup_v1_mounts():
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
        for mount in cgroup_mounts(("cgroup", "cgroup2")):
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
