"""The client of this process's launcher (launcher.py, ``--serve``), which forks keepers.

The launcher is started once per process and interpreter path, as
``python -m preemption.runtimes.launcher`` in the project's folder, and kept: each
launch sends it one line and reads back the ranks it forked a keeper for. This
module only talks to that process; it writes no record.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import threading
from pathlib import Path

from preemption.runtimes.launcher import inherited_environment

# The folder that holds the `preemption` package: the launcher is started there so that
# `python -m preemption.runtimes.launcher` imports this very code. Ranks run in their
# own folders, never here.
PROJECT_ROOT = Path(__file__).resolve().parents[3]

# How long launch() waits for the launcher to fork its keepers.
LAUNCHER_TIMEOUT_SECONDS = 60.0


class LaunchServer:
    """This process's launcher, started once and kept (launcher.py, `--serve`): it
    forks the keepers of each gang it is sent. Launches from several threads take turns;
    each costs a fork there. A launcher that died is started again at the next launch."""

    def __init__(self, python: str) -> None:
        self.python = python
        self.lock = threading.Lock()
        self.process: subprocess.Popen[bytes] | None = None

    def _running(self) -> subprocess.Popen[bytes]:
        if self.process is not None and self.process.poll() is None:
            return self.process
        self.stop()
        self.process = subprocess.Popen(
            [self.python, "-m", "preemption.runtimes.launcher", "--serve"],
            cwd=PROJECT_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        return self.process

    def stop(self) -> None:
        """Close the launcher's input, so that it exits; its keepers live on."""
        process, self.process = self.process, None
        if process is None:
            return
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def start_keepers(self, gang_dir: Path, ranks: list[int]) -> set[int]:
        """Have the launcher fork a keeper for each of ``ranks``; the ranks it forked.

        Raises OSError when the launcher cannot be started or stops answering."""
        request = json.dumps(
            {
                "gang_dir": str(gang_dir),
                "ranks": ranks,
                "environ": inherited_environment(os.environ),
            }
        ).encode()
        request += b"\n"
        with self.lock:
            for fresh in (False, True):
                process = self._running()
                assert process.stdin is not None and process.stdout is not None
                try:
                    process.stdin.write(request)
                    process.stdin.flush()
                except BrokenPipeError:
                    # It died since its last launch and never saw this one: start
                    # another, once.
                    self.stop()
                    if fresh:
                        raise
                    continue
                ready, _, _ = select.select([process.stdout], [], [], LAUNCHER_TIMEOUT_SECONDS)
                reply = process.stdout.readline() if ready else b""
                if not reply.endswith(b"\n"):
                    # Silent or gone mid-launch: whatever it forked has its own records.
                    self.stop()
                    return set()
                return {int(value) for value in reply.split()}
        return set()


# Per interpreter path: this process's launcher (a forked child starts its own).
_LAUNCH_SERVERS: dict[tuple[int, str], LaunchServer] = {}


def launch_server(python: str) -> LaunchServer:
    key = (os.getpid(), python)
    server = _LAUNCH_SERVERS.get(key)
    if server is None:
        server = _LAUNCH_SERVERS.setdefault(key, LaunchServer(python))
    return server
