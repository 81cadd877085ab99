"""The scheduler-facing protocol as pure logic: notice signal, risk hint, cadence rule."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from gracetrap.protocol import (
    DEFAULT_NOTICE_SIGNAL,
    MTBP_ENV,
    MTBP_FILE_ENV,
    MtbpHint,
    checkpoint_interval,
    parse_flag,
    parse_notice_signal,
)


def test_the_interval_is_the_young_daly_optimum() -> None:
    # sqrt(2 * 10 s * 3600 s) = sqrt(72000) = 268.3 s
    assert checkpoint_interval(10.0, 3600.0) == pytest.approx(268.328, abs=1e-3)
    # Four times the risk halves the interval; four times the cost doubles it.
    assert checkpoint_interval(10.0, 900.0) == pytest.approx(268.328 / 2, abs=1e-3)
    assert checkpoint_interval(40.0, 3600.0) == pytest.approx(268.328 * 2, abs=1e-3)
    # A job well inside its guarantee checkpoints rarely, a borrower often.
    rarely = checkpoint_interval(2.0, 7 * 24 * 3600.0)
    often = checkpoint_interval(2.0, 600.0)
    assert rarely is not None and often is not None and rarely > 20 * often


def test_the_interval_never_undercuts_the_write_and_is_none_without_a_hint() -> None:
    # An asynchronous save stalls for 0.1 s but writes for 30 s: saving more often
    # than every 30 s would only make saves wait for each other.
    assert checkpoint_interval(0.1, 60.0, write_seconds=30.0) == 30.0
    assert checkpoint_interval(0.1, 60.0) == pytest.approx(math.sqrt(12.0))
    assert checkpoint_interval(5.0, None) is None
    assert checkpoint_interval(0.0, 100.0) == 0.0
    with pytest.raises(ValueError):
        checkpoint_interval(-1.0, 100.0)
    with pytest.raises(ValueError):
        checkpoint_interval(1.0, 0.0)


def test_the_notice_signal_is_named_numbered_defaulted_or_off() -> None:
    assert DEFAULT_NOTICE_SIGNAL == signal.SIGUSR2
    assert parse_notice_signal(None) == signal.SIGUSR2
    assert parse_notice_signal("") == signal.SIGUSR2
    assert parse_notice_signal("SIGUSR2") == signal.SIGUSR2
    assert parse_notice_signal("usr1") == signal.SIGUSR1
    assert parse_notice_signal(str(int(signal.SIGHUP))) == signal.SIGHUP
    assert parse_notice_signal(int(signal.SIGWINCH)) == signal.SIGWINCH
    for off in ("off", "OFF", "0", "none", "no"):
        assert parse_notice_signal(off) is None
    for bad in ("SIGNOPE", "usr3", "999"):
        with pytest.raises(ValueError, match="QM_NOTICE_SIGNAL"):
            parse_notice_signal(bad)


def test_flags_accept_yes_and_no_only() -> None:
    assert parse_flag("X", None) is None and parse_flag("X", " ") is None
    assert parse_flag("X", "1") is True and parse_flag("X", "Yes") is True
    assert parse_flag("X", "0") is False and parse_flag("X", "false") is False
    with pytest.raises(ValueError, match="X='maybe'"):
        parse_flag("X", "maybe")


def test_the_hint_comes_from_the_variable_or_a_file_the_scheduler_rewrites(
    tmp_path: Path,
) -> None:
    assert MtbpHint({}).seconds() is None
    assert MtbpHint({MTBP_ENV: "1800"}).seconds() == 1800.0
    for bad in ("soon", "-5", "0", "inf", "nan"):
        with pytest.raises(ValueError, match=MTBP_ENV):
            MtbpHint({MTBP_ENV: bad})

    hint_file = tmp_path / "mtbp"
    hint = MtbpHint({MTBP_FILE_ENV: str(hint_file), MTBP_ENV: "1800"})
    # A file that is not there yet keeps the variable's value.
    assert hint.seconds() == 1800.0
    hint_file.write_text("600\n")
    assert hint.seconds() == 600.0
    # Rewritten the way a scheduler does it: a new file renamed over the old one.
    replacement = tmp_path / "mtbp.new"
    replacement.write_text("45.5")
    os.replace(replacement, hint_file)
    assert hint.seconds() == 45.5
    # A garbled rewrite keeps the last good value rather than stopping checkpoints.
    replacement.write_text("garbage")
    os.replace(replacement, hint_file)
    assert hint.seconds() == 45.5
    hint_file.unlink()
    assert hint.seconds() == 45.5


def test_the_event_names_and_the_protocol_import_without_torch() -> None:
    code = (
        "import sys\n"
        "from gracetrap.events import EVENT_NAMES\n"
        "from gracetrap.protocol import checkpoint_interval, NOTICE_SIGNAL_ENV\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print(' '.join(EVENT_NAMES))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "trap_ready",
        "cadence",
        "notice_received",
        "signal_received",
        "stop_heard",
        "checkpoint_started",
        "checkpoint_committed",
        "checkpoint_skipped",
        "exiting",
        "resumed",
    ]
