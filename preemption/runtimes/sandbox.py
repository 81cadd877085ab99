"""A sandbox per gang of the local runtime: namespaces, a cgroup per rank, limits.

A local rank runs as a real process on the host, so without more it could outlive its
job (double fork, `setsid`, exec with an empty environment: no process group and no
marker left to find it by), read every other process's command line in /proc, reach
every port on the host's loopback (the portal, Redis, another job's rendezvous), and
start processes or write files until the host runs out. The sandbox closes each:

- A cgroup per rank, under one folder per gang (`<the control plane's own cgroup>/
  quartermaster/<gang>/<rank>`), that every process the rank starts is born into: the
  rank's child joins it before it executes anything, so nothing escapes it by forking
  early. Ending a rank or a gang kills what is in the cgroup (cgroup.kill on v2 where
  the kernel has it; else freeze, SIGKILL every pid, thaw, so nothing forks meanwhile).
  The cgroup holds the limits: pids.max and the memory limit per rank.
- A PID namespace and a mount namespace per rank with its own /proc (util-linux
  `unshare --pid --mount --fork --mount-proc`): a rank sees only its own processes.
  Its first process is a small shell that only waits for the rank's own shell, so a
  workload never runs as the namespace's init (which would ignore SIGTERM from the
  host); when the rank's shell ends, that init exits and the kernel kills whatever the
  rank left running in the namespace.
- One network namespace per gang, bound to a file in the gang's folder (`unshare
  --net=<file>`), with only loopback, brought up by each rank as it enters: the ranks
  of a gang rendezvous on 127.0.0.1 among themselves, and reach nothing else.
- RLIMIT_FSIZE on every process of the rank: a write past the limit fails with EFBIG
  (after SIGXFSZ, which ends a process that does not catch it).

Why here, with util-linux and the kernel's files, and not a library: the cgroup
libraries on PyPI are either v1 only and unmaintained for years (cgroupspy, cgroup-utils)
or thin wrappers over one version (cgroupsv2), and none creates namespaces; systemd's
transient scopes (systemd-run) would tie the runtime to systemd, which containers and
CI machines do not run. bubblewrap would make the namespaces but not the cgroups, and
is not on every host; util-linux `unshare` is. The cgroup work is writing a few files,
which this module does for v1 (one hierarchy per controller: pids, memory, freezer)
and v2 (one unified hierarchy), whichever the host has.

What it costs and what it does not do: a rank's pid and exit code are still its
keeper's to record (the keeper's child is `unshare`, on the host's side of the
namespace); signals to the rank's process group reach every process of the rank as
before. Each rank has a PID namespace of its own, so libraries that compare the PID
namespaces of two ranks (NCCL's same-process checks) treat them as separate hosts'
processes would be; their rendezvous and sockets are unaffected. There is no disk quota
beyond the largest file: a size-limited tmpfs as the work folder would lose the
rank's files at its end, which the runtime keeps.

Everything here is standard library only: it runs between fork and exec in the keeper.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import resource
import shutil
import signal
import socket
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODES = ("auto", "on", "off")

# The v1 hierarchies a rank joins: limits (pids, memory) and the freezer for the kill.
V1_CONTROLLERS = ("pids", "memory", "freezer")
V2_CONTROLLERS = ("pids", "memory")
CGROUP_FOLDER = "quartermaster"
NETNS_FILE = "netns"

# The first process of a rank's PID namespace: it survives the signals the control plane
# sends the rank's process group (a namespace's init gets only the signals it handles),
# waits for the rank's own shell and exits with its status. `env --default-signal`
# gives the rank back the default SIGUSR2 that `unshare`'s side ignores (see enter()).
NAMESPACE_INIT = (
    "trap : TERM USR2 INT HUP\n"
    f'{shutil.which("env") or "/usr/bin/env"} --default-signal=USR2 /bin/sh -c "$1"\n'
    "exit $?"
)
UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"

_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """What one rank may take: processes (threads count), memory and the largest file,
    in bytes."""

    pids_max: int
    memory_max: int
    file_size_max: int

    def record(self) -> dict[str, int]:
        return {
            "pids_max": self.pids_max,
            "memory_max": self.memory_max,
            "file_size_max": self.file_size_max,
        }


@dataclass(frozen=True, slots=True)
class SandboxConfig:
    """The settings' choice: `auto` sandboxes where the machine can and says why not
    elsewhere, `on` refuses to launch without a sandbox, `off` never makes one."""

    mode: str
    limits: SandboxLimits


@dataclass(frozen=True, slots=True)
class SandboxSupport:
    """Whether this machine can make sandboxes, and why not."""

    available: bool
    reason: str
    cgroup_version: int | None = None


def parse_size(text: str) -> int:
    """Bytes from `123`, `512M`, `64G` or `1T` (binary units); ValueError otherwise."""
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = value[-1:] if value[-1:] in _SIZE_UNITS and value[-1:] else ""
    number = value[: len(value) - len(unit)]
    if not number.isdigit() or int(number) <= 0:
        raise ValueError(f"{text!r} is not a size such as 512M or 64G")
    return int(number) * _SIZE_UNITS[unit]


# --------------------------------------------------------------- finding the cgroups


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, file system type, options) of every cgroup mount."""
    found = []
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) >= 4 and fields[2] in ("cgroup", "cgroup2"):
                found.append((fields[1], fields[2], set(fields[3].split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """This process's cgroup in each hierarchy: controller (or "" for v2) -> path."""
    paths: dict[str, str] = {}
    with open("/proc/self/cgroup") as cgroups:
        for line in cgroups:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
    return paths


def _v1_bases() -> dict[str, Path] | None:
    """The folder under which gang cgroups go in each v1 hierarchy, if all are mounted."""
    own = _own_paths()
    bases: dict[str, Path] = {}
    for controller in V1_CONTROLLERS:
        mount = next(
            (
                point
                for point, kind, options in _mounts()
                if kind == "cgroup" and controller in options
            ),
            None,
        )
        if mount is None or controller not in own:
            return None
        bases[controller] = Path(mount) / own[controller].lstrip("/") / CGROUP_FOLDER
    return bases


def _v2_base() -> tuple[Path | None, str]:
    """The folder for gang cgroups in the unified hierarchy, or why there is none."""
    mount = next((point for point, kind, _ in _mounts() if kind == "cgroup2"), None)
    if mount is None:
        return None, "no cgroup file system is mounted"
    own = Path(mount) / _own_paths().get("", "/").lstrip("/")
    try:
        available = set((own / "cgroup.controllers").read_text().split())
    except OSError as error:
        return None, f"cannot read {own / 'cgroup.controllers'}: {error.strerror}"
    missing = [name for name in V2_CONTROLLERS if name not in available]
    if missing:
        return None, f"the cgroup {own} has no {' or '.join(missing)} controller"
    return own / CGROUP_FOLDER, ""


def _enable_v2(base: Path) -> None:
    """Make `base` and hand the pids and memory controllers to the gangs below it."""
    base.mkdir(mode=0o755, exist_ok=True)
    controllers = " ".join(f"+{name}" for name in V2_CONTROLLERS)
    for folder in (base.parent, base):
        enabled = set((folder / "cgroup.subtree_control").read_text().split())
        if not set(V2_CONTROLLERS) <= enabled:
            (folder / "cgroup.subtree_control").write_text(controllers)


@functools.cache
def support() -> SandboxSupport:
    """Whether this process can make sandboxes (asked once per process)."""
    if os.geteuid() != 0:
        return SandboxSupport(
            False,
            f"the control plane runs as uid {os.geteuid()}, not root: namespaces "
            "and cgroups need root",
        )
    if shutil.which("unshare") is None or shutil.which("env") is None:
        return SandboxSupport(False, "util-linux `unshare` is not installed")
    version: int | None = None
    reason = ""
    try:
        bases = _v1_bases()
        if bases is not None:
            for base in bases.values():
                base.mkdir(mode=0o755, exist_ok=True)
            version = 1
        else:
            base, reason = _v2_base()
            if base is not None:
                _enable_v2(base)
                version = 2
    except OSError as error:
        reason = f"cannot make a cgroup: {error}"
        if error.errno == 16:  # EBUSY
            reason += (
                " (cgroup v2 enables controllers only below a cgroup with no processes:"
                " run the control plane in a leaf of a delegated cgroup)"
            )
    if version is None:
        return SandboxSupport(False, reason)
    probe = subprocess.run(
        [UNSHARE, "--pid", "--mount", "--net", "--fork", "--mount-proc", "true"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        return SandboxSupport(
            False, f"unshare cannot make namespaces here: {probe.stderr.strip()}", version
        )
    return SandboxSupport(True, "", version)


# ------------------------------------------------------------- making a gang's sandbox


def gang_name(root: Path, job_id: int, attempt: int) -> str:
    """The gang's cgroup folder name; the runtime root's hash keeps two control planes
    (or two test runs) on one host apart."""
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:10]
    return f"{digest}-{job_id}-{attempt}"


def prepare(name: str, gang_dir: Path, rank_count: int, limits: SandboxLimits) -> dict[str, Any]:
    """Make the gang's cgroups (one per rank, with its limits) and its network namespace;
    the record the keepers and the runtime find them by (in gang.json). Idempotent: a
    concurrent or repeated launch of the gang makes and records the same ones."""
    found = support()
    if not found.available:
        raise OSError(f"no sandbox on this machine: {found.reason}")
    cgroups: dict[str, str] = {}
    if found.cgroup_version == 1:
        bases = _v1_bases()
        assert bases is not None
        for controller, base in bases.items():
            cgroups[controller] = str(base / name)
    else:
        base, _ = _v2_base()
        assert base is not None
        cgroups["unified"] = str(base / name)
    for rank in range(rank_count):
        for controller, folder in cgroups.items():
            leaf = Path(folder) / str(rank)
            leaf.mkdir(mode=0o755, parents=True, exist_ok=True)
            _write_limits(controller, leaf, limits)
    netns = gang_dir / NETNS_FILE
    if not _is_netns(netns):
        with contextlib.suppress(FileExistsError):
            os.close(os.open(netns, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        subprocess.run(
            [UNSHARE, f"--net={netns}", "true"], check=True, capture_output=True, text=True
        )
    return {
        "version": found.cgroup_version,
        "cgroups": cgroups,
        "netns": str(netns),
        "limits": limits.record(),
    }


def _write_limits(controller: str, leaf: Path, limits: SandboxLimits) -> None:
    if controller == "pids":
        (leaf / "pids.max").write_text(str(limits.pids_max))
    elif controller == "memory":
        (leaf / "memory.limit_in_bytes").write_text(str(limits.memory_max))
    elif controller == "unified":
        (leaf / "pids.max").write_text(str(limits.pids_max))
        (leaf / "memory.max").write_text(str(limits.memory_max))
        # No swap: the limit is the memory the rank may hold, not where it sits.
        with contextlib.suppress(FileNotFoundError):
            (leaf / "memory.swap.max").write_text("0")


def _is_netns(path: Path) -> bool:
    """True when a network namespace is bound to `path` (its inode is nsfs's)."""
    try:
        return os.stat(path).st_dev != os.stat(path.parent).st_dev
    except FileNotFoundError:
        return False


# -------------------------------------------------------- entering it (fork to exec)


def rank_command(script: str, run_as: dict[str, Any] | None) -> list[str]:
    """The rank's shell script run in a PID and mount namespace of its own, under a
    small init (NAMESPACE_INIT), as the job's user and group alone when it has them."""
    identity = []
    if run_as is not None:
        identity = ["--setgid", str(int(run_as["gid"])), "--setuid", str(int(run_as["uid"]))]
    return [
        UNSHARE,
        "--pid",
        "--mount",
        "--fork",
        "--mount-proc",
        "--kill-child",
        *identity,
        "/bin/sh",
        "-c",
        NAMESPACE_INIT,
        "qm-rank",
        script,
    ]


def enter(sandbox: dict[str, Any], rank: int) -> None:
    """In the rank's child, between fork and exec, still as root: join the rank's
    cgroups, the gang's network namespace (loopback up), and set the file size limit.

    `unshare`, which runs next, ignores the SIGUSR2 notice meant for the rank (it would
    die of it); the namespace's init hands the rank the default action back."""
    pid = str(os.getpid())
    for folder in sandbox["cgroups"].values():
        with open(Path(folder) / str(rank) / "cgroup.procs", "w") as procs:
            procs.write(pid)
    descriptor = os.open(sandbox["netns"], os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(descriptor, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns into the gang's network namespace failed")
    finally:
        os.close(descriptor)
    _loopback_up()
    size = int(sandbox["limits"]["file_size_max"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(probe, _SIOCGIFFLAGS, request))[1]
        if not flags & _IFF_UP:
            fcntl.ioctl(probe, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


# ------------------------------------------------------------------ ending and cleaning


def _leaves(sandbox: dict[str, Any], controller: str, rank: int | None) -> list[Path]:
    folder = Path(sandbox["cgroups"][controller])
    if rank is not None:
        return [folder / str(rank)]
    with contextlib.suppress(FileNotFoundError):
        return sorted(path for path in folder.iterdir() if path.is_dir())
    return []


def _procs(leaf: Path) -> list[int]:
    try:
        return [int(line) for line in (leaf / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def pids(sandbox: dict[str, Any], rank: int | None = None) -> dict[int, int]:
    """Every live process in the gang's (or one rank's) cgroups: pid -> rank."""
    controller = "freezer" if "freezer" in sandbox["cgroups"] else "unified"
    found: dict[int, int] = {}
    for leaf in _leaves(sandbox, controller, rank):
        for pid in _procs(leaf):
            found[pid] = int(leaf.name)
    return found


def kill(sandbox: dict[str, Any], rank: int | None = None, *, wait_seconds: float = 5.0) -> None:
    """SIGKILL every process in the gang's (or one rank's) cgroups, none of which can fork
    meanwhile, and wait (up to `wait_seconds`) until they are gone."""
    if "unified" in sandbox["cgroups"]:
        for leaf in _leaves(sandbox, "unified", rank):
            if (leaf / "cgroup.kill").exists():
                with contextlib.suppress(FileNotFoundError):
                    (leaf / "cgroup.kill").write_text("1")
            else:
                _frozen_kill(leaf / "cgroup.freeze", "1", "0", leaf)
    else:
        for leaf in _leaves(sandbox, "freezer", rank):
            _frozen_kill(leaf / "freezer.state", "FROZEN", "THAWED", leaf)
    deadline = time.monotonic() + wait_seconds
    while pids(sandbox, rank) and time.monotonic() < deadline:
        time.sleep(0.01)


def _frozen_kill(state: Path, frozen: str, thawed: str, leaf: Path) -> None:
    if not _procs(leaf):
        return
    try:
        state.write_text(frozen)
    except FileNotFoundError:
        return
    try:
        # v1 reports FREEZING until every task has stopped; a bounded wait, since a task
        # stuck in the kernel is killed all the same once thawed.
        deadline = time.monotonic() + 1.0
        while state.read_text().strip() not in (frozen, "1") and time.monotonic() < deadline:
            time.sleep(0.001)
        for pid in _procs(leaf):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    finally:
        state.write_text(thawed)


def release(sandbox: dict[str, Any]) -> None:
    """Kill what is left in the gang's cgroups, remove them and its network namespace."""
    kill(sandbox)
    for controller in sandbox["cgroups"]:
        # A cgroup with a process left in it (one stuck in the kernel) stays; the next
        # release, at forget(), removes it.
        for leaf in _leaves(sandbox, controller, None):
            with contextlib.suppress(OSError):
                leaf.rmdir()
        with contextlib.suppress(OSError):
            Path(sandbox["cgroups"][controller]).rmdir()
    netns = Path(sandbox["netns"])
    if _is_netns(netns):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.umount2(str(netns).encode(), 2)  # MNT_DETACH
    netns.unlink(missing_ok=True)
