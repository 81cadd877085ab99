"""The trap: catch the preemption signal, agree on a step, checkpoint, exit cleanly."""

from __future__ import annotations

import atexit
import contextlib
import copy
import gc
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
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from gracetrap import checkpoints, protocol
from gracetrap.events import POST_TIMEOUT_SECONDS, EventReporter, NoticePoller
from gracetrap.ports import release_rendezvous_port
from gracetrap.state import (
    SafeLoadPlanner,
    SafeReader,
    Stateful,
    adapt_state,
    capture_rng_state,
    restore_rng_state,
)

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

_STEP_KEY = "gracetrap_step"
_WORLD_SIZE_KEY = "gracetrap_world_size"
_STATE_KEY = "state"
# A `cadence` event is sent again when the interval moved by more than this fraction.
CADENCE_REPORT_FRACTION = 0.1
# A rank that a newer attempt fenced off exits with this code: nonzero (it did not
# finish), and apart from Python's 1 for an uncaught exception and 128+n for a signal.
FENCED_EXIT_CODE = 3
# Between saves, rank 0 looks at the folder's epoch this often, so that a fenced rank
# that saves rarely (or only when signalled) stops burning its GPU soon all the same.
FENCE_CHECK_SECONDS = 5.0


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


def _stage(
    value: Any, buffers: dict[tuple[Any, ...], torch.Tensor], key: tuple[Any, ...] = ()
) -> Any:
    """A copy of a state dict in host memory that training can no longer change.

    Tensors are copied to the CPU (the copy is the staging buffer), containers are
    rebuilt, and anything else is deep-copied, so that the background write sees the
    state exactly as it was when the save was called. ``buffers`` keeps the staging
    tensors by their place in the state: the next save copies into them instead of
    allocating afresh, because touching new memory page by page costs more than the
    copy itself (0.9 s against a fraction of that for 0.2 GB on a busy machine). A
    save waits for the previous background write, so a buffer is never refilled
    while it is being written.
    """
    if isinstance(value, torch.Tensor):
        source = value.detach()
        held = buffers.get(key)
        if (
            held is not None
            and held.shape == source.shape
            and held.dtype == source.dtype
            and source.layout == torch.strided
        ):
            held.copy_(source)
            return held
        staged = source.to("cpu", copy=True)
        buffers[key] = staged
        return staged
    if isinstance(value, dict):
        return {name: _stage(item, buffers, (*key, name)) for name, item in value.items()}
    if isinstance(value, list | tuple):
        items = [_stage(item, buffers, (*key, index)) for index, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return copy.deepcopy(value)


class _BackgroundSave:
    """One save being written by a background thread; the main thread reads the outcome."""

    def __init__(self, step: int, path: Path, notice: bool, stall: float) -> None:
        self.step = step
        self.path = path
        self.notice = notice
        self.stall = stall
        self.done = threading.Event()
        self.seconds = 0.0
        self.nbytes = 0
        self.error: BaseException | None = None
        self.committed_at: float | None = None
        self.reported = False
        self.thread: threading.Thread | None = None


_GLOO_WORKER = "pt_gloo_runloop"
_settle_registered = False
_freeze_registered = False


def _gloo_workers_running() -> bool:
    """True while a gloo worker thread of this process is running or runnable."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as handle:
                if handle.read().strip() != _GLOO_WORKER:
                    continue
            with open(f"/proc/self/task/{task}/stat") as handle:
                state = handle.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state == "R":
            return True
    return False


def _let_gloo_workers_settle(timeout: float = 2.0) -> None:
    """At interpreter exit, wait (at most ``timeout``) until gloo's worker threads sleep.

    A gloo worker thread goes on handling a collective's tensors for a moment after
    the rank has seen the result (it completes the future, then drops the work). For
    a tensor Python knows, those reference-count changes take the GIL. On a loaded
    machine that moment can come after the interpreter began shutting down, when
    taking the GIL ends the thread by a forced unwind through a ``noexcept`` frame:
    the rank dies with "terminate called without an active exception". Exit handlers
    run before that phase, so this one waits for the workers to go back to sleep.
    It reads ``/proc`` (threads are found by name); elsewhere it returns at once. A
    collective still in flight at exit is not waited for: that is the program's to end.
    """
    deadline = time.monotonic() + timeout
    quiet = 0
    # Three quiet looks in a row: a worker between two steps of its loop is runnable.
    while quiet < 3 and time.monotonic() < deadline:
        quiet = 0 if _gloo_workers_running() else quiet + 1
        time.sleep(0.005)


def _register_settle() -> None:
    global _settle_registered
    if not _settle_registered:
        _settle_registered = True
        atexit.register(_let_gloo_workers_settle)


def _freeze_objects() -> None:
    gc.freeze()


def _skip_the_last_collections() -> None:
    """Leave the objects alive at exit to the end of the process, uncollected.

    The interpreter's last garbage collections walk every object the process made
    (importing torch alone makes about 250,000), and a preempted gang's ranks all do
    it at once while their GPUs wait: 16 ranks on 2 cores took 8.3-9.4 s from SIGTERM
    to their last exit, 2.5-2.6 s with the objects frozen (``gc.freeze``). The freeze
    runs as the first exit handler, after the caller's ``finally`` blocks and
    before the other exit handlers, which all still run; only objects kept alive by
    a reference cycle are no longer finalized at exit (Python never promised that).
    """
    global _freeze_registered
    if not _freeze_registered:
        _freeze_registered = True
        atexit.register(_freeze_objects)


def _fencing_owner(error: BaseException) -> int | None:
    """The attempt that fenced this one off, when ``error`` is (or wraps) a fencing."""
    if isinstance(error, checkpoints.FencedError):
        return error.owner
    if isinstance(error, CheckpointException):
        # DCP gathers each rank's failure as (exception, traceback summary).
        for failure in error.failures.values():
            owner = _fencing_owner(failure[0])
            if owner is not None:
                return owner
    return None


class _FencedWriter(FileSystemWriter):
    """DCP's file-system writer, whose commit (the ``.metadata`` rename) is fenced.

    ``finish`` runs on the coordinating rank once every rank's data is on disk. It
    checks the folder's epoch before the metadata is written, and again right after
    the rename: a newer attempt may have claimed the folder in between, and then the
    commit is taken back (the metadata removed) before anyone is told it happened.
    The :class:`~gracetrap.checkpoints.FencedError` reaches every rank through DCP.
    """

    def __init__(self, path: Path, *, root: Path, epoch: int | None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.root = root
        self.epoch = epoch

    def _check(self) -> None:
        if self.epoch is None:
            return
        owner = checkpoints.current_epoch(self.root)
        if owner > self.epoch:
            raise checkpoints.FencedError(owner, self.epoch)

    def finish(self, *args: Any, **kwargs: Any) -> None:
        """Commit the checkpoint unless a newer attempt owns the folder."""
        self._check()
        super().finish(*args, **kwargs)
        try:
            self._check()
        except checkpoints.FencedError:
            Path(self._get_metadata_path()).unlink(missing_ok=True)
            raise


def _prune_after(previous: threading.Thread | None, root: Path, keep: int) -> None:
    # Runs in the pruning thread: wait for the previous pruning, then prune.
    if previous is not None:
        previous.join()
    checkpoints.prune(root, keep)


def worker_init_fn(worker_id: int) -> None:
    """Pass as ``DataLoader(worker_init_fn=...)``: workers ignore the preemption signals.

    The runtime signals a rank's whole process group, DataLoader workers included
    (the checkpoint notice as well).
    A worker that died of SIGTERM would make the DataLoader raise in the middle of
    the step the ranks are about to agree on, so workers leave the signal to the
    training process.
    """
    del worker_id
    for signum in DEFAULT_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    # The checkpoint notice reaches the whole process group too, and its default
    # action (SIGUSR2's) would end the worker.
    try:
        notice = protocol.parse_notice_signal(_env(protocol.NOTICE_SIGNAL_ENV))
    except ValueError:
        notice = protocol.DEFAULT_NOTICE_SIGNAL
    if notice is not None:
        signal.signal(notice, signal.SIG_IGN)


class Trap:
    """Graceful preemption for one training process (one rank).

    Arguments left as None are read from the ``QM_*`` environment the runtime sets:
    ``QM_CHECKPOINT_DIR``, ``QM_GRACE_SECONDS``, ``QM_EVENTS_URL``, ``QM_EVENTS_TOKEN``,
    ``QM_JOB_ID`` and ``QM_ATTEMPT``. ``state`` maps names to the objects to checkpoint:
    models, optimizers and anything with ``state_dict()``/``load_state_dict()``. RNG
    states and the step are always included.

    With an attempt number, the trap claims the checkpoint folder for its attempt as
    it is built (before anything is loaded) and stops with ``FENCED_EXIT_CODE`` once a
    newer attempt has claimed it (see ``gracetrap.checkpoints``). Without one (training
    run by hand), it claims nothing and saves into the folder's newest lineage.

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
        async_saves: bool | None = None,
        notice_signal: int | str | None = None,
        mtbp_seconds: float | None = None,
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
        if async_saves is None:
            async_saves = protocol.parse_flag(
                protocol.ASYNC_SAVES_ENV, os.environ.get(protocol.ASYNC_SAVES_ENV)
            )
        self.async_saves = bool(async_saves)
        self.notice_signal = protocol.parse_notice_signal(
            notice_signal if notice_signal is not None else _env(protocol.NOTICE_SIGNAL_ENV)
        )
        if self.notice_signal is not None and self.notice_signal in self.signals:
            raise ValueError(
                f"{self.notice_signal.name} cannot be both the checkpoint notice and a stop "
                "signal: choose another notice signal or set it off"
            )
        self._mtbp_fixed = mtbp_seconds
        self._mtbp_hint = protocol.MtbpHint()
        self.attempt = attempt if attempt is not None else _env_int("QM_ATTEMPT")
        self.events = EventReporter(
            job_id=job_id if job_id is not None else _job_id_from_env(),
            attempt=self.attempt,
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
        # Set by `save_and_exit` just before its SystemExit: `close` then keeps the
        # trap's handler on the stop signals rather than putting the previous ones back.
        self._exiting = False
        self._save_seconds: list[float] = []
        self._previous_handlers: dict[signal.Signals, Any] = {}
        self._closed = False
        self._pruner: threading.Thread | None = None
        self._notice_at: float | None = None
        self._notice_reported = False
        self._notice_answered_at = -math.inf
        self._notice_by_poll = False
        self._pending: _BackgroundSave | None = None
        self._save_group: Any = None
        self._stall_seconds: list[float] = []
        self._collective: torch.Tensor | None = None
        self._staging: dict[tuple[Any, ...], torch.Tensor] = {}
        self._last_checkpoint_at = time.monotonic()
        self._agreed_due: tuple[int, bool] | None = None
        self._committed_step: int | None = None
        # The (MTBP, interval) of the latest `cadence` event, so that it is reported
        # when it changes rather than at every step.
        self._reported_cadence: tuple[float, float] | None = None
        # The lineage this trap saves into and resumes from: its attempt when it has
        # one (then it is fenced: `_fencing`), else the folder's newest.
        self.epoch = 0
        self._fencing = False
        self._fenced_by = 0
        self._fence_checked_at = time.monotonic()
        self._poller: NoticePoller | None = None
        self._claim()
        _register_settle()
        # Registered after the settle wait, so it runs before it (atexit is last in,
        # first out): a rank's own signal that arrives after its last report (on
        # Kubernetes each pod is evicted by its own call, often after the gang already
        # stopped on another rank's signal) is still reported on the way out.
        atexit.register(self._report_signal_at_exit)
        for signum in self.signals:
            self._previous_handlers[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)
        if self.notice_signal is not None:
            self._previous_handlers[self.notice_signal] = signal.getsignal(self.notice_signal)
            signal.signal(self.notice_signal, self._on_notice)
        self._poller = self._start_notice_poll()
        # Tells the scheduler which parts of the protocol this trap speaks: only a trap
        # that announced a notice signal is sent one (its default action would kill).
        self.events.emit(
            "trap_ready",
            protocol=protocol.PROTOCOL_VERSION,
            notice_signal=self.notice_signal.name if self.notice_signal is not None else None,
            notice_poll=self._notice_by_poll,
            async_saves=self.async_saves,
            mtbp_seconds=self.mtbp_seconds(),
        )

    # ----------------------------------------------------------------- fencing

    def _claim(self) -> None:
        """Claim the checkpoint folder for this attempt, before anything is loaded."""
        if self.checkpoint_dir is None:
            return
        if self.attempt is None:
            self.epoch = checkpoints.current_epoch(self.checkpoint_dir)
            return
        try:
            owner = checkpoints.claim_epoch(
                self.checkpoint_dir,
                self.attempt,
                owner=f"job {self.events.job_id} rank {self.rank()} pid {os.getpid()}",
            )
        except OSError as error:
            # A folder this rank cannot write to holds no checkpoint of its either.
            print(
                f"gracetrap: cannot claim {self.checkpoint_dir} for attempt {self.attempt} "
                f"({error}); its checkpoints are not fenced",
                file=sys.stderr,
                flush=True,
            )
            self.epoch = self.attempt
            return
        self.epoch = self.attempt
        self._fencing = True
        if owner > self.epoch:
            # A rank that starts after a newer attempt claimed the folder never trains.
            self._stop_fenced(owner)

    def _newer_owner(self) -> int:
        """The folder's epoch when a newer attempt claimed it, else 0 (a local look)."""
        if not self._fencing or self.checkpoint_dir is None:
            return 0
        if self._fenced_by:
            return self._fenced_by
        owner = checkpoints.current_epoch(self.checkpoint_dir)
        return owner if owner > self.epoch else 0

    def _owner_to_agree(self) -> float:
        """What this rank brings to an agreement on fencing: rank 0 looks at the folder
        now and then, any rank passes on a fencing it met in a background save."""
        if not self._fencing:
            return 0.0
        if self._fenced_by:
            return float(self._fenced_by)
        if self.rank() == 0 and time.monotonic() - self._fence_checked_at >= FENCE_CHECK_SECONDS:
            self._fence_checked_at = time.monotonic()
            return float(self._newer_owner())
        return 0.0

    @property
    def fenced(self) -> bool:
        """True once a newer attempt of the job was found to own the checkpoint folder."""
        return self._fenced_by > 0

    def _stop_fenced(
        self, owner: int, step: int | None = None, path: Path | None = None
    ) -> NoReturn:
        """Stop this rank for good: a newer attempt owns the checkpoints.

        Every rank of the gang reaches this at the same point (the decision comes from
        an all-reduce, or from DCP, which raises alike on every rank), so the gang can
        still leave its process group in step. What this attempt had staged for a
        commit is removed: its folder is its own, nobody else writes there.
        """
        self._fenced_by = owner
        line = checkpoints.fenced_line(owner, self.epoch)
        print(f"gracetrap: {line}", file=sys.stderr, flush=True)
        if path is not None and self.rank() == 0 and not checkpoints.is_complete(path):
            checkpoints.discard(path)
        if step is not None:
            self.events.emit("checkpoint_skipped", step=step, reason=line)
        # No more pruning from this rank: the folder is the newer attempt's to tidy.
        self._pruner = None
        if self._poller is not None:
            self._poller.stop()
        if self._initialised():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self.events.emit("exiting", code=FENCED_EXIT_CODE)
        self.events.flush(POST_TIMEOUT_SECONDS)
        sys.stdout.flush()
        sys.stderr.flush()
        _skip_the_last_collections()
        sys.exit(FENCED_EXIT_CODE)

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

    def _on_notice(self, signum: int, frame: FrameType | None) -> None:
        del signum, frame
        if os.getpid() != self._pid:
            return
        now = time.time()
        if now <= self._notice_answered_at + protocol.NOTICE_COALESCE_SECONDS:
            # A copy of the notice the ranks have just answered (one per rank is sent).
            return
        if self._notice_at is None:
            self._notice_at = now
            self._notice_reported = False

    def _start_notice_poll(self) -> NoticePoller | None:
        """Where the runtime cannot signal the ranks (``QM_NOTICE_POLL_SECONDS``), rank 0
        asks the events URL for the notice; the all-reduce in ``should_stop`` takes it
        to the other ranks, so one asking rank per gang is enough."""
        interval = protocol.parse_poll_seconds(_env(protocol.NOTICE_POLL_ENV))
        url, token = self.events.events_url, self.events.events_token
        # Every rank takes a polled notice (from rank 0, through the all-reduce).
        self._notice_by_poll = interval is not None and url is not None and token is not None
        if interval is None or url is None or token is None or (_env_int("RANK") or 0) != 0:
            return None
        return NoticePoller(
            events_url=url, events_token=token, interval=interval, on_notice=self._notice_polled
        ).start()

    def _notice_polled(self, at: float) -> None:
        # Runs in the poll thread: the same path as the notice signal's handler.
        if at <= self._notice_answered_at + protocol.NOTICE_COALESCE_SECONDS:
            return
        if self._notice_at is None:
            self._notice_at = at
            self._notice_reported = False

    def _report_notice(self) -> None:
        if self._notice_at is not None and not self._notice_reported:
            self._notice_reported = True
            self.events.emit("notice_received", at=self._notice_at)

    @property
    def signalled(self) -> bool:
        """True once this process received one of the trap's signals."""
        return self._signal_at is not None

    def _report_signal(self) -> None:
        if self._signal_at is not None and not self._signal_reported:
            self._signal_reported = True
            self.events.emit("signal_received", at=self._signal_at)

    def _report_signal_at_exit(self) -> None:
        if self._signal_at is not None and not self._signal_reported and os.getpid() == self._pid:
            self._report_signal()
            self.events.flush(POST_TIMEOUT_SECONDS)
            sys.stdout.flush()

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
        the same ``step`` even when the signal reached only one of them. The same
        all-reduce carries the checkpoint notice: when any rank received one, every
        rank saves ``step`` here (in the background when asynchronous saves are on)
        and training goes on. It also settles ``should_checkpoint(step)``.
        """
        self._report_signal()
        self._report_notice()
        self._poll_background()
        due = 1.0 if self._due_locally(step) else 0.0
        notice_at = self._notice_at if self._notice_at is not None else -math.inf
        # Negated time: the maximum of -t is the earliest signal of any rank, which
        # starts the grace window for all of them.
        signal_at = -self._signal_at if self._signal_at is not None else -math.inf
        flag = 1.0 if self._signal_at is not None else 0.0
        values = [flag, signal_at, notice_at, time.time(), due, self._owner_to_agree()]
        flag, earliest, notice_at, now, due, owner = self._reduce_max(values)
        if owner > 0:
            self._stop_fenced(int(owner), step)
        self._agreed_due = (step, due > 0)
        if flag > 0:
            self._stop_agreed_at = -earliest
            return True
        if notice_at > self._notice_answered_at + protocol.NOTICE_COALESCE_SECONDS:
            self._answer_notice(step, now)
        if (
            self._notice_at is not None
            and self._notice_at <= self._notice_answered_at + protocol.NOTICE_COALESCE_SECONDS
        ):
            # This rank's copy of a notice the ranks already answered.
            self._notice_at = None
        return False

    def _answer_notice(self, step: int, agreed_at: float) -> None:
        self._notice_answered_at = agreed_at
        if self.checkpoint_dir is None:
            self.events.emit(
                "checkpoint_skipped", step=step, notice=True, reason="no checkpoint directory"
            )
            return
        try:
            self.save(step, notice=True)
        except (Exception, CheckpointException) as error:
            # A notice is a courtesy: training goes on, the eviction saves as before.
            self.events.emit(
                "checkpoint_skipped", step=step, notice=True, reason=f"save failed: {error}"
            )
        # The notice's checkpoint restarts the cadence's clock: no regular one now.
        self._agreed_due = (step, False)

    def mtbp_seconds(self) -> float | None:
        """The scheduler's mean time between preemptions for this job, or None without a hint."""
        if self._mtbp_fixed is not None:
            return self._mtbp_fixed
        return self._mtbp_hint.seconds()

    def checkpoint_cost(self) -> float:
        """Seconds of training a checkpoint costs: the stall of the latest saves, else the
        expected save time."""
        if self._stall_seconds:
            recent = self._stall_seconds[-3:]
            return sum(recent) / len(recent)
        return self.expected_save_time()

    def checkpoint_interval(self) -> float | None:
        """Seconds between regular checkpoints by the Young/Daly rule, None without a hint."""
        return protocol.checkpoint_interval(
            self.checkpoint_cost(),
            self.mtbp_seconds(),
            write_seconds=self.expected_save_time() if self.async_saves else 0.0,
        )

    def _due_locally(self, step: int) -> bool:
        interval = self.checkpoint_interval()
        if interval is not None:
            self._report_cadence(step, interval)
        return interval is not None and time.monotonic() - self._last_checkpoint_at >= interval

    def _report_cadence(self, step: int, interval: float) -> None:
        """Report the regular checkpoint interval when the hint changed or the interval
        moved by more than a tenth (each save measures the cost anew; smaller moves
        would only repeat the same figure)."""
        mtbp = self.mtbp_seconds()
        if mtbp is None:
            return
        last = self._reported_cadence
        if (
            last is not None
            and last[0] == mtbp
            and abs(interval - last[1]) <= CADENCE_REPORT_FRACTION * max(last[1], 1e-9)
        ):
            return
        self._reported_cadence = (mtbp, interval)
        self.events.emit(
            "cadence",
            step=step,
            mtbp_seconds=mtbp,
            save_cost=round(self.checkpoint_cost(), 6),
            interval_seconds=round(interval, 6),
        )

    def should_checkpoint(self, step: int) -> bool:
        """True on every rank when a regular checkpoint is due after ``step``.

        The interval follows the preemption-risk hint (``QM_PREEMPTION_MTBP`` or the
        file named by ``QM_PREEMPTION_MTBP_FILE``) and the measured cost of this job's
        saves: ``sqrt(2 * cost * MTBP)``. Without a hint it is always False. After
        ``should_stop(step)`` it costs nothing (that all-reduce carried the answer);
        otherwise it runs one all-reduce of its own.
        """
        if self._agreed_due is not None and self._agreed_due[0] == step:
            return self._agreed_due[1]
        (due,) = self._reduce_max([1.0 if self._due_locally(step) else 0.0])
        self._agreed_due = (step, due > 0)
        return due > 0

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

    def save(
        self, step: int, *, background: bool | None = None, notice: bool = False
    ) -> checkpoints.CheckpointInfo | None:
        """Checkpoint the state after ``step`` completed; every rank must call it.

        With ``background`` (default: the trap's ``async_saves``) the state is copied
        to host memory and written by a background thread while training goes on; the
        returned checkpoint is then not complete yet (``complete=False``) and the
        ``latest`` pointer moves once the files and folders are fsynced. A save first
        waits for the previous background save. Returns None when ``step`` was
        already checkpointed (the existing checkpoint is kept as it is).
        """
        if self.checkpoint_dir is None:
            raise ValueError(
                "no checkpoint directory: pass checkpoint_dir or set QM_CHECKPOINT_DIR"
            )
        entered = time.monotonic()
        background = self.async_saves if background is None else background
        self._report_signal()
        self._report_notice()
        # One background write at a time: it also settles what is already on disk.
        self.wait_for_save()
        root = self.checkpoint_dir
        path = checkpoints.step_dir(root, step, self.epoch)
        leader = self.rank() == 0
        already = 0.0
        owner = 0.0 if self._fenced_by == 0 else float(self._fenced_by)
        if leader:
            root.mkdir(parents=True, exist_ok=True)
            owner = max(owner, float(self._newer_owner()))
            newest = checkpoints.complete_checkpoints(root)
            if not newest or (self.epoch, step) <= newest[0].order:
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
        already, owner = self._reduce_max([already, owner])
        if owner > 0:
            # Nothing was written yet: a newer attempt owns the folder.
            self._stop_fenced(int(owner), step)
        if already:
            self.events.emit(
                "checkpoint_skipped", step=step, reason=f"step {step} is already checkpointed"
            )
            return None
        self.events.emit("checkpoint_started", step=step)
        self._last_checkpoint_at = entered
        if background:
            return self._save_in_background(step, path, notice, entered)
        started = time.monotonic()
        writer = self._writer(path)
        try:
            with _single_process_quietly(), _crc32(self.checksums):
                dcp_save(
                    self._dcp_state(step), storage_writer=writer, no_dist=not self._initialised()
                )
        except (Exception, CheckpointException) as error:
            # DCP raises alike on every rank. A fencing says so itself; any other
            # failure of a fenced rank (a newer attempt's pruning removed the folder
            # under it) is one too, as the folder's epoch shows.
            fenced_by = _fencing_owner(error) or self._newer_owner()
            if fenced_by:
                self._stop_fenced(fenced_by, step, path)
            raise
        nbytes = 0.0
        if leader:
            checkpoints.fsync_dir(path)
            checkpoints.fsync_dir(root)
            nbytes = float(checkpoints.folder_bytes(path))
        seconds, nbytes = self._reduce_max([time.monotonic() - started, nbytes])
        if leader:
            checkpoints.write_pointer(
                root,
                step=step,
                seconds=seconds,
                nbytes=int(nbytes),
                world_size=self.world_size(),
                epoch=self.epoch,
            )
        stall = time.monotonic() - entered
        self._save_seconds.append(seconds)
        self._stall_seconds.append(stall)
        self._committed_step = step
        self.events.emit(
            "checkpoint_committed",
            step=step,
            bytes=int(nbytes),
            seconds=round(seconds, 6),
            stall=round(stall, 6),
            background=False,
            notice=notice,
        )
        if leader:
            self._start_pruning()
        return checkpoints.CheckpointInfo(step, path, True)

    def _writer(self, path: Path) -> FileSystemWriter:
        assert self.checkpoint_dir is not None
        return _FencedWriter(
            path,
            root=self.checkpoint_dir,
            epoch=self.epoch if self._fencing else None,
            sync_files=True,
            thread_count=self.save_threads,
        )

    def _start_pruning(self) -> None:
        # Deleting old checkpoints is slow on big files and never needed for safety,
        # so it runs beside training instead of inside the save (or the grace window).
        # A kill in the middle leaves only renamed remnants that the next prune removes.
        # One deletion at a time: the new one starts once the previous one ended.
        assert self.checkpoint_dir is not None
        self._pruner = threading.Thread(
            target=_prune_after,
            args=(self._pruner, self.checkpoint_dir, self.keep),
            name="gracetrap-prune",
        )
        self._pruner.daemon = True
        self._pruner.start()

    # ------------------------------------------------------ background saves

    def _background_group(self) -> Any:
        """A gloo group of its own for background saves, created on first use.

        DCP runs collectives (plan exchange, the commit) inside the save; on the
        default group they would race with training's own collectives from another
        thread, so background saves talk over a separate group.
        """
        if not self._distributed():
            return None
        if self._save_group is None:
            self._save_group = dist.new_group(backend="gloo")
        return self._save_group

    def _save_in_background(
        self, step: int, path: Path, notice: bool, entered: float
    ) -> checkpoints.CheckpointInfo:
        staged = _stage(self._dcp_state(step), self._staging)
        group = self._background_group()
        pending = _BackgroundSave(step, path, notice, stall=0.0)
        # Not a daemon: an interpreter that exits normally lets the write finish
        # rather than cutting it off (or unwinding it out of C++ frames).
        pending.thread = threading.Thread(
            target=self._write_in_background,
            args=(pending, staged, group),
            name="gracetrap-save",
        )
        self._pending = pending
        pending.thread.start()
        pending.stall = time.monotonic() - entered
        self._stall_seconds.append(pending.stall)
        return checkpoints.CheckpointInfo(step, path, False)

    def _write_in_background(self, pending: _BackgroundSave, staged: Any, group: Any) -> None:
        assert self.checkpoint_dir is not None
        root = self.checkpoint_dir
        started = time.monotonic()
        try:
            writer = self._writer(pending.path)
            with _crc32(self.checksums):
                if self._initialised():
                    dcp_save(staged, storage_writer=writer, process_group=group)
                else:
                    with _single_process_quietly():
                        dcp_save(staged, storage_writer=writer, no_dist=True)
            leader = self.rank() == 0
            nbytes = 0.0
            if leader:
                checkpoints.fsync_dir(pending.path)
                checkpoints.fsync_dir(root)
                nbytes = float(checkpoints.folder_bytes(pending.path))
            values = torch.tensor([time.monotonic() - started, nbytes], dtype=torch.float64)
            if group is not None:
                dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
            seconds, nbytes = (float(v) for v in values.tolist())
            if leader:
                # Only now, with every rank's files and both folders fsynced, does the
                # pointer move.
                checkpoints.write_pointer(
                    root,
                    step=pending.step,
                    seconds=seconds,
                    nbytes=int(nbytes),
                    world_size=self.world_size(),
                    epoch=self.epoch,
                )
            pending.seconds = seconds
            pending.nbytes = int(nbytes)
            pending.committed_at = time.time()
            # Reported from here, not at the training thread's next step boundary:
            # a scheduler waiting for a notice's commit evicts a step sooner.
            self.events.emit(
                "checkpoint_committed",
                at=pending.committed_at,
                step=pending.step,
                bytes=pending.nbytes,
                seconds=round(pending.seconds, 6),
                stall=round(pending.stall, 6),
                background=True,
                notice=pending.notice,
            )
        except BaseException as error:
            # Reported by the training thread at its next call into the trap.
            pending.error = error
        finally:
            pending.done.set()

    def _poll_background(self) -> None:
        """Take in a background save that has finished (on the training thread); its
        commit was reported by the write thread, a failure is reported here."""
        pending = self._pending
        if pending is None or pending.reported or not pending.done.is_set():
            return
        pending.reported = True
        if pending.error is not None:
            fenced_by = _fencing_owner(pending.error) or self._newer_owner()
            if fenced_by:
                # Agreed with the other ranks at the next all-reduce (should_stop,
                # save), which then stops the gang together.
                self._fenced_by = fenced_by
                if self.rank() == 0 and not checkpoints.is_complete(pending.path):
                    checkpoints.discard(pending.path)
                self.events.emit(
                    "checkpoint_skipped",
                    step=pending.step,
                    notice=pending.notice,
                    reason=checkpoints.fenced_line(fenced_by, self.epoch),
                )
                return
            self.events.emit(
                "checkpoint_skipped",
                step=pending.step,
                notice=pending.notice,
                reason=f"background save failed: {pending.error}",
            )
            return
        self._save_seconds.append(pending.seconds)
        self._committed_step = pending.step
        if self.rank() == 0:
            self._start_pruning()

    @property
    def save_in_flight(self) -> bool:
        """True while a background save is being written."""
        return self._pending is not None and not self._pending.done.is_set()

    def wait_for_save(self, timeout: float | None = None) -> bool:
        """Wait for the background save in flight, if any, and report it.

        Returns True when no background save is in flight any more, False when
        ``timeout`` seconds passed first.
        """
        pending = self._pending
        if pending is None:
            return True
        if not pending.done.wait(timeout):
            return False
        assert pending.thread is not None
        pending.thread.join()
        self._poll_background()
        self._pending = None
        return True

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
        # Newest first by (epoch, step): a newer attempt's commit wins over any step of
        # an older one, and commits of attempts newer than this one (none, unless this
        # one is fenced already) are not this lineage's to take.
        candidates = [
            info
            for info in checkpoints.complete_checkpoints(self.checkpoint_dir)
            if not self._fencing or info.epoch <= self.epoch
        ]
        # Every rank must load the same checkpoint: follow rank 0's listing.
        listed = [info.order for info in candidates] if self.rank() == 0 else []
        (count,) = self._reduce_max([float(len(listed))])
        chosen: list[tuple[int, int]] = []
        for index in range(int(count)):
            epoch, step = self._reduce_max(
                [float(value) for value in listed[index]] if listed else [-1.0, -1.0]
            )
            chosen.append((int(epoch), int(step)))
        for epoch, step in chosen:
            path = checkpoints.step_dir(self.checkpoint_dir, step, epoch)
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
            self._committed_step = step
            self.events.emit("resumed", step=step + 1)
            return step + 1
        return 0

    def _load(self, path: Path, step: int) -> None:
        # Neither the index nor any value is unpickled freely: a folder that names
        # anything but tensors and plain data is refused (gracetrap.state).
        reader = SafeReader(path)
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
                planner=SafeLoadPlanner(),
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
        self._report_notice()
        self._finish_background_or_exit(step)
        if self._fencing:
            # A fenced rank neither saves nor exits as if its attempt ended well.
            (owner,) = self._reduce_max([float(self._newer_owner())])
            if owner > 0:
                self._stop_fenced(int(owner), step)
        reason = self._skip_reason()
        if self._committed_step == step:
            # A notice (or a regular save) already committed this very step: nothing
            # has run since, so there is nothing to save.
            self.events.emit(
                "checkpoint_skipped", step=step, reason=f"step {step} is already checkpointed"
            )
        elif reason is not None:
            self.events.emit("checkpoint_skipped", step=step, reason=reason)
        else:
            try:
                self.save(step, background=False)
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
        # And once more for a signal that came while the events went out.
        self._report_signal()
        sys.stdout.flush()
        sys.stderr.flush()
        _skip_the_last_collections()
        self._exiting = True
        sys.exit(self.exit_code)

    def _finish_background_or_exit(self, step: int) -> None:
        """Give a background save in flight the grace time left; exit if it needs more.

        If any rank's write is still running when the window is about to close, the
        ranks exit at once: the unfinished folder has no metadata file, so the previous
        complete checkpoint (and ``latest``, which still names it) stands.
        """
        if self._pending is None:
            finished = True
        else:
            left = self.grace_left()
            # Half a second of the window is kept for the barrier and the exit.
            finished = self.wait_for_save(None if left is None else max(0.0, left - 0.5))
        (unfinished,) = self._reduce_max([0.0 if finished else 1.0])
        if not unfinished:
            return
        pending_step = self._pending.step if self._pending is not None else step
        self.events.emit(
            "checkpoint_skipped",
            step=step,
            reason=(
                f"the background save of step {pending_step} did not finish within the "
                "grace window; the previous complete checkpoint stands"
            ),
        )
        self.events.emit("exiting", code=self.exit_code)
        self.events.flush(0.0)
        sys.stdout.flush()
        sys.stderr.flush()
        # The write thread may be inside a collective or a file write: neither Python's
        # exit nor destroy_process_group() could stop it cleanly, so leave at once.
        os._exit(self.exit_code)

    def shutdown(self) -> None:
        """Wait for a background save, barrier with a timeout, then ``destroy_process_group()``;
        rank 0 goes last.

        Safe to call without a process group and more than once.
        """
        if self._poller is not None:
            self._poller.stop()
        self.wait_for_save()
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
        gracefully if so; otherwise it saves every ``save_every`` steps, or, without
        ``save_every``, whenever ``should_checkpoint`` says the cadence hint wants one.
        """
        for step in range(self.resume(), total_steps):
            yield step
            if self.should_stop(step):
                self.save_and_exit(step)
            due = (step + 1) % save_every == 0 if save_every else self.should_checkpoint(step)
            if due:
                self.save(step)

    def close(self) -> None:
        """Finish deleting old checkpoints, restore the previous signal handlers and give
        events in flight time to go out."""
        if self._closed:
            return
        self._closed = True
        if self._poller is not None:
            self._poller.stop()
        self.wait_for_save()
        if self._fenced_by:
            # The last background save met a newer attempt's claim.
            self._stop_fenced(self._fenced_by)
        self._wait_for_pruning()
        self.restore_signal_handlers()
        if self._exiting:
            self._hear_late_stop_signals()
        self._report_signal()
        self.events.flush(POST_TIMEOUT_SECONDS)

    def _hear_late_stop_signals(self) -> None:
        """While the process exits after a stop the gang agreed on (`save_and_exit`;
        a trap closed without exiting puts the previous handlers back), the trap's own
        handler stays on the stop signals. A rank's own signal may come late: on
        Kubernetes each rank's SIGTERM comes from its own node's kubelet, seconds apart
        under load, and the gang may have stopped on another rank's already. With the
        default handler back it would turn a clean exit into death by signal while the
        interpreter shuts down; the trap's handler only notes it, and the exit hook
        reports it (`_report_signal_at_exit`). The deadline's SIGKILL still bounds it."""
        for signum in self.signals:
            signal.signal(signum, self._on_signal)

    def __enter__(self) -> Trap:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
