"""The trap: catch the preemption signal, agree on a step, checkpoint, exit cleanly."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, NoReturn, TextIO

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from gracetrap import checkpoints
from gracetrap.events import POST_TIMEOUT_SECONDS, EventReporter
from gracetrap.ports import release_rendezvous_port
from gracetrap.state import Stateful, adapt_state, capture_rng_state, restore_rng_state

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

_STEP_KEY = "gracetrap_step"
_WORLD_SIZE_KEY = "gracetrap_world_size"
_STATE_KEY = "state"


def _rng_key(rank: int) -> str:
    # Each rank draws different random numbers, so each keeps its own generator state.
    return f"gracetrap_rng_rank{rank}"


def _env(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def _env_float(name: str) -> float | None:
    value = _env(name)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number of seconds") from None


def _env_int(name: str) -> int | None:
    value = _env(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _job_id_from_env() -> int | str | None:
    value = _env("QM_JOB_ID")
    if value is None:
        return None
    return int(value) if value.isdigit() else value


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    # DCP warns on every single-process save or load; for the trap that is a normal case.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@contextlib.contextmanager
def _crc32(enabled: bool) -> Iterator[None]:
    # torch.save computes a CRC32 of every record by default. On a loaded machine that
    # one-core checksum, not the disk, bounds the save (about 115 MB/s against 800 MB/s
    # without it), and the grace window is what matters here. Completeness is decided
    # by the metadata file written after fsync, not by checksums.
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(enabled)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


def _prune_after(previous: threading.Thread | None, root: Path, keep: int) -> None:
    # Runs in the pruning thread: wait for the previous pruning, then prune.
    if previous is not None:
        previous.join()
    checkpoints.prune(root, keep)


def worker_init_fn(worker_id: int) -> None:
    """Pass as ``DataLoader(worker_init_fn=...)``: workers ignore the preemption signals.

    The runtime signals a rank's whole process group, DataLoader workers included.
    A worker that died of SIGTERM would make the DataLoader raise in the middle of
    the step the ranks are about to agree on, so workers leave the signal to the
    training process.
    """
    del worker_id
    for signum in DEFAULT_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


class Trap:
    """Graceful preemption for one training process (one rank).

    Arguments left as None are read from the ``QM_*`` environment the runtime sets:
    ``QM_CHECKPOINT_DIR``, ``QM_GRACE_SECONDS``, ``QM_EVENTS_URL``, ``QM_EVENTS_TOKEN``,
    ``QM_JOB_ID`` and ``QM_ATTEMPT``. ``state`` maps names to the objects to checkpoint:
    models, optimizers and anything with ``state_dict()``/``load_state_dict()``. RNG
    states and the step are always included.

    Typical loop::

        trap = Trap(state={"model": model, "optimizer": optimizer})
        for step in range(trap.resume(), total_steps):
            train_one_step(step)
            if trap.should_stop(step):
                trap.save_and_exit(step)
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        state: Mapping[str, object] | None = None,
        grace_seconds: float | None = None,
        events_url: str | None = None,
        exit_code: int = 0,
        *,
        signals: Iterable[int] = DEFAULT_SIGNALS,
        keep: int = 3,
        events_token: str | None = None,
        job_id: int | str | None = None,
        attempt: int | None = None,
        barrier_timeout: float = 60.0,
        expected_save_seconds: float | None = None,
        port_release_timeout: float = 5.0,
        save_threads: int = 1,
        checksums: bool = False,
        stream: TextIO | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1: the newest checkpoint is never deleted")
        directory = checkpoint_dir if checkpoint_dir is not None else _env("QM_CHECKPOINT_DIR")
        self.checkpoint_dir: Path | None = Path(directory) if directory is not None else None
        self.grace_seconds = (
            grace_seconds if grace_seconds is not None else _env_float("QM_GRACE_SECONDS")
        )
        self.exit_code = exit_code
        self.keep = keep
        self.barrier_timeout = barrier_timeout
        self.expected_save_seconds = expected_save_seconds
        self.port_release_timeout = port_release_timeout
        self.save_threads = save_threads
        self.checksums = checksums
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.events = EventReporter(
            job_id=job_id if job_id is not None else _job_id_from_env(),
            attempt=attempt if attempt is not None else _env_int("QM_ATTEMPT"),
            rank=self.rank,
            events_url=events_url if events_url is not None else _env("QM_EVENTS_URL"),
            events_token=events_token if events_token is not None else _env("QM_EVENTS_TOKEN"),
            stream=stream,
        )
        self._state: dict[str, Stateful] = adapt_state(state or {})
        self._pid = os.getpid()
        self._signal_at: float | None = None
        self._signal_reported = False
        self._stop_agreed_at: float | None = None
        self._save_seconds: list[float] = []
        self._collective: torch.Tensor | None = None
        self._previous_handlers: dict[signal.Signals, Any] = {}
        self._closed = False
        self._pruner: threading.Thread | None = None
        for signum in self.signals:
            self._previous_handlers[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)

    # ----------------------------------------------------------------- signals

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only set the flag: anything else (printing, I/O, collectives) could run in
        # the middle of the very operation it interrupted.
        del frame
        if os.getpid() != self._pid:
            # A forked DataLoader worker inherited this handler: its parent handles it.
            return
        del signum
        if self._signal_at is None:
            self._signal_at = time.time()

    @property
    def signalled(self) -> bool:
        """True once this process received one of the trap's signals."""
        return self._signal_at is not None

    def _report_signal(self) -> None:
        if self._signal_at is not None and not self._signal_reported:
            self._signal_reported = True
            self.events.emit("signal_received", at=self._signal_at)

    def restore_signal_handlers(self) -> None:
        """Put back the handlers that were installed before this trap."""
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    # ----------------------------------------------------------- collectives

    def rank(self) -> int:
        """This process's global rank (from the process group, else ``RANK``, else 0)."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        return _env_int("RANK") or 0

    def world_size(self) -> int:
        """Number of ranks in the default process group (1 without one)."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return 1

    @staticmethod
    def _initialised() -> bool:
        return dist.is_available() and dist.is_initialized()

    @staticmethod
    def _distributed() -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _reduce_max(self, values: list[float]) -> list[float]:
        """Element-wise maximum of ``values`` over every rank (identity without a group)."""
        if not self._distributed():
            return values
        if self._collective is None or self._collective.numel() != len(values):
            device = torch.device("cpu")
            backend = str(dist.get_backend())
            if "gloo" not in backend and torch.cuda.is_available():
                # NCCL reduces CUDA tensors only.
                device = torch.device("cuda", torch.cuda.current_device())
            self._collective = torch.empty(len(values), dtype=torch.float64, device=device)
        buffer = self._collective
        buffer.copy_(torch.tensor(values, dtype=torch.float64))
        dist.all_reduce(buffer, op=dist.ReduceOp.MAX)
        return [float(v) for v in buffer.tolist()]

    # ---------------------------------------------------------------- stopping

    def should_stop(self, step: int) -> bool:
        """Call after every step on every rank: True on all ranks once any rank was signalled.

        Ranks agree through an all-reduce (MAX) of the flag, so they all stop after
        the same ``step`` even when the signal reached only one of them.
        """
        del step
        self._report_signal()
        if not self._distributed():
            stop = self._signal_at is not None
            if stop:
                self._stop_agreed_at = self._signal_at
            return stop
        # Negated time: the maximum of -t is the earliest signal of any rank, which
        # starts the grace window for all of them.
        signal_at = -self._signal_at if self._signal_at is not None else -math.inf
        flag, earliest = self._reduce_max([1.0 if self._signal_at is not None else 0.0, signal_at])
        if flag > 0:
            self._stop_agreed_at = -earliest
            return True
        return False

    def expected_save_time(self) -> float:
        """Seconds a save is expected to take, from the latest saves of this job."""
        if self._save_seconds:
            return max(self._save_seconds[-3:])
        if self.checkpoint_dir is not None:
            pointer = checkpoints.read_pointer(self.checkpoint_dir)
            if pointer is not None and isinstance(pointer.get("seconds"), int | float):
                return float(pointer["seconds"])
        return self.expected_save_seconds or 0.0

    def grace_left(self) -> float | None:
        """Seconds left in the grace window, or None without a signal or a known window."""
        started = self._stop_agreed_at if self._stop_agreed_at is not None else self._signal_at
        if self.grace_seconds is None or started is None:
            return None
        return self.grace_seconds - (time.time() - started)

    def _skip_reason(self) -> str | None:
        """Why the final save must be skipped (the same answer on every rank), or None."""
        if self.checkpoint_dir is None:
            return "no checkpoint directory is configured"
        left = self.grace_left()
        expected = self.expected_save_time()
        too_late = left is not None and left < expected
        verdict, expected, negative_left = self._reduce_max(
            [1.0 if too_late else 0.0, expected, -left if left is not None else -math.inf]
        )
        if verdict == 0:
            return None
        return (
            f"{-negative_left:.3f} s left of the {self.grace_seconds:g} s grace window, "
            f"a save takes about {expected:.3f} s"
        )

    # ------------------------------------------------------------ checkpoints

    def _dcp_state(self, step: int) -> dict[str, Any]:
        return {
            _STATE_KEY: {name: entry.state_dict() for name, entry in self._state.items()},
            _STEP_KEY: step,
            _WORLD_SIZE_KEY: self.world_size(),
            _rng_key(self.rank()): capture_rng_state(),
        }

    def save(self, step: int) -> checkpoints.CheckpointInfo | None:
        """Checkpoint the state after ``step`` completed; every rank must call it.

        Returns the committed checkpoint, or None when ``step`` was already
        checkpointed (the existing checkpoint is kept as it is).
        """
        if self.checkpoint_dir is None:
            raise ValueError(
                "no checkpoint directory: pass checkpoint_dir or set QM_CHECKPOINT_DIR"
            )
        self._report_signal()
        root = self.checkpoint_dir
        path = checkpoints.step_dir(root, step)
        leader = self.rank() == 0
        already = 0.0
        if leader:
            root.mkdir(parents=True, exist_ok=True)
            newest = checkpoints.complete_checkpoints(root)
            if not newest or step <= newest[0].step:
                # Pruning drops incomplete folders older than the newest complete one,
                # which this save's folder would be until it commits: let it finish.
                # A save of a newer step is never touched by it, so the deletion of
                # old checkpoints (slow on big files, above all where the file system
                # discards freed blocks at once) runs on beside the save.
                self._wait_for_pruning()
            if checkpoints.is_complete(path):
                already = 1.0
            elif path.exists():
                # The remnant of a save that was killed: start that step afresh.
                checkpoints.discard(path)
        # This reduction doubles as the barrier after rank 0 prepared the folder.
        (already,) = self._reduce_max([already])
        if already:
            self.events.emit(
                "checkpoint_skipped", step=step, reason=f"step {step} is already checkpointed"
            )
            return None
        self.events.emit("checkpoint_started", step=step)
        started = time.monotonic()
        writer = FileSystemWriter(path, sync_files=True, thread_count=self.save_threads)
        with _single_process_quietly(), _crc32(self.checksums):
            dcp_save(self._dcp_state(step), storage_writer=writer, no_dist=not self._initialised())
        nbytes = 0.0
        if leader:
            checkpoints.fsync_dir(path)
            checkpoints.fsync_dir(root)
            nbytes = float(checkpoints.folder_bytes(path))
        seconds, nbytes = self._reduce_max([time.monotonic() - started, nbytes])
        if leader:
            checkpoints.write_pointer(
                root, step=step, seconds=seconds, nbytes=int(nbytes), world_size=self.world_size()
            )
        self._save_seconds.append(seconds)
        self.events.emit(
            "checkpoint_committed", step=step, bytes=int(nbytes), seconds=round(seconds, 6)
        )
        if leader:
            # Deleting old checkpoints is slow on big files and never needed for safety,
            # so it runs beside training instead of inside the save (or the grace window).
            # A kill in the middle leaves only renamed remnants that the next prune removes.
            # One deletion at a time: the new one starts once the previous one ended.
            self._pruner = threading.Thread(
                target=_prune_after,
                args=(self._pruner, root, self.keep),
                name="gracetrap-prune",
            )
            self._pruner.daemon = True
            self._pruner.start()
        return checkpoints.CheckpointInfo(step, path, True)

    def _wait_for_pruning(self) -> None:
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None

    def resume(self) -> int:
        """Load the newest complete checkpoint; return the first step not yet done (0 if none).

        A checkpoint that fails to load is passed over for the next older one.
        """
        if self.checkpoint_dir is None:
            return 0
        candidates = checkpoints.complete_checkpoints(self.checkpoint_dir)
        # Every rank must load the same checkpoint: follow rank 0's listing.
        steps = [info.step for info in candidates] if self.rank() == 0 else []
        (count,) = self._reduce_max([float(len(steps))])
        chosen: list[int] = []
        for index in range(int(count)):
            (step,) = self._reduce_max([float(steps[index]) if steps else -1.0])
            chosen.append(int(step))
        for step in chosen:
            path = checkpoints.step_dir(self.checkpoint_dir, step)
            try:
                self._load(path, step)
            except (Exception, CheckpointException) as error:
                # DCP raises on every rank alike, so all ranks fall back together.
                print(
                    f"gracetrap: checkpoint {path} could not be loaded ({error}); "
                    "trying the previous one",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            self.events.emit("resumed", step=step + 1)
            return step + 1
        return 0

    def _load(self, path: Path, step: int) -> None:
        reader = FileSystemReader(path)
        saved_keys = set(reader.read_metadata().state_dict_metadata)
        rng_key = _rng_key(self.rank())
        # DCP loads into these dicts in place; each object then takes its own back.
        loaded = {name: entry.state_dict() for name, entry in self._state.items()}
        target: dict[str, Any] = {_STATE_KEY: loaded, _STEP_KEY: -1}
        if rng_key in saved_keys:
            target[rng_key] = b""
        else:
            print(
                f"gracetrap: {path} has no RNG state for rank {self.rank()} (saved with another "
                "world size); random streams continue unrestored",
                file=sys.stderr,
                flush=True,
            )
        with _single_process_quietly():
            dcp_load(
                target,
                storage_reader=reader,
                planner=DefaultLoadPlanner(),
                no_dist=not self._initialised(),
            )
        if target[_STEP_KEY] != step:
            raise ValueError(f"{path} holds step {target[_STEP_KEY]}, not {step}")
        for name, entry in self._state.items():
            entry.load_state_dict(target[_STATE_KEY][name])
        if rng_key in target:
            restore_rng_state(target[rng_key])

    # --------------------------------------------------------------- exiting

    def save_and_exit(self, step: int) -> NoReturn:
        """The graceful path after ``should_stop(step)``: save, barrier, shut down, exit.

        The save is skipped (and the ``checkpoint_skipped`` event says why) when the
        grace time left is shorter than the expected save time, so that no save is
        cut off by the kill at the deadline.
        """
        self._report_signal()
        reason = self._skip_reason()
        if reason is not None:
            self.events.emit("checkpoint_skipped", step=step, reason=reason)
        else:
            try:
                self.save(step)
            except (Exception, CheckpointException) as error:
                # The job is being preempted either way; the previous checkpoint stands.
                self.events.emit("checkpoint_skipped", step=step, reason=f"save failed: {error}")
        self.shutdown()
        # A rank that stopped on another rank's signal may receive its own during the
        # save or the shutdown: it is still news to whoever measures signal delivery.
        self._report_signal()
        self.events.emit("exiting", code=self.exit_code)
        left = self.grace_left()
        self.events.flush(POST_TIMEOUT_SECONDS if left is None else min(POST_TIMEOUT_SECONDS, left))
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(self.exit_code)

    def shutdown(self) -> None:
        """Barrier with a timeout, then ``destroy_process_group()``; rank 0 goes last.

        Safe to call without a process group and more than once.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return
        leader = dist.get_rank() == 0
        if self._distributed():
            try:
                if "gloo" in str(dist.get_backend()):
                    dist.monitored_barrier(timeout=timedelta(seconds=self.barrier_timeout))
                else:
                    dist.barrier()
            except Exception as error:
                # A rank that is gone must not keep the others from exiting.
                print(f"gracetrap: barrier failed: {error}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        port = _env_int("MASTER_PORT")
        if leader and port is not None:
            # Waiting for the other ranks to hang up must not run into the kill at the
            # deadline, which would turn a clean exit into exit code 137.
            timeout = self.port_release_timeout
            left = self.grace_left()
            if left is not None:
                timeout = max(0.0, min(timeout, left - 0.5))
            release_rendezvous_port(port, timeout)

    # ------------------------------------------------------------- loop forms

    def steps(self, total_steps: int, *, save_every: int | None = None) -> Iterator[int]:
        """Resume, then yield each step still to do; checkpoint and exit when signalled.

        After the body of each iteration, the trap asks ``should_stop`` and exits
        gracefully if so; otherwise it saves every ``save_every`` steps.
        """
        for step in range(self.resume(), total_steps):
            yield step
            if self.should_stop(step):
                self.save_and_exit(step)
            if save_every and (step + 1) % save_every == 0:
                self.save(step)

    def close(self) -> None:
        """Finish deleting old checkpoints, restore the previous signal handlers and give
        events in flight time to go out."""
        if self._closed:
            return
        self._closed = True
        self._wait_for_pruning()
        self.restore_signal_handlers()
        self._report_signal()
        self.events.flush(POST_TIMEOUT_SECONDS)

    def __enter__(self) -> Trap:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
