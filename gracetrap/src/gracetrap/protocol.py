"""The scheduler side of the protocol in plain Python: variable names, the checkpoint
notice signal and the checkpoint cadence. No torch here, so that a control plane can
import it (like ``gracetrap.events``) without pulling in PyTorch.

The cadence is the Young/Daly optimum: with a checkpoint costing ``C`` seconds of
training and preemptions arriving on average every ``M`` seconds, checkpointing every
``sqrt(2 * C * M)`` seconds minimises the expected sum of checkpoint overhead and work
lost to the next preemption (Young 1974, Daly 2006).
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Mapping
from pathlib import Path

PROTOCOL_VERSION = 1

# Set by the scheduler in every rank's environment.
NOTICE_SIGNAL_ENV = "QM_NOTICE_SIGNAL"
MTBP_ENV = "QM_PREEMPTION_MTBP"
MTBP_FILE_ENV = "QM_PREEMPTION_MTBP_FILE"
ASYNC_SAVES_ENV = "QM_ASYNC_SAVES"
# Set by a runtime that cannot signal its ranks (Kubernetes): the trap asks for the
# checkpoint notice by GET on QM_EVENTS_URL, with QM_EVENTS_TOKEN, every this many
# seconds. Twice a second keeps the notice within the second the protocol promises.
NOTICE_POLL_ENV = "QM_NOTICE_POLL_SECONDS"
NOTICE_POLL_SECONDS = 0.5

DEFAULT_NOTICE_SIGNAL = signal.SIGUSR2
_OFF = frozenset({"0", "off", "no", "none", "false"})
_ON = frozenset({"1", "on", "yes", "true"})

# The scheduler delivers a notice to every rank within a second; a notice that reaches
# a rank less than this long after the ranks answered one is the same notice.
NOTICE_COALESCE_SECONDS = 1.0


def parse_notice_signal(value: str | int | None) -> signal.Signals | None:
    """The notice signal from ``QM_NOTICE_SIGNAL``: a name (``SIGUSR2``, ``USR2``), a number,
    or ``off``; None or empty means the default, SIGUSR2."""
    if value is None:
        return DEFAULT_NOTICE_SIGNAL
    if isinstance(value, int):
        return signal.Signals(value)
    text = value.strip()
    if not text:
        return DEFAULT_NOTICE_SIGNAL
    if text.lower() in _OFF:
        return None
    if text.isdigit():
        try:
            return signal.Signals(int(text))
        except ValueError:
            raise ValueError(f"{NOTICE_SIGNAL_ENV}={value!r} is not a signal number") from None
    name = text.upper()
    if not name.startswith("SIG"):
        name = f"SIG{name}"
    try:
        return signal.Signals[name]
    except KeyError:
        raise ValueError(f"{NOTICE_SIGNAL_ENV}={value!r} is not a signal name") from None


def parse_poll_seconds(value: str | None) -> float | None:
    """The notice poll interval from ``QM_NOTICE_POLL_SECONDS``: None (no polling) when
    unset, empty or ``off``; otherwise a positive number of seconds."""
    if value is None or not value.strip() or value.strip().lower() in _OFF:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{NOTICE_POLL_ENV}={value!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{NOTICE_POLL_ENV}={value!r} must be a positive number of seconds")
    return seconds


def parse_flag(name: str, value: str | None) -> bool | None:
    """A yes/no variable: None when unset or empty."""
    if value is None or not value.strip():
        return None
    text = value.strip().lower()
    if text in _ON:
        return True
    if text in _OFF:
        return False
    raise ValueError(f"{name}={value!r} is neither on (1, yes, true) nor off (0, no, false)")


def parse_mtbp(source: str, text: str) -> float | None:
    """Mean time between preemptions in seconds; empty means no hint."""
    text = text.strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{source}={text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{source}={text!r} must be a positive, finite number of seconds")
    return value


class MtbpHint:
    """The preemption-risk hint: ``QM_PREEMPTION_MTBP_FILE`` if set, else ``QM_PREEMPTION_MTBP``.

    The scheduler may rewrite the file while the job runs (write a temporary file and
    rename it over the old one); it is read again whenever its modification time
    changes. A file that is missing or unreadable right now keeps the last good value.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        file = env.get(MTBP_FILE_ENV, "").strip()
        self.path = Path(file) if file else None
        self._value = parse_mtbp(MTBP_ENV, env.get(MTBP_ENV, ""))
        self._stamp: tuple[int, int] | None = None

    def seconds(self) -> float | None:
        """The current mean time between preemptions, or None without a hint."""
        if self.path is None:
            return self._value
        try:
            stat = self.path.stat()
            stamp = (stat.st_mtime_ns, stat.st_ino)
            if stamp != self._stamp:
                self._value = parse_mtbp(str(self.path), self.path.read_text())
                self._stamp = stamp
        except (OSError, ValueError):
            pass
        return self._value


def checkpoint_interval(
    save_cost: float, mtbp: float | None, *, write_seconds: float = 0.0
) -> float | None:
    """Seconds between regular checkpoints, or None (no regular checkpoints) without a hint.

    ``save_cost`` is what a checkpoint costs training (the whole save when synchronous,
    the stall when asynchronous); ``write_seconds`` is how long the write itself takes,
    a floor for the interval, since a save waits for the previous one.
    """
    if mtbp is None:
        return None
    if save_cost < 0 or mtbp <= 0:
        raise ValueError("the save cost must be non-negative and the MTBP positive")
    return max(math.sqrt(2.0 * save_cost * mtbp), write_seconds)
