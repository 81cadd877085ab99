"""A real Kubernetes control plane on loopback, for tests and local drills.

Runs etcd, kube-apiserver, kube-controller-manager and kube-scheduler built by
``tools/k8s/build.sh`` (binaries cached outside the repository), with freshly
generated certificates, service-account keys and an admin kubeconfig. There is
no kubelet: ``tools.k8s.node_agent`` plays it for Node objects.

Command line::

    python -m tools.k8s.controlplane up      # build if needed, start, wait for /readyz
    python -m tools.k8s.controlplane env     # print `export KUBECONFIG=...`
    python -m tools.k8s.controlplane down    # stop everything and remove the run folder

The run folder defaults to ``/tmp/qm-k8s-<uid>`` (``QM_K8S_RUN_DIR`` overrides it);
``state.json`` there records pids, ports and the kubeconfig path so that ``down``
and other processes find a control plane started by ``up``.
"""

from __future__ import annotations

import argparse
import ctypes
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "tools" / "k8s" / "build.sh"

# Only the controllers that Quartermaster and its tests rely on run: pod garbage
# collection through owner references, service accounts and their tokens (pods
# need the namespace's default service account), disruption budgets (the
# Eviction API consults them), namespace deletion (each test gets a fresh
# namespace), node lifecycle (taints and NotReady for lost nodes) and the
# taint-based eviction that follows a lost node.
CONTROLLERS = (
    "garbage-collector-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "disruption-controller",
    "namespace-controller",
    "node-lifecycle-controller",
    "taint-eviction-controller",
    "root-ca-certificate-publisher-controller",
)

SERVICE_CIDR = "10.0.0.0/24"
# The /16s a run of real nodes may take for its pods (tools.k8s.realnodes): each
# node gets 10.<b>.<10 + index>.0/24 of it, and the host 10.<b>.0.1, outside every
# node's range. There is no kube-proxy, so a pod reaches the API server at that host
# address only (through a relay, as the Helm install test does): the serving
# certificate names each of them.
POD_SUBNETS = tuple(ipaddress.IPv4Network(f"10.{b}.0.0/16") for b in range(213, 233))


class ControlPlaneError(RuntimeError):
    """The control plane could not be built, started or reached."""


def default_run_dir() -> Path:
    """Folder holding certificates, data, logs and state of the control plane."""
    return Path(os.environ.get("QM_K8S_RUN_DIR", f"/tmp/qm-k8s-{os.getuid()}"))


def build_binaries() -> Path:
    """Build (or find in the cache) the control plane binaries; returns their folder."""
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], check=False, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise ControlPlaneError(
            f"tools/k8s/build.sh failed ({result.returncode}):\n{result.stderr[-4000:]}"
        )
    bin_dir = Path(result.stdout.strip().splitlines()[-1])
    if not (bin_dir / "kube-apiserver").exists():
        raise ControlPlaneError(f"build.sh printed {bin_dir}, which holds no kube-apiserver")
    return bin_dir


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ControlPlaneError(f"openssl {' '.join(args)} failed: {result.stderr}")


def issue_certificate(
    pki: Path, name: str, subject: str, extensions: str, *, days: int = 365
) -> None:
    """Create ``name.key`` and ``name.crt`` signed by the test CA in ``pki``."""
    (pki / f"{name}.ext").write_text(extensions)
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-subj", subject, "-out", f"{name}.csr",
        cwd=pki,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", str(days), "-out", f"{name}.crt",
        "-extfile", f"{name}.ext",
        cwd=pki,
    )  # fmt: skip


