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
  the kernel has it, at the gang's folder for a gang; else one pass of SIGKILL, which
  kills each rank's PID namespace with its init, forks made meanwhile included).
  The cgroup holds the limits: pids.max and the memory limit per rank (with no swap
  beyond it). A rank that allocates past its memory limit is killed by the kernel's OOM
  killer inside its cgroup, not the host's; `oom_kills` counts those kills, so the
  keeper can record why the rank died (`end_reason`).
- A PID namespace and a mount namespace per rank with its own /proc: a rank sees only
  its own processes. The namespace's first process (its init) is not the workload: it
  only waits for the rank's shell, reaping whatever the rank orphans meanwhile, and
  exits with the shell's status, so a workload never runs as the namespace's init
  (which would ignore SIGTERM from the host); when the init exits, the kernel kills
  whatever the rank left running in the namespace. The rank cannot end, stop or trace
  its init, though both run as the job's user: the kernel drops every signal sent to
  a namespace's init from inside it that the init has no handler for (SIGKILL and
  SIGSTOP included), and a process that changed its user from root cannot be traced
  or read through /proc by that user.
- One network namespace per gang, bound to a file in the gang's folder, with only
  loopback, brought up once as the namespace is made: the ranks of a gang rendezvous on
  127.0.0.1 among themselves, and reach nothing else.
- RLIMIT_FSIZE on every process of the rank: a write past the limit fails with EFBIG
  (after SIGXFSZ, which ends a process that does not catch it).

Who does what, and why with the kernel's calls (unshare(2), setns(2), mount(2) through
ctypes, as Python 3.11 has no os.unshare) and not util-linux `unshare`: the runtime
writes the gang's paths into gang.json (`prepare`, no system calls beyond reading this
process's mounts once), and the launch server's per-request child makes the cgroups and
the network namespace in one pass before it forks the keepers (`create`): a
single-threaded process where forking is safe, unlike the worker; it forks the keepers
first and makes the sandbox while they start, and each rank waits for it on a pipe.
Each keeper unshares a PID namespace just before it starts its rank
(`new_pid_namespace`), so the child it starts and waits on is the namespace's init;
that child, in its preexec step (`enter`), joins the cgroups and the network namespace,
makes its mount namespace and /proc, drops to the job's user and starts the rank's
shell with posix_spawn(3), which unlike a fork copies nothing of the init's memory (a
fork of this Python process was a millisecond or more, the largest part of what the
sandbox added). With util-linux `unshare` and a shell as the init the same start
executed three more programs (`unshare`, `sh` as the init, `env` to give SIGUSR2 back),
forked twice more, and ran one more program per gang for its network namespace, which
nearly doubled the time to start a rank (bench/bench_sandbox.py measures it).

Where the rest of the time goes, measured on this host (cgroup v1, 2 cores, Linux
6.18), and why it stays: (1) joining a v1 cgroup takes the kernel's global
cgroup_threadgroup_rwsem for writing, whose first taker after a quiet moment waits for
an RCU grace period, 6 to 14 ms, shared by the writers of that moment; the launch
server's child takes it first, once it has forked the keepers (`prime_migrations`), so
the inits mostly find it warm (20 to 100 us a join) or share what is left of that grace
period. Only the host can remove it (cgroup v2 mounted with `favordynmods`, or v2's
clone3 with CLONE_INTO_CGROUP, which Python 3.11 cannot call safely). (2) At a rank's end the kernel tears down
its PID namespace and its mount namespace, whose unmounts wait for a grace period: 0.7
to 1.3 ms from SIGKILL to the keeper's wait returning, against 0.2 ms without. The
stop needs no freezer and waits for nothing of its own (see `kill`), and no scan of the
process table: nothing of a sandboxed gang is outside its cgroups.

