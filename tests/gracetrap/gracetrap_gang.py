"""Launch examples/train_ddp.py as a real gang of OS processes, as the local runtime does.

Each rank runs in its own session (process group) with the runtime's environment, so a
signal to a rank reaches its DataLoader workers too, exactly like a preemption.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_ddp.py"
EVENT_PREFIX = "QM_EVENT "


def load_example() -> ModuleType:
    """Import examples/train_ddp.py as a module, to build the same model in the test."""
    spec = importlib.util.spec_from_file_location("train_ddp", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def port_bindable(port: int) -> bool:
    """True when a plain bind() (no SO_REUSEADDR) to ``port`` succeeds."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.bind(("127.0.0.1", port))
    except OSError:
        return False
    finally:
        probe.close()
    return True


@dataclass
class Rank:
    """One rank's process and its log file."""

    rank: int
    process: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def events(self) -> list[dict[str, Any]]:
        return [
            json.loads(line[len(EVENT_PREFIX) :])
            for line in self.text().splitlines()
            if line.startswith(EVENT_PREFIX)
        ]

    def steps(self) -> list[tuple[int, str]]:
        """(step, loss as float.hex) for every STEP line."""
        found = []
        for line in self.text().splitlines():
            parts = line.split()
            if len(parts) == 8 and parts[0] == "STEP":
                found.append((int(parts[1]), parts[7]))
        return found

    def signal(self, signum: int) -> None:
        os.killpg(self.process.pid, signum)


@dataclass
class Gang:
    """A running gang; ``exited_at`` is when the test saw the last rank exit."""

    ranks: list[Rank]
    master_port: int
    exited_at: float | None = None
    codes: list[int | None] = field(default_factory=list)

    def wait_for_step(self, step: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(any(s >= step for s, _ in rank.steps()) for rank in self.ranks):
                return
            if any(rank.process.poll() is not None for rank in self.ranks):
                raise AssertionError(f"a rank exited early:\n{self.tail()}")
            time.sleep(0.05)
        raise AssertionError(f"no rank reached step {step} in {timeout} s:\n{self.tail()}")

    def wait_for_event(self, name: str, timeout: float, **fields: Any) -> list[dict[str, Any]]:
        """Wait until every rank logged event ``name`` with ``fields``; return one per rank."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [
                next(
                    (
                        event
                        for event in rank.events()
                        if event["event"] == name
                        and all(event.get(key) == value for key, value in fields.items())
                    ),
                    None,
                )
                for rank in self.ranks
            ]
            if all(event is not None for event in found):
                return [event for event in found if event is not None]
            if any(rank.process.poll() is not None for rank in self.ranks):
                raise AssertionError(f"a rank exited early:\n{self.tail()}")
            time.sleep(0.05)
        raise AssertionError(f"no {name} {fields} on every rank in {timeout} s:\n{self.tail()}")

    def wait(self, timeout: float) -> list[int | None]:
        """Reap every rank; on timeout kill the gang and fail (nothing may hang)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(rank.process.poll() is not None for rank in self.ranks):
                self.exited_at = time.monotonic()
                self.codes = [rank.process.returncode for rank in self.ranks]
                return self.codes
            time.sleep(0.005)
        self.kill()
        raise AssertionError(f"gang still running after {timeout} s:\n{self.tail()}")

    def kill(self) -> None:
        # Only groups whose leader is not reaped yet: once reaped, its pid (and so the
        # group id) may belong to someone else's process on a busy machine.
        for rank in self.ranks:
            if rank.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(rank.process.pid, signal.SIGKILL)
        for rank in self.ranks:
            rank.process.wait()

    def tail(self, lines: int = 15) -> str:
        return "\n".join(
            f"--- rank {rank.rank} ---\n" + "\n".join(rank.text().splitlines()[-lines:])
            for rank in self.ranks
        )


def launch(
    world_size: int,
    checkpoint_dir: Path,
    logs: Path,
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    attempt: int = 1,
    script: Path = EXAMPLE,
) -> Gang:
    """Start ``world_size`` ranks of the example with the runtime's environment."""
    port = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    ranks = []
    for rank in range(world_size):
        rank_env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "QM_JOB_ID": "42",
            "QM_ATTEMPT": str(attempt),
            "QM_CHECKPOINT_DIR": str(checkpoint_dir),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        if world_size == 1:
            rank_env.pop("WORLD_SIZE")
        log = logs / f"attempt{attempt}-rank{rank}.log"
        with open(log, "wb") as output:
            process = subprocess.Popen(
                [sys.executable, str(script), *args],
                stdout=output,
                stderr=subprocess.STDOUT,
                env=rank_env,
                start_new_session=True,
            )
        ranks.append(Rank(rank, process, log))
    return Gang(ranks, port)


def step_dirs(checkpoint_dir: Path) -> dict[int, bool]:
    """step -> complete, for every step_N folder (step_N.attempt_E of an attempt)."""
    found = {}
    for path in checkpoint_dir.glob("step_*"):
        found[int(path.name.split("_")[1].split(".")[0])] = (path / ".metadata").is_file()
    return found


class LineServer:
    """A fork server (a script that forks one child per line it reads) with its
    output read line by line on a thread, so a test can wait for a given line."""

    def __init__(self, args: list[str], *, cwd: Path, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": "1", **env},
            text=True,
            cwd=cwd,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.strip():
                self.lines.put(line.rstrip("\n"))

    def send(self, line: str) -> int:
        """Ask for one child; returns its pid from the ``CHILD <pid>`` answer."""
        assert self.process.stdin is not None
        self.process.stdin.write(f"{line}\n")
        self.process.stdin.flush()
        return int(self.expect("CHILD ", timeout=60)[0].split()[1])

    def expect(self, prefix: str, timeout: float) -> tuple[str, list[str]]:
        """Wait for the line starting with ``prefix``; return it and the lines before it."""
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} line in {timeout} s: {seen[-20:]}") from None
            if line.startswith(prefix):
                return line, seen
            seen.append(line)

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