def generate_pki(pki: Path) -> None:
    """Generate the CA, serving and client certificates and the service-account key pair."""
    pki.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650",
        "-subj", "/CN=quartermaster-test-ca",
        cwd=pki,
    )  # fmt: skip
    server_names = ",".join(
        [
            "IP:127.0.0.1",
            "IP:10.0.0.1",
            *(f"IP:{subnet.network_address + 1}" for subnet in POD_SUBNETS),
            "DNS:localhost",
            "DNS:kubernetes",
            "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local",
        ]
    )
    issue_certificate(
        pki,
        "apiserver",
        "/CN=kube-apiserver",
        f"subjectAltName={server_names}\nextendedKeyUsage=serverAuth\n",
    )
    client = "extendedKeyUsage=clientAuth\n"
    # The admin belongs to system:masters. So does the controller manager: it
    # runs every controller under its own identity rather than one service
    # account per controller, and the default system:kube-controller-manager
    # role alone does not cover what the controllers write (node taints, for
    # one). The scheduler gets exactly the default system:kube-scheduler role.
    issue_certificate(pki, "admin", "/O=system:masters/CN=quartermaster-admin", client)
    issue_certificate(
        pki, "controller-manager", "/O=system:masters/CN=system:kube-controller-manager", client
    )
    issue_certificate(pki, "scheduler", "/CN=system:kube-scheduler", client)
    # The apiserver's client identity towards kubelets (the node agent serves logs).
    issue_certificate(pki, "apiserver-kubelet-client", "/O=system:masters/CN=apiserver", client)
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "sa.key", cwd=pki)
    _openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def write_kubeconfig(path: Path, *, server: str, pki: Path, user: str) -> None:
    """Write a kubeconfig that reaches ``server`` with the client certificate ``user``."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "quartermaster-test",
                "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate": str(pki / f"{user}.crt"),
                    "client-key": str(pki / f"{user}.key"),
                },
            }
        ],
        "contexts": [
            {
                "name": "quartermaster-test",
                "context": {"cluster": "quartermaster-test", "user": user},
            }
        ],
        "current-context": "quartermaster-test",
    }
    # JSON is valid YAML, and every kubeconfig loader reads it.
    path.write_text(json.dumps(config, indent=2))


@dataclass
class ControlPlaneState:
    """What a running control plane left in ``state.json``."""

    run_dir: str
    bin_dir: str
    kubeconfig: str
    server: str
    etcd_client_port: int
    apiserver_port: int
    pids: dict[str, int] = field(default_factory=dict)
    started_at: float = 0.0


class ControlPlane:
    """Start, probe and stop the four control plane processes."""

    def __init__(
        self,
        run_dir: Path | None = None,
        bin_dir: Path | None = None,
        *,
        die_with_parent: bool = False,
    ) -> None:
        self.run_dir = (run_dir or default_run_dir()).resolve()
        self.bin_dir = bin_dir
        # A test session that owns its control plane takes it down even when
        # the session itself is killed; `up` leaves it running on purpose.
        self.die_with_parent = die_with_parent
        self.state: ControlPlaneState | None = None
        self._processes: dict[str, subprocess.Popen[bytes]] = {}

    # -- paths -----------------------------------------------------------------
    @property
    def pki(self) -> Path:
        """Certificates and keys."""
        return self.run_dir / "pki"

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig for tests and the runtime."""
        return self.run_dir / "admin.kubeconfig"

    @property
    def state_file(self) -> Path:
        """Where pids and ports are recorded for ``down`` and other processes."""
        return self.run_dir / "state.json"

    # -- lifecycle ---------------------------------------------------------------
    def start(self, *, timeout: float = 180.0) -> ControlPlaneState:
        """Generate credentials, start every process and wait until the API is ready."""
        if self.bin_dir is None:
            self.bin_dir = build_binaries()
        if self.run_dir.exists():
            shutil.rmtree(self.run_dir)
        self.run_dir.mkdir(parents=True)
        generate_pki(self.pki)
        etcd_client, etcd_peer, api_port = _free_port(), _free_port(), _free_port()
        server = f"https://127.0.0.1:{api_port}"
        write_kubeconfig(self.kubeconfig, server=server, pki=self.pki, user="admin")
        for component in ("controller-manager", "scheduler"):
            write_kubeconfig(
                self.run_dir / f"{component}.kubeconfig",
                server=server,
                pki=self.pki,
                user=component,
            )
        self.state = ControlPlaneState(
            run_dir=str(self.run_dir),
            bin_dir=str(self.bin_dir),
            kubeconfig=str(self.kubeconfig),
            server=server,
            etcd_client_port=etcd_client,
            apiserver_port=api_port,
            started_at=time.time(),
        )
        try:
            self._spawn("etcd", self._etcd_args(etcd_client, etcd_peer))
            self._wait_for_etcd(etcd_client, timeout)
            self._spawn("kube-apiserver", self._apiserver_args(etcd_client, api_port))
            self._wait_for_ready(timeout)
            self._spawn("kube-controller-manager", self._controller_manager_args())
            self._spawn("kube-scheduler", self._scheduler_args())
            self._wait_for_service_account_controller(timeout)
        except BaseException:
            self.stop()
            raise
        self._write_state()
        return self.state

    def stop(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL) and remove the run folder."""
        pids = dict(self.state.pids) if self.state else {}
        for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            pid = pids.get(name)
            if pid is not None:
                _terminate(pid, self._processes.get(name))
        self._processes.clear()
        if self.run_dir.exists():
            shutil.rmtree(self.run_dir, ignore_errors=True)
        self.state = None

    @classmethod
    def attach(cls, run_dir: Path | None = None) -> ControlPlane | None:
        """A handle on a control plane started by another process, if it is up."""
        plane = cls(run_dir)
        if not plane.state_file.exists():
            return None
        raw = json.loads(plane.state_file.read_text())
        plane.state = ControlPlaneState(**raw)
        plane.bin_dir = Path(plane.state.bin_dir)
        if not all(_alive(pid) for pid in plane.state.pids.values()):
            return None
        try:
            plane._wait_for_ready(5.0)
        except ControlPlaneError:
            return None
        return plane

    # -- arguments ---------------------------------------------------------------
    def _etcd_args(self, client_port: int, peer_port: int) -> list[str]:
        peer = f"http://127.0.0.1:{peer_port}"
        client = f"http://127.0.0.1:{client_port}"
        return [
            "--name=qm",
            f"--data-dir={self.run_dir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=qm={peer}",
            # Test data is thrown away with the run folder: fsync buys nothing.
            "--unsafe-no-fsync",
            "--log-level=warn",
        ]

    def _apiserver_args(self, etcd_port: int, api_port: int) -> list[str]:
        pki = self.pki
        return [
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={api_port}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            "--kubelet-preferred-address-types=InternalIP",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC",
            "--allow-privileged=true",
            "--profiling=false",
            # Pods are watched straight from etcd rather than the watch cache.
            # Then a resourceVersion expires exactly when etcd compacts past
            # it (410 Gone), which is what re-list tests need; through the
            # cache, expiry depends on how many events went by and how long ago.
            "--watch-cache-sizes=pods#0",
            "--v=1",
        ]

    def compact_etcd(self) -> int:
        """Compact etcd to its current revision; returns that revision.

        Every resourceVersion before it is then gone: a watch from one gets 410.
        """
        assert self.state is not None
        base = f"http://127.0.0.1:{self.state.etcd_client_port}/v3/kv"
        probe = urllib.request.Request(f"{base}/range", data=json.dumps({"key": "AA=="}).encode())
        with urllib.request.urlopen(probe, timeout=5) as response:
            revision = int(json.loads(response.read())["header"]["revision"])
        body = json.dumps({"revision": revision, "physical": True}).encode()
        with urllib.request.urlopen(
            urllib.request.Request(f"{base}/compaction", data=body), timeout=10
        ):
            pass
        return revision

    def _controller_manager_args(self) -> list[str]:
        kubeconfig = self.run_dir / "controller-manager.kubeconfig"
        return [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            f"--controllers={','.join(CONTROLLERS)}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            "--secure-port=0",
            f"--service-account-private-key-file={self.pki / 'sa.key'}",
            f"--root-ca-file={self.pki / 'ca.crt'}",
            "--use-service-account-credentials=false",
            # Lost nodes are noticed within seconds rather than the production
            # default of most of a minute, so node-loss tests stay short.
            "--node-monitor-period=1s",
            "--node-monitor-grace-period=8s",
            "--concurrent-gc-syncs=5",
            "--v=1",
        ]

    def _scheduler_args(self) -> list[str]:
        kubeconfig = self.run_dir / "scheduler.kubeconfig"
        return [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            "--secure-port=0",
            "--v=1",
        ]

    # -- processes ---------------------------------------------------------------
    def _spawn(self, name: str, args: list[str]) -> None:
        assert self.state is not None and self.bin_dir is not None
        log = open(self.run_dir / f"{name}.log", "wb")  # noqa: SIM115 - owned by the child
        process = subprocess.Popen(
            [str(self.bin_dir / name), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # Its own session: a Ctrl-C in the terminal that ran `up` does not
            # reach it, and `down` signals exactly the pids it recorded.
            start_new_session=True,
            preexec_fn=die_with_parent_process if self.die_with_parent else None,
        )
        log.close()
        self._processes[name] = process
        self.state.pids[name] = process.pid
        self._write_state()

    def _write_state(self) -> None:
        assert self.state is not None
        self.state_file.write_text(json.dumps(asdict(self.state), indent=2))

    def _check_alive(self) -> None:
        for name, process in self._processes.items():
            if process.poll() is not None:
                tail = (self.run_dir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise ControlPlaneError(f"{name} exited with {process.returncode}:\n{tail}")

    def _wait_for_etcd(self, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        raise ControlPlaneError("etcd did not become healthy")

    def ssl_context(self) -> ssl.SSLContext:
        """An SSL context that trusts the test CA and presents the admin certificate."""
        context = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        context.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return context

    def _get(self, path: str) -> tuple[int, bytes]:
        assert self.state is not None
        request = urllib.request.Request(self.state.server + path)
        try:
            with urllib.request.urlopen(request, context=self.ssl_context(), timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def _wait_for_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                status, body = self._get("/readyz")
                if status == 200:
                    return
                last = body.decode(errors="replace")
            except OSError as error:
                last = str(error)
            time.sleep(0.3)
        raise ControlPlaneError(f"kube-apiserver not ready: {last[-2000:]}")

    def _wait_for_service_account_controller(self, timeout: float) -> None:
        """Pods are refused until the namespace's default service account exists."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            status, _ = self._get("/api/v1/namespaces/default/serviceaccounts/default")
            if status == 200:
                return
            time.sleep(0.3)
        raise ControlPlaneError("the service account controller created no default account")


