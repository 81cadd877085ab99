"""The trap: catch the preemption signal, agree on a step, checkpoint, exit cleanly."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from datetime import timedelta
from types import TracebackType
from typing import NoReturn

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from gracetrap import protocol
from gracetrap.base import DEFAULT_SIGNALS
from gracetrap.environment import env, env_int
from gracetrap.events import POST_TIMEOUT_SECONDS
from gracetrap.gloo import skip_the_last_collections
from gracetrap.ports import release_rendezvous_port
from gracetrap.stopping import TrapStopping


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
        notice = protocol.parse_notice_signal(env(protocol.NOTICE_SIGNAL_ENV))
    except ValueError:
        notice = protocol.DEFAULT_NOTICE_SIGNAL
    if notice is not None:
        signal.signal(notice, signal.SIG_IGN)


class Trap(TrapStopping):
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
        skip_the_last_collections()
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
        # Before the barrier: once past it rank 0 may leave, and its store with it.
        self._end_relay()
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
        port = env_int("MASTER_PORT")
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
        self._stop_relay()
        self.restore_signal_handlers()
        self._signal_watch.close()
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
