"""Start ranks of a gang and wait on each, recording how it ends.

Run as `python -m preemption.runtimes.launcher <gang_dir> <rank> [<rank> ...]`, the
launcher forks one keeper per rank, prints the rank numbers it forked and exits. Each
keeper starts its own session, so a dying Celery worker, or a signal to the worker's
process group, never reaches it. The keeper starts the rank in a new session (the rank's
pid is its process group id), waits on it and records its pid, start time and exit code
in the rank's folder (see records.py).

LocalRuntime.launch runs it as `python -m preemption.runtimes.launcher --serve` instead:
one launcher per control-plane process, started at its first launch, that reads one gang
per line on its standard input (a JSON object: the gang's folder, the ranks, and the part
of the caller's environment a rank inherits, as the caller has it now) and answers each
with the ranks it forked. Each request is served by a child forked from the server
(which then forks the keepers and exits, as the one-shot launcher does), so a launch
costs a fork instead of an interpreter's start-up and imports, which on a busy machine
took a tenth of a second or more each. The server is single-threaded, so forking it is
safe where forking the multi-threaded worker would not be; it exits when its standard
input closes, that is when the process that started it is gone. Keepers never keep the
server's pipes open.

The keeper runs as the control plane's user (root when ranks run as the runner user), so
it can write the records and signal the rank. Only the rank drops privileges: it starts
in its private work folder as the runner user with the job's group as its only group,
umask 077 and no way to gain privileges back through setuid programs (gang.json's
`run_as`; see local.py for why).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pwd
import signal
import stat
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from preemption.runtimes import processes
from preemption.runtimes import sandbox as sandboxes
from preemption.runtimes.capped_log import CappedLog, LogCap, copy_until_exit, open_output_pipe
from preemption.runtimes.records import (
    EXIT_FILE,
    EXITS_FIFO,
    GANG_FILE,
    KEEPER_FILE,
    KILL_FILE,
    LAUNCHER_LOG,
    RANK_DIR_ENV,
    RANK_LOG,
    SIGNAL_FILE,
    STARTED_FILE,
    TERM_SENT_FILE,
    WORK_FOLDER,
    create_claim,
    read_record,
    write_record,
)

# `sh -c` runs a compound command as a child of the shell, and dash does not handle
# SIGTERM itself: the shell would die of it at once and record 143 while the workload
# was still checkpointing. With this trap the shell waits for its foreground command,
# then for the commands it started in the background (they got the signal too, as the
# whole group does), then exits with the foreground command's status, so a workload
# that stops cleanly records 0 and later commands of the same line do not run. The
# shell's exit ends the rank, and the kernel kills what is left in its PID namespace:
# without the second wait a background command still in its SIGTERM handler died
# mid-way whenever the foreground one ended first. Caught signals are reset on exec, so
# the workload still gets the default SIGTERM behaviour unless it installs a handler.
# The checkpoint notice (SIGUSR2, sent to the whole process group) would end the shell
# too; caught with a no-op, it leaves the shell waiting, and its children still start
# with the default action, which the trap replaces with its own handler.
SHELL_PREFIX = "trap 'qm_status=$?; wait; exit $qm_status' TERM\ntrap : USR2\n"

# Exit code recorded when the command could not even be started (as the shell does).
EXIT_NOT_STARTED = 127


# What a rank inherits from the control plane's own environment. The worker's environment
# holds the database URL, the broker URL and the secret key, which no workload may see, so
# only these names and prefixes pass: the search path, the locale and the host's tuning of
# the GPU and collective libraries. Everything else a job needs comes from its spec, and
# HOME, TMPDIR, USER and LOGNAME describe the rank's own folder and user, not the control
# plane's (PYTHONPATH and VIRTUAL_ENV would point it into the control plane's code).
INHERITED_NAMES = frozenset({"PATH", "TERM", "TZ", "LANG", "LANGUAGE", "LD_LIBRARY_PATH"})
# Never CUDA_* or NVIDIA_*: the control plane's own (CUDA_VISIBLE_DEVICES above all)
# would hand a rank the GPUs of the whole machine; the runtime sets a rank's own.
INHERITED_PREFIXES = ("LC_", "NCCL_", "GLOO_", "TORCH_")

# Files and folders a rank creates are its own alone unless it says otherwise.
RANK_UMASK = 0o077

# Descriptors a keeper closes as it starts: the pipe on which the server's child reports
# the keepers it forked (see _serve_one).
_KEEPER_CLOSES: list[int] = []
# The read end of the pipe on which the keepers' forker says the gang's sandbox is made
# (fork_keepers); a keeper's rank waits on it before it enters the sandbox.
_SANDBOX_MADE: list[int] = []

# prctl(2): once set, execve never grants privileges (setuid bits, file capabilities).
PR_SET_NO_NEW_PRIVS = 38


def inherited_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of the control plane's environment a rank may see."""
    return {
        name: value
        for name, value in environ.items()
        if name in INHERITED_NAMES or name.startswith(INHERITED_PREFIXES)
    }