def die_with_parent_process() -> None:
    """In the child: receive SIGTERM when the process that started it exits (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _terminate(pid: int, process: subprocess.Popen[bytes] | None, timeout: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None:
            if process.poll() is not None:
                return
        elif not _alive(pid):
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    if process is not None:
        process.wait()


def main(argv: list[str] | None = None) -> int:
    """Command line entry point: ``up``, ``down``, ``env`` or ``build``."""
    parser = argparse.ArgumentParser(prog="python -m tools.k8s.controlplane")
    parser.add_argument("action", choices=["up", "down", "env", "build"])
    parser.add_argument("--run-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    run_dir = args.run_dir or default_run_dir()
    if args.action == "build":
        print(build_binaries())
        return 0
    if args.action == "up":
        existing = ControlPlane.attach(run_dir)
        if existing is not None and existing.state is not None:
            print(f"already up: KUBECONFIG={existing.state.kubeconfig}")
            return 0
        started = time.monotonic()
        state = ControlPlane(run_dir).start()
        print(
            f"up in {time.monotonic() - started:.1f} s: {state.server} "
            f"KUBECONFIG={state.kubeconfig}"
        )
        return 0
    if args.action == "env":
        plane = ControlPlane.attach(run_dir)
        if plane is None or plane.state is None:
            print("control plane is not running", file=sys.stderr)
            return 1
        print(f"export KUBECONFIG={plane.state.kubeconfig}")
        return 0
    plane = ControlPlane(run_dir)
    if plane.state_file.exists():
        plane.state = ControlPlaneState(**json.loads(plane.state_file.read_text()))
    plane.stop()
    print("down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