Why no library: the cgroup libraries on PyPI are either v1 only and unmaintained for
years (cgroupspy, cgroup-utils) or thin wrappers over one version (cgroupsv2), and none
creates namespaces; systemd's transient scopes (systemd-run) would tie the runtime to
systemd, which containers and CI machines do not run. bubblewrap would make the
namespaces but not the cgroups, and is not on every host, nor would it save the
programs it costs to execute. The cgroup work is writing a few files, which this module
does for v1 (one hierarchy per controller: pids, memory) and v2 (one unified
hierarchy), whichever the host has.

What it costs and what it does not do: a rank's pid and exit code are still its
keeper's to record (its child, the init, whose status is the rank's shell's). The init
is a fork of the keeper, a Python process, so each rank holds one such process more,
sharing its pages with the keeper until written. Signals to the rank's process group
reach every process of the rank as before. Each rank has a PID namespace of its own, so
libraries that compare the PID namespaces of two ranks (NCCL's same-process checks)
treat them as separate hosts' processes would be; their rendezvous and sockets are
unaffected. There is no disk quota beyond the largest file: a size-limited tmpfs as the
work folder would lose the rank's files at its end, which the runtime keeps.

Everything here is standard library only: it runs between fork and exec in the keeper.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

MODES = ("auto", "on", "off")

# What the process making a gang's sandbox writes, once for each rank, when it failed.
NOT_MADE = b"!"

# The v1 hierarchies a rank joins, for its limits. No freezer: the kill needs none
# (see `kill`), and a third hierarchy cost a folder and a write per rank.
V1_CONTROLLERS = ("pids", "memory")
V2_CONTROLLERS = ("pids", "memory")
CGROUP_FOLDER = "quartermaster"
NETNS_FILE = "netns"

# The signals the control plane sends a rank's process group. The two processes of the
# sandbox that are not the rank's (the host-side one and the init) ignore them, and the
# rank's shell gets each back at its default before it executes.
RANK_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2)

# The exit status of a sandbox process that failed before the rank's shell could start
# (as a shell reports a command it could not execute).
EXIT_NOT_STARTED = 127

_LIBC = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNS = 0x00020000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_NOEXEC = 0x8
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18
_MNT_DETACH = 2
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_PR_SET_NO_NEW_PRIVS = 38
_SYS_CLOSE_RANGE = 436
_CLOSE_RANGE_CLOEXEC = 1 << 2

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
class FlavorLimits:
    """A flavor's own limits for its ranks (quotas.ResourceFlavor's `rank_*` fields);
    None leaves the site's. Memory is per GPU of the rank."""

    pids_max: int | None = None
    memory_per_gpu: int | None = None
    file_size_max: int | None = None


@dataclass(frozen=True, slots=True)
class SandboxConfig:
    """The settings' choice: `auto` sandboxes where the machine can and says why not
    elsewhere, `on` refuses to launch without a sandbox, `off` never makes one.
    `limits` are the site's; `flavor_limits`, asked at each launch, a flavor's own."""

    mode: str
    limits: SandboxLimits
    flavor_limits: Callable[[str], FlavorLimits | None] | None = None

    def limits_for(self, flavor: str, gpus_per_rank: int) -> SandboxLimits:
        """The limits of one rank of a gang on `flavor` with `gpus_per_rank` GPUs: the
        flavor's where it sets them, else the site's."""
        own = self.flavor_limits(flavor) if self.flavor_limits is not None and flavor else None
        if own is None:
            return self.limits
        return SandboxLimits(
            pids_max=own.pids_max or self.limits.pids_max,
            memory_max=own.memory_per_gpu * max(gpus_per_rank, 1)
            if own.memory_per_gpu
            else self.limits.memory_max,
            file_size_max=own.file_size_max or self.limits.file_size_max,
        )


@dataclass(frozen=True, slots=True)
class SandboxSupport:
    """Whether this machine can make sandboxes, and why not."""

    available: bool
    reason: str
    cgroup_version: int | None = None
    # Where gang cgroups go: (controller, folder) per v1 hierarchy, or ("unified", folder).
    bases: tuple[tuple[str, str], ...] = ()


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