def rank_environment(
    gang: dict[str, Any], rank: int, rank_dir: Path, work_dir: Path
) -> dict[str, str]:
    """The environment of one rank: inherited basics, its own folder and user, the spec's,
    then the rendezvous and the GPUs the runtime gave it (gpu_slots.py).

    CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES name the rank's GPUs on its node,
    comma-separated; a rank of a gang recorded without them (before GPUs were assigned)
    gets them empty, which shows it no GPU rather than every GPU of the host."""
    placement = gang["ranks"][rank]
    gpu_indices = gang.get("gpu_indices")
    # Joined here rather than by gpu_slots, which the launcher does not load (it starts
    # an interpreter per launch and keeps its imports few).
    devices = "" if not gpu_indices else ",".join(str(index) for index in gpu_indices[rank])
    run_as = gang.get("run_as")
    user = run_as["user"] if run_as else pwd.getpwuid(os.geteuid()).pw_name
    env = inherited_environment(os.environ)
    # Put the launcher's interpreter first on PATH, so a command saying `python` gets
    # the same environment (and packages) as the control plane.
    python_bin = os.path.dirname(sys.executable)
    env["PATH"] = python_bin + os.pathsep + env.get("PATH", os.defpath)
    env["OMP_NUM_THREADS"] = "1"
    env.update({"HOME": str(work_dir), "TMPDIR": str(work_dir), "USER": user, "LOGNAME": user})
    env.update(gang["env"])
    # The runtime owns the rendezvous variables: the spec cannot override them.
    env.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(len(gang["ranks"])),
            "LOCAL_RANK": str(placement["local_rank"]),
            "MASTER_ADDR": str(gang["master_addr"]),
            "MASTER_PORT": str(gang["master_port"]),
            "QM_NODE": str(placement["node"]),
            RANK_DIR_ENV: str(rank_dir),
            "PYTHONUNBUFFERED": "1",
            "CUDA_VISIBLE_DEVICES": devices,
            "NVIDIA_VISIBLE_DEVICES": devices,
        }
    )
    return env


