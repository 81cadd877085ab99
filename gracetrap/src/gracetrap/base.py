"""The trap's state and its lower layers: the arguments and environment it is built
from, the fencing of the checkpoint folder, the signal and notice handlers, and the
collectives the ranks agree through. Decides neither when to stop nor how to save
(gracetrap.stopping and gracetrap.saving build on it).
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, TextIO

import torch
import torch.distributed as dist

from gracetrap import checkpoints, protocol
from gracetrap.environment import env, env_float, env_int, job_id_from_env
from gracetrap.events import POST_TIMEOUT_SECONDS, EventReporter, NoticePoller
from gracetrap.gloo import register_settle, skip_the_last_collections
from gracetrap.relay import JOIN_SECONDS, GangRelay, SignalWatch
from gracetrap.staging import BackgroundSave
from gracetrap.state import Stateful, adapt_state

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


# A rank that a newer attempt fenced off exits with this code: nonzero (it did not
# finish), and apart from Python's 1 for an uncaught exception and 128+n for a signal.
FENCED_EXIT_CODE = 3
# Between saves, rank 0 looks at the folder's epoch this often, so that a fenced rank
# that saves rarely (or only when signalled) stops burning its GPU soon all the same.
FENCE_CHECK_SECONDS = 5.0


class TrapBase:
    """The trap's state for one rank, built from its arguments and the ``QM_*``
    environment, with the folder's fencing, the signal handlers and the collectives
    the ranks agree through. :class:`~gracetrap.trap.Trap` is the class to use."""

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
        directory = checkpoint_dir if checkpoint_dir is not None else env("QM_CHECKPOINT_DIR")
        self.checkpoint_dir: Path | None = Path(directory) if directory is not None else None
        self.grace_seconds = (
            grace_seconds if grace_seconds is not None else env_float("QM_GRACE_SECONDS")
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
            notice_signal if notice_signal is not None else env(protocol.NOTICE_SIGNAL_ENV)
        )
        if self.notice_signal is not None and self.notice_signal in self.signals:
            raise ValueError(
                f"{self.notice_signal.name} cannot be both the checkpoint notice and a stop "
                "signal: choose another notice signal or set it off"
            )
        self._mtbp_fixed = mtbp_seconds
        self._mtbp_hint = protocol.MtbpHint()
        self.attempt = attempt if attempt is not None else env_int("QM_ATTEMPT")
        self.events = EventReporter(
            job_id=job_id if job_id is not None else job_id_from_env(),
            attempt=self.attempt,
            rank=self.rank,
            events_url=events_url if events_url is not None else env("QM_EVENTS_URL"),
            events_token=events_token if events_token is not None else env("QM_EVENTS_TOKEN"),
            stream=stream,
        )
        self._state: dict[str, Stateful] = adapt_state(state or {})
        self._pid = os.getpid()
        self._signal_at: float | None = None
        self._signal_reported = False
        # Another rank's stop, passed on by the gang's relay (gracetrap.relay): when
        # this rank heard it, from which rank, and when that rank was signalled.
        self._heard_at: float | None = None
        self._heard_from = -1
        self._heard_signal_at: float | None = None
        self._heard_reported = False
        self._relay: GangRelay | None = None
        self._relay_tried = False
        self._stop_said = False
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
        self._pending: BackgroundSave | None = None
        self._save_group: Any = None
        self._stall_seconds: list[float] = []
        self._collective: torch.Tensor | None = None
        self._staging: dict[tuple[Any, ...], torch.Tensor] = {}
        self._last_checkpoint_at = time.monotonic()
        self._agreed_due: tuple[int, bool] | None = None
        self._committed_step: int | None = None
        # The world size the checkpoint resumed from was written by, when it says.
        self._saved_world_size: int | None = None
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
        # Registered before every other exit handler of the trap, so it runs after them.
        atexit.register(self._ignore_stop_signals_at_exit)
        register_settle()
        # Registered after the settle wait, so it runs before it (atexit is last in,
        # first out): a rank's own signal that arrives after its last report (on
        # Kubernetes each pod is evicted by its own call, often after the gang already
        # stopped on another rank's signal) is still reported on the way out.
        atexit.register(self._report_signal_at_exit)
        # Before the handlers, so that no signal of theirs goes unseen by it.
        self._signal_watch = SignalWatch(self._signal_arrived)
        atexit.register(self._signal_watch.close)
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

    def mtbp_seconds(self) -> float | None:
        """The scheduler's mean time between preemptions for this job, or None without a hint."""
        if self._mtbp_fixed is not None:
            return self._mtbp_fixed
        return self._mtbp_hint.seconds()

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
        self._stop_relay()
        if self._initialised():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self.events.emit("exiting", code=FENCED_EXIT_CODE)
        self.events.flush(POST_TIMEOUT_SECONDS)
        sys.stdout.flush()
        sys.stderr.flush()
        skip_the_last_collections()
        sys.exit(FENCED_EXIT_CODE)

    # ----------------------------------------------------------------- signals

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only set the flag: anything else (printing, I/O, collectives) could run in
        # the middle of the very operation it interrupted.
        del frame
        if os.getpid() != self._pid:
            # A forked DataLoader worker inherited this handler: its parent handles it.
            return
        if self._signal_at is None:
            self._signal_at = time.time()
        self._signal_watch.poke(signum)

    def _on_notice(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if os.getpid() != self._pid:
            return
        self._take_notice(time.time())
        self._signal_watch.poke(signum)

    def _take_notice(self, at: float) -> bool:
        """Note a notice that came at ``at``; False for a copy of one already answered."""
        if at <= self._notice_answered_at + protocol.NOTICE_COALESCE_SECONDS:
            # A copy of the notice the ranks have just answered (one per rank is sent).
            return False
        if self._notice_at is None:
            self._notice_at = at
            self._notice_reported = False
        return True

    # ------------------------------------------------------------------- relay

    def _signal_arrived(self, signum: int, at: float) -> None:
        """A signal's arrival, from the SignalWatch thread, at once (gracetrap.relay)."""
        if signum in self.signals:
            if self._signal_at is None or at < self._signal_at:
                self._signal_at = at
            self._say_stop()
        elif self.notice_signal is not None and signum == self.notice_signal:
            self._take_notice(at)

    def _say_stop(self) -> None:
        relay = self._relay
        if relay is not None and self._signal_at is not None and not self._stop_said:
            self._stop_said = True
            relay.say("stop", self._signal_at)

    def _heard(self, kind: str, rank: int, at: float) -> None:
        """Another rank's word, from the relay's thread."""
        now = time.time()
        if kind == "stop" and self._heard_at is None:
            self._heard_signal_at = at
            self._heard_from = rank
            self._heard_at = now
        elif kind == "notice":
            self._take_notice(now)

    def _start_relay(self) -> None:
        """Join the gang's relay, once, when the process group is there to carry it."""
        if self._relay is not None or self._relay_tried or not self._distributed():
            return
        self._relay_tried = True
        try:
            self._relay = GangRelay(rank=self.rank(), attempt=self.attempt, on_word=self._heard)
        except Exception as error:
            # Without it the all-reduce at each step still carries every stop.
            print(f"gracetrap: no relay between the ranks: {error}", file=sys.stderr, flush=True)
            return
        self._say_stop()

    def _end_relay(self) -> None:
        """At the gang's shutdown, where every rank is: rank 0's word ends every rank's
        relay thread; a rank that does not hear it in time ends its own."""
        relay = self._relay
        if relay is None:
            return
        if self.rank() == 0:
            relay.end()
        if not relay.join(JOIN_SECONDS):
            relay.stop()

    def _stop_relay(self) -> None:
        if self._relay is not None:
            self._relay.stop()

    def _start_notice_poll(self) -> NoticePoller | None:
        """Where the runtime cannot signal the ranks (``QM_NOTICE_POLL_SECONDS``), rank 0
        asks the events URL for the notice; the all-reduce in ``should_stop`` takes it
        to the other ranks, so one asking rank per gang is enough."""
        interval = protocol.parse_poll_seconds(env(protocol.NOTICE_POLL_ENV))
        url, token = self.events.events_url, self.events.events_token
        # Every rank takes a polled notice (from rank 0, through the all-reduce).
        self._notice_by_poll = interval is not None and url is not None and token is not None
        if interval is None or url is None or token is None or (env_int("RANK") or 0) != 0:
            return None
        return NoticePoller(
            events_url=url, events_token=token, interval=interval, on_notice=self._notice_polled
        ).start()

    def _notice_polled(self, at: float) -> None:
        # Runs in the poll thread: the same path as the notice signal's handler, and
        # only rank 0 polls, so it passes the notice on to the others at once.
        if self._take_notice(at) and self._relay is not None:
            self._relay.say("notice", at)

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
        if self._heard_at is not None and not self._heard_reported:
            self._heard_reported = True
            self.events.emit(
                "stop_heard",
                at=self._heard_at,
                from_rank=self._heard_from,
                signalled_at=self._heard_signal_at,
            )

    @property
    def stop_requested(self) -> bool:
        """True once this rank was signalled or heard from the relay that another was:
        the next ``should_stop`` returns True on every rank."""
        return self._signal_at is not None or self._heard_at is not None

    def _report_signal_at_exit(self) -> None:
        if self._signal_at is not None and not self._signal_reported and os.getpid() == self._pid:
            self._report_signal()
            self.events.flush(POST_TIMEOUT_SECONDS)
            sys.stdout.flush()

    def _ignore_stop_signals_at_exit(self) -> None:
        """The trap's last exit handler: from here on its signals are ignored.

        As the interpreter finalizes, after the exit handlers, it puts the default
        action back on every signal that has a Python handler, and the default action
        of SIGTERM (and of the notice's SIGUSR2) ends the process. A rank's own signal
        that came then (on Kubernetes each pod is evicted by its own call, often after
        the gang already stopped on another rank's) turned the clean exit of a rank
        that had saved into death by signal: 143 instead of 0. An ignored signal stays
        ignored through finalization. Only signals still on the trap's handlers: a
        trap closed without exiting has put the previous ones back."""
        if os.getpid() != self._pid:
            return
        for signum in self.signals:
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, signal.SIG_IGN)
        notice = self.notice_signal
        if notice is not None and signal.getsignal(notice) == self._on_notice:
            signal.signal(notice, signal.SIG_IGN)

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
        return env_int("RANK") or 0

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