# A child that makes every namespace a rank needs and mounts a /proc in them: the
# kernel's answer on this machine (a container without CAP_SYS_ADMIN, a seccomp filter,
# user namespaces only) before any launch depends on it.
_PROBE = f"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
def check(result, what):
    if result != 0:
        sys.exit(f"{{what}}: {{os.strerror(ctypes.get_errno())}}")
check(libc.unshare({_CLONE_NEWPID | _CLONE_NEWNS | _CLONE_NEWNET}), "unshare")
check(libc.mount(None, b"/", None, {_MS_REC | _MS_PRIVATE}, None), "mount --make-rprivate /")
child = os.fork()
if child == 0:
    check(libc.mount(b"proc", b"/proc", b"proc", {_MS_NOSUID | _MS_NODEV | _MS_NOEXEC}, None),
          "mount /proc")
    os._exit(0 if os.getpid() == 1 else 1)
sys.exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
"""


@functools.cache
def support() -> SandboxSupport:
    """Whether this process can make sandboxes (asked once per process)."""
    if os.geteuid() != 0:
        return SandboxSupport(
            False,
            f"the control plane runs as uid {os.geteuid()}, not root: namespaces "
            "and cgroups need root",
        )
    version: int | None = None
    reason = ""
    bases: dict[str, Path] = {}
    try:
        found = _v1_bases()
        if found is not None:
            for base in found.values():
                base.mkdir(mode=0o755, exist_ok=True)
            version, bases = 1, found
        else:
            base, reason = _v2_base()
            if base is not None:
                _enable_v2(base)
                version, bases = 2, {"unified": base}
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
        [sys.executable, "-I", "-S", "-c", _PROBE], capture_output=True, text=True, check=False
    )
    if probe.returncode != 0:
        why = probe.stderr.strip().splitlines()[-1:] or [f"status {probe.returncode}"]
        return SandboxSupport(False, f"cannot make namespaces here: {why[0]}", version)
    return SandboxSupport(
        True, "", version, tuple((name, str(folder)) for name, folder in bases.items())
    )


# ------------------------------------------------------------- making a gang's sandbox


def gang_name(root: Path, job_id: int, attempt: int) -> str:
    """The gang's cgroup folder name; the runtime root's hash keeps two control planes
    (or two test runs) on one host apart."""
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:10]
    return f"{digest}-{job_id}-{attempt}"


def prepare(name: str, gang_dir: Path, limits: SandboxLimits) -> dict[str, Any]:
    """The record the keepers and the runtime find the gang's sandbox by (in gang.json):
    its cgroup folders, its network namespace's file and the limits. Makes nothing:
    `create` does, in the launch server's child that forks the keepers."""
    found = support()
    if not found.available:
        raise OSError(f"no sandbox on this machine: {found.reason}")
    return {
        "version": found.cgroup_version,
        "cgroups": {controller: str(Path(base) / name) for controller, base in found.bases},
        "netns": str(gang_dir / NETNS_FILE),
        "limits": limits.record(),
    }


def create(sandbox: dict[str, Any], ranks: list[int]) -> None:
    """Make the cgroups of `ranks` (with their limits) and the gang's network namespace,
    in one pass. Idempotent: a concurrent or repeated launch of the gang makes the same
    ones. Run in the launch server's child, which is single-threaded (see the module
    docstring)."""
    limits = sandbox["limits"]
    for controller, folder in sandbox["cgroups"].items():
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o755)
        for rank in ranks:
            leaf = f"{folder}/{rank}"
            with contextlib.suppress(FileExistsError):
                os.mkdir(leaf, 0o755)
            _write_limits(controller, leaf, limits)
    netns = Path(sandbox["netns"])
    if not _is_netns(netns):
        _bind_new_netns(netns)


def prime_migrations(sandbox: dict[str, Any]) -> None:
    """Pay the RCU grace period that the kernel makes the first cgroup migration after a
    quiet moment wait: a write to cgroup.procs takes the global cgroup_threadgroup_rwsem
    for writing, which waits for one grace period (6 to 14 ms here) unless another writer
    had it within about a grace period. Each rank's init joins its cgroups as it starts;
    primed by the launch server's child once it has forked the keepers, concurrently with
    their own start, those joins find the lock warm, or share the grace period under way,
    instead of each waiting for a whole one. The write moves this process into the cgroup
    it is already in, the control plane's own, which changes nothing; a failure costs
    only the time it saves."""
    folder = next(iter(sandbox["cgroups"].values()))
    with contextlib.suppress(OSError):
        _write(f"{Path(folder).parent.parent}/cgroup.procs", "0")


