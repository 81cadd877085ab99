"""When a rank stops or checkpoints: the agreement on a stop after a signal or a
notice, the checkpoint cadence and the time a save and the grace window leave.
Calls a save where the notice asks for one; never exits the process.
"""

from __future__ import annotations

import math
import time

from torch.distributed.checkpoint.api import CheckpointException

from gracetrap import checkpoints, protocol
from gracetrap.saving import TrapSaving

# A `cadence` event is sent again when the interval moved by more than this fraction.
CADENCE_REPORT_FRACTION = 0.1


class TrapStopping(TrapSaving):
    """Decides, on every rank alike, when to stop and when to checkpoint."""

    # ---------------------------------------------------------------- stopping

    def should_stop(self, step: int) -> bool:
        """Call after every step on every rank: True on all ranks once any rank was signalled.

        Ranks agree through an all-reduce (MAX) of the flag, so they all stop after
        the same ``step`` even when the signal reached only one of them. The same
        all-reduce carries the checkpoint notice: when any rank received one, every
        rank saves ``step`` here (in the background when asynchronous saves are on)
        and training goes on. It also settles ``should_checkpoint(step)``.
        """
        self._start_relay()
        self._report_signal()
        self._report_notice()
        self._poll_background()
        due = 1.0 if self._due_locally(step) else 0.0
        notice_at = self._notice_at if self._notice_at is not None else -math.inf
        # Negated time: the maximum of -t is the earliest signal of any rank, which
        # starts the grace window for all of them. A rank that only heard of a signal
        # brings that rank's time.
        signalled_at = self._signal_at if self._signal_at is not None else self._heard_signal_at
        signal_at = -signalled_at if signalled_at is not None else -math.inf
        flag = 1.0 if self.stop_requested else 0.0
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