def work_folder(rank_dir: Path, run_as: dict[str, Any] | None) -> Path:
    """Create the rank's private folder, owned by the user and group it runs as."""
    work_dir = rank_dir / WORK_FOLDER
    work_dir.mkdir(mode=0o700, exist_ok=True)
    if run_as is not None:
        fd = os.open(work_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchown(fd, int(run_as["uid"]), int(run_as["gid"]))
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
    return work_dir


def _no_new_privileges() -> None:
    """In the rank's child before exec: no setuid or file-capability program it runs may
    raise its privileges again. The keeper is single-threaded, so this is safe to run
    between fork and exec."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")


def rank_command(script: str) -> list[str]:
    """What the keeper runs: the rank's shell script (in the gang's sandbox, if it has
    one, which rank_identity's preexec step enters)."""
    return ["/bin/sh", "-c", script]


def rank_identity(
    run_as: dict[str, Any] | None,
    sandbox: dict[str, Any] | None = None,
    rank: int = 0,
    argv: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Popen's arguments that start the rank as the job's user, in the job's group only.
    In a sandbox, the keeper's next child is made the init of a new PID namespace, which
    joins the rank's cgroups and the gang's network namespace and makes the rank's mount
    namespace as root, then drops to the job's user and starts the rank (`argv` with the
    environment `env`) itself (sandbox.enter): the child Popen starts never returns to
    execute what Popen was given."""
    if sandbox is not None:
        sandboxes.new_pid_namespace()

        def enter_sandbox() -> None:
            sandboxes.enter(
                sandbox,
                rank,
                run_as,
                argv or [],
                env or {},
                made=_SANDBOX_MADE[0] if _SANDBOX_MADE else None,
            )

        return {"preexec_fn": enter_sandbox}
    if run_as is None:
        return {}
    return {
        "user": int(run_as["uid"]),
        "group": int(run_as["gid"]),
        "extra_groups": [],
        "preexec_fn": _no_new_privileges,
    }


def _record_exit(
    rank_dir: Path,
    exit_code: int,
    *,
    started: bool,
    reason: str = "",
    memory_limit: int | None = None,
) -> None:
    """The rank's exit record; `reason` says why it ended when the runtime can tell
    (sandbox.end_reason: sandbox.OUT_OF_MEMORY, with the `memory_limit` it was past)."""
    write_record(
        rank_dir / EXIT_FILE,
        {
            "exit_code": exit_code,
            "exited_at": time.time(),
            "signal": exit_code - 128 if exit_code > 128 else None,
            "started": started,
            "reason": reason,
            "memory_limit": memory_limit,
        },
        durable=True,
    )


def _stop_requested(rank_dir: Path) -> int | None:
    """The signal the control plane already asked this rank to get, if any."""
    if (rank_dir / KILL_FILE).exists():
        return int(signal.SIGKILL)
    if (rank_dir / SIGNAL_FILE).exists():
        return int(signal.SIGTERM)
    return None


def keep_rank(gang_dir: Path, gang: dict[str, Any], rank: int) -> None:
    """Start one rank, wait on it, and record its start and its exit code."""
    rank_dir = gang_dir / str(rank)
    pid = os.getpid()
    write_record(
        rank_dir / KEEPER_FILE,
        {"pid": pid, "created_at": processes.created_at(pid), "at": time.time()},
    )
    # A gang stopped before this rank started loses nothing by never starting it.
    requested = _stop_requested(rank_dir)
    if requested is not None:
        _record_exit(rank_dir, 128 + requested, started=False)
        return
    run_as = gang.get("run_as")
    work_dir = work_folder(rank_dir, run_as)
    env = rank_environment(gang, rank, rank_dir, work_dir)
    # The rank writes into a pipe and the keeper alone into the log, which keeps the
    # log's head and tail only (capped_log.py says why a pipe).
    log = CappedLog(rank_dir / RANK_LOG, LogCap.from_record(gang.get("log_cap")))
    output, rank_output = open_output_pipe()
    started_at = time.time()
    try:
        argv = rank_command(SHELL_PREFIX + gang["command"])
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=rank_output,
            stderr=subprocess.STDOUT,
            cwd=work_dir,
            env=env,
            start_new_session=True,
            umask=RANK_UMASK,
            **rank_identity(run_as, gang.get("sandbox"), rank, argv, env),
        )
    except (OSError, subprocess.SubprocessError) as error:
        # SubprocessError: the sandbox could not be entered (`enter` raised in the child).
        os.close(output)
        os.close(rank_output)
        log.write(f"quartermaster: could not start rank {rank}: {error}\n".encode())
        log.close()
        _record_exit(rank_dir, EXIT_NOT_STARTED, started=False)
        return
    os.close(rank_output)
    write_record(
        rank_dir / STARTED_FILE,
        {
            "pid": process.pid,
            "pgid": process.pid,
            "created_at": processes.created_at(process.pid),
            "started_at": started_at,
        },
    )
    # signal() or kill() may have run between the check above and the started record,
    # when they could not yet know the process group; deliver what they asked for.
    requested = _stop_requested(rank_dir)
    if requested == signal.SIGKILL or (
        requested == signal.SIGTERM and create_claim(rank_dir / TERM_SENT_FILE)
    ):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, requested)
    try:
        returncode = copy_until_exit(output, log, process)
    finally:
        # Cut to its cap before the exit is recorded: whoever reads the log after the
        # exit reads its final form.
        log.close()
    exit_code = returncode if returncode >= 0 else 128 - returncode
    sandbox = gang.get("sandbox")
    reason, memory_limit = "", None
    if sandbox is not None:
        reason = sandboxes.end_reason(sandbox, rank, exit_code)
        memory_limit = int(sandbox["limits"]["memory_max"]) if reason else None
    _record_exit(rank_dir, exit_code, started=True, reason=reason, memory_limit=memory_limit)


def _announce_exit(fifo: Path, job_id: int) -> None:
    """Tell whoever listens on the runtime's exits pipe that a rank of `job_id` has
    exited (one line, the job's id), so the control plane looks at that job at once
    instead of at its next periodic pass. Never waits: with no listener (ENXIO), no
    pipe, or a full one, the periodic pass finds the exit."""
    try:
        descriptor = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        if stat.S_ISFIFO(os.fstat(descriptor).st_mode):
            os.write(descriptor, f"{job_id}\n".encode())
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _ignore(signum: int, frame: FrameType | None) -> None:
    """Catch and drop a signal; unlike SIG_IGN, a caught signal is not inherited on exec."""


def _child(work: Callable[[], None]) -> NoReturn:
    """Run ``work`` in a forked child with its standard input and output on /dev/null,
    then end the child: status 0, or 70 with the traceback on its standard error."""
    status = 0
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.close(devnull)
        work()
    except BaseException:
        traceback.print_exc()
        status = 70
    finally:
        sys.stderr.flush()
        os._exit(status)


def _end_sandbox(gang_dir: Path, gang: dict[str, Any], rank: int) -> None:
    """Once a rank has exited, nothing it started may live on: kill what is left in its
    cgroup; the last rank of the gang to exit removes the gang's sandbox."""
    sandbox = gang.get("sandbox")
    if sandbox is None:
        return
    sandboxes.kill(sandbox, rank)
    if all((gang_dir / str(other) / EXIT_FILE).exists() for other in range(len(gang["ranks"]))):
        sandboxes.release(sandbox)


def _become_keeper(gang_dir: Path, gang: dict[str, Any], rank: int) -> NoReturn:
    """Run in the forked child: detach, then keep the rank."""

    def keep() -> None:
        for descriptor in _KEEPER_CLOSES:
            os.close(descriptor)
        os.setsid()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, _ignore)
        keep_rank(gang_dir, gang, rank)
        _end_sandbox(gang_dir, gang, rank)
        _announce_exit(gang_dir.parent.parent / EXITS_FIFO, int(gang_dir.parent.name))

    _child(keep)


def fork_keepers(gang_dir: Path, ranks: list[int], report: Callable[[int], None]) -> None:
    """Fork a keeper for each of ``ranks`` of the gang in ``gang_dir`` and ``report``
    each rank forked."""
    gang = read_record(gang_dir / GANG_FILE)
    if gang is None:
        print(f"no {GANG_FILE} in {gang_dir}", file=sys.stderr)
        return
    sandbox = gang.get("sandbox")
    if sandbox is not None:
        # The keepers start while this process makes the ranks' cgroups and the gang's
        # network namespace, which took a millisecond or more a gang before any keeper
        # started; each rank enters the sandbox only once this pipe says it is made.
        made, making = os.pipe()
        _SANDBOX_MADE.append(made)
        _KEEPER_CLOSES.append(making)
    for rank in ranks:
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            _become_keeper(gang_dir, gang, rank)
        report(rank)
    if sandbox is not None:
        os.close(made)
        try:
            sandboxes.create(sandbox, ranks)
        except BaseException:
            # One refusal for each rank that waits: none runs unconfined.
            os.write(making, sandboxes.NOT_MADE * len(ranks))
            raise
        finally:
            os.close(making)
        # While the keepers start (sandbox.prime_migrations says why).
        sandboxes.prime_migrations(sandbox)


def _serve_one(request: bytes) -> bytes:
    """One request of ``serve``: fork a child that forks the keepers and exits, so the
    keepers belong to init, not to the server; the ranks it forked, as a reply line."""
    fields = json.loads(request)
    gang_dir = Path(fields["gang_dir"])
    ranks = [int(value) for value in fields["ranks"]]
    environ = {str(name): str(value) for name, value in fields["environ"].items()}
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:

        def fork_for_server() -> None:
            os.close(read_end)
            # The gang's own log for anything the keepers print.
            log = os.open(gang_dir / LAUNCHER_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(log, 2)
            os.close(log)
            # What the ranks inherit is the caller's, not the server's (rank_environment).
            os.environ.clear()
            os.environ.update(inherited_environment(environ))
            # Each keeper drops the pipe to the server first thing (see _become_keeper).
            _KEEPER_CLOSES.append(write_end)
            fork_keepers(gang_dir, ranks, lambda rank: os.write(write_end, f"{rank} ".encode()))

        # The server's pipes on /dev/null, so that no keeper holds them open.
        _child(fork_for_server)
    os.close(write_end)
    forked = b""
    with open(read_end, "rb") as answers:
        forked = answers.read()
    os.waitpid(child, 0)
    return forked.strip() + b"\n"


def serve() -> int:
    """Serve launches on standard input until it closes (see the module docstring)."""
    requests = sys.stdin.buffer
    replies = sys.stdout.buffer
    while request := requests.readline():
        try:
            reply = _serve_one(request)
        except (OSError, ValueError) as error:
            print(f"launch {request!r} failed: {error}", file=sys.stderr, flush=True)
            reply = b"\n"
        replies.write(reply)
        replies.flush()
    return 0


def main(argv: list[str]) -> int:
    """Fork a keeper for each rank named on the command line and print each rank forked;
    or, with --serve, serve launches until standard input closes."""
    if argv == ["--serve"]:
        return serve()
    if len(argv) < 2:
        print(
            "usage: python -m preemption.runtimes.launcher GANG_DIR RANK [RANK ...]\n"
            "       python -m preemption.runtimes.launcher --serve",
            file=sys.stderr,
        )
        return 2
    gang_dir = Path(argv[0])
    if read_record(gang_dir / GANG_FILE) is None:
        print(f"no {GANG_FILE} in {gang_dir}", file=sys.stderr)
        return 2
    fork_keepers(gang_dir, [int(value) for value in argv[1:]], lambda rank: print(rank, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