def _write(path: str, value: str) -> None:
    descriptor = os.open(path, os.O_WRONLY)
    try:
        os.write(descriptor, value.encode())
    finally:
        os.close(descriptor)


def _write_limits(controller: str, leaf: str, limits: dict[str, int]) -> None:
    memory_max = str(limits["memory_max"])
    if controller == "pids":
        _write(f"{leaf}/pids.max", str(limits["pids_max"]))
    elif controller == "memory":
        _write(f"{leaf}/memory.limit_in_bytes", memory_max)
        # No swap beyond the limit where the kernel accounts swap (memsw), so the limit is
        # the memory the rank may hold, not where it sits.
        with contextlib.suppress(FileNotFoundError):
            _write(f"{leaf}/memory.memsw.limit_in_bytes", memory_max)
    elif controller == "unified":
        _write(f"{leaf}/pids.max", str(limits["pids_max"]))
        _write(f"{leaf}/memory.max", memory_max)
        with contextlib.suppress(FileNotFoundError):
            _write(f"{leaf}/memory.swap.max", "0")


def _bind_new_netns(netns: Path) -> None:
    """A new network namespace, bound to the file `netns` so it outlives its processes;
    this process goes back to its own network namespace after."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(netns, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        _check(_LIBC.unshare(_CLONE_NEWNET), "unshare a network namespace")
        try:
            _loopback_up()
            _check(
                _LIBC.mount(b"/proc/self/ns/net", bytes(netns), None, _MS_BIND, None),
                f"bind the network namespace to {netns}",
            )
        finally:
            _check(_LIBC.setns(own, _CLONE_NEWNET), "go back to the host's network namespace")
    finally:
        os.close(own)


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def _is_netns(path: Path) -> bool:
    """True when a network namespace is bound to `path` (its inode is nsfs's)."""
    try:
        return os.stat(path).st_dev != os.stat(path.parent).st_dev
    except FileNotFoundError:
        return False


# -------------------------------------------------------- entering it (fork to exec)


def new_pid_namespace() -> None:
    """In the keeper, just before it starts the rank: its next child is the first process
    (pid 1) of a new PID namespace, the rank's init (see `enter`). The keeper itself stays
    where it is, and starts no other process."""
    _check(_LIBC.unshare(_CLONE_NEWPID), "unshare a PID namespace")


def enter(
    sandbox: dict[str, Any],
    rank: int,
    run_as: dict[str, Any] | None,
    argv: list[str],
    env: dict[str, str],
    made: int | None = None,
) -> NoReturn:
    """In the keeper's child, pid 1 of the rank's PID namespace (`new_pid_namespace`),
    between fork and exec, as root: wait until the gang's sandbox is made (`made`, the
    read end of the pipe that the process making it closes then: see
    `wait_until_made`), join the rank's cgroups and the gang's network namespace, set
    the file size limit, make the rank's mount namespace with its own /proc; then, as
    the job's user and group alone when it has them and with no privileges to gain,
    start the rank's shell (`argv`, with the environment `env`) and wait on it as the
    namespace's init (`_namespace_init`). Never returns.

    The init drops to the job's user itself because posix_spawn(3), which starts the
    shell without copying the init's memory, cannot change the user; the module's
    docstring says why the rank still cannot reach its init."""
    try:
        if made is not None:
            wait_until_made(made)
        join_cgroups(sandbox, rank)
        descriptor = os.open(sandbox["netns"], os.O_RDONLY)
        try:
            _check(
                _LIBC.setns(descriptor, _CLONE_NEWNET), "setns into the gang's network namespace"
            )
        finally:
            os.close(descriptor)
        size = int(sandbox["limits"]["file_size_max"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        _check(_LIBC.unshare(_CLONE_NEWNS), "unshare a mount namespace")
        # Mounts made in here stay in here (as `unshare --propagation private` does).
        _check(_LIBC.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
        # The namespace's own /proc, over the host's. The host's is not unmounted (which
        # costs the kernel a grace period, a millisecond or more per rank): the rank, not
        # root and without privileges to gain, cannot unmount what covers it.
        _check(
            _LIBC.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None),
            "mount the namespace's /proc",
        )
        for signum in RANK_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        if run_as is not None:
            os.setgroups([])
            os.setgid(int(run_as["gid"]))
            os.setuid(int(run_as["uid"]))
        _check(_LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        # The shell inherits its standard streams only (subprocess would have closed the
        # rest after this step, which the init never returns from).
        _close_on_exec_from(3)
        shell = os.posix_spawn(argv[0], argv, env, setsigdef=RANK_SIGNALS)
    except BaseException:
        traceback.print_exc()
        os._exit(EXIT_NOT_STARTED)
    _namespace_init(shell)


def _close_on_exec_from(lowest: int) -> None:
    """Mark every descriptor from `lowest` up close-on-exec: close_range(2) with
    CLOSE_RANGE_CLOEXEC where the kernel has it (5.11), else one by one."""
    if _LIBC.syscall(_SYS_CLOSE_RANGE, lowest, 0xFFFFFFFF, _CLOSE_RANGE_CLOEXEC) == 0:
        return
    for name in os.listdir("/proc/self/fd"):
        descriptor = int(name)
        if descriptor >= lowest:
            with contextlib.suppress(OSError):
                os.set_inheritable(descriptor, False)


def wait_until_made(made: int) -> None:
    """Block until the process making the gang's sandbox (`create`) closes the pipe whose
    read end is `made`: an end of file says the sandbox is made; a byte NOT_MADE, of
    which it writes one for each rank, says it could not be, and this raises, so that
    the rank never starts unconfined."""
    answer = os.read(made, 1)
    os.close(made)
    if answer:
        raise OSError(
            errno.EIO, "the gang's sandbox could not be made (see the gang's launcher.log)"
        )


def join_cgroups(sandbox: dict[str, Any], rank: int) -> None:
    """Move this process into the rank's cgroups (every process it starts after is born
    there); `enter` does it first thing."""
    for folder in sandbox["cgroups"].values():
        # 0 is the writer itself, whatever its pid in the namespace the kernel reads.
        _write(f"{folder}/{rank}/cgroup.procs", "0")


def _namespace_init(shell: int) -> NoReturn:
    """Pid 1 of the rank's namespace: reap every child until the rank's shell ends, then
    end with its status (128 + the signal that ended it, as a shell reports it), and
    the kernel ends whatever is left in the namespace. Its descriptors close first: the
    rank's log pipe and the pipe on which the keeper learns that the shell executed must
    close when the shell's side does."""
    try:
        os.closerange(0, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        while True:
            pid, status = os.wait()
            if pid == shell:
                code = os.waitstatus_to_exitcode(status)
                os._exit(code if code >= 0 else 128 - code)
    finally:
        os._exit(EXIT_NOT_STARTED)


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


# What reading or writing a cgroup's file raises once the cgroup is removed: ENOENT
# when it is gone before the file is opened, ENODEV when it goes while the file is open.
_GONE = (errno.ENOENT, errno.ENODEV)


def _procs(leaf: Path) -> list[int]:
    try:
        return [int(line) for line in (leaf / "cgroup.procs").read_text().split()]
    except OSError as error:
        if error.errno in _GONE:
            return []
        raise


def pids(sandbox: dict[str, Any], rank: int | None = None) -> dict[int, int]:
    """Every live process in the gang's (or one rank's) cgroups: pid -> rank."""
    controller = "pids" if "pids" in sandbox["cgroups"] else "unified"
    found: dict[int, int] = {}
    for leaf in _leaves(sandbox, controller, rank):
        for pid in _procs(leaf):
            found[pid] = int(leaf.name)
    return found


def oom_kills(sandbox: dict[str, Any], rank: int) -> int:
    """How many processes of the rank the OOM killer ended in its cgroup (the kernel's
    count: `oom_kill` in memory.oom_control on v1, memory.events on v2); 0 when the
    kernel does not count them or the cgroup is gone."""
    controller = "memory" if "memory" in sandbox["cgroups"] else "unified"
    name = "memory.oom_control" if controller == "memory" else "memory.events"
    try:
        lines = (Path(sandbox["cgroups"][controller]) / str(rank) / name).read_text()
    except OSError:
        return 0
    for line in lines.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return 0


# The end reason of a rank the kernel's OOM killer ended inside its cgroup
# (preemption.reasons words it, with the rank's memory limit).
OUT_OF_MEMORY = "out-of-memory"


def end_reason(sandbox: dict[str, Any], rank: int, exit_code: int) -> str:
    """Why the rank ended, when its cgroup tells: OUT_OF_MEMORY for a rank that failed
    after the OOM killer ended one of its processes; else ""."""
    if exit_code == 0 or not oom_kills(sandbox, rank):
        return ""
    return OUT_OF_MEMORY


def format_size(size: int) -> str:
    """`64 MiB`, `2 GiB`, `1536 KiB`: the largest binary unit that divides it."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size % factor == 0:
            return f"{size // factor} {unit}"
    return f"{size} bytes"


def kill(sandbox: dict[str, Any], rank: int | None = None) -> None:
    """SIGKILL every process in the gang's (or one rank's) cgroups, with no escape, and
    return without waiting for them to go.

    On v2 where the kernel has cgroup.kill (5.14), one write kills every process below
    the folder written, forks made meanwhile included. Elsewhere one pass of SIGKILL over
    the cgroups' processes is enough, and needs no freezer: every process of a rank is in
    the rank's PID namespace (no process can leave its PID namespace), whose init is in
    the rank's cgroup before the rank's shell exists; once the init is killed, the kernel
    kills whatever is left in its namespace and lets no process fork there any more, so a
    process forked during the pass dies with the rest.

    Nothing here waits: the kernel lets a namespace's init be reaped only once every
    other process of the namespace is gone, so the keeper that records the rank's exit
    records it when the rank's last process has gone. `release` waits, as a cgroup with
    a process in it cannot be removed."""
    cgroups = sandbox["cgroups"]
    if "unified" in cgroups:
        target = Path(cgroups["unified"]) / ("" if rank is None else str(rank))
        try:
            _write(str(target / "cgroup.kill"), "1")
            return
        except OSError as error:
            if error.errno not in _GONE:
                raise
            if not target.is_dir():
                return
            # A kernel before 5.14, which has no cgroup.kill: the pass below.
    for pid in pids(sandbox, rank):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _wait_until_empty(sandbox: dict[str, Any], seconds: float) -> None:
    """Wait, up to `seconds`, until no process is left in the gang's cgroups. Looks at
    once, and is normally done then: `release` runs after every rank has exited."""
    deadline = time.monotonic() + seconds
    pause = 0.0005
    while pids(sandbox) and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def release(sandbox: dict[str, Any]) -> None:
    """Kill what is left in the gang's cgroups, remove its network namespace, then its
    cgroups (last, so that a gang whose cgroups are gone has nothing left at all)."""
    kill(sandbox)
    _wait_until_empty(sandbox, 5.0)
    netns = Path(sandbox["netns"])
    if _is_netns(netns):
        _LIBC.umount2(bytes(netns), _MNT_DETACH)
    netns.unlink(missing_ok=True)
    for controller in sandbox["cgroups"]:
        # A cgroup with a process left in it (one stuck in the kernel) stays; the next
        # release, at forget(), removes it.
        for leaf in _leaves(sandbox, controller, None):
            with contextlib.suppress(OSError):
                leaf.rmdir()
        with contextlib.suppress(OSError):
            Path(sandbox["cgroups"][controller]).rmdir()
