"""One drill round that meets every target, for the drill result tests to vary."""

from __future__ import annotations

from drills.result import RoundFigures

GOOD = RoundFigures(
    borrower_job=7,
    critical_job=8,
    borrower_state="succeeded",
    signal_propagation_seconds=0.31,
    signal_latency_seconds=[0.30, 0.31],
    signals_received=2,
    checkpoint_seconds=2.5,
    checkpoint_step=15,
    checkpoint_committed=True,
    outcome="graceful",
    exit_codes=[0, 0],
    orphaned_ports=0,
    restart_integrity=True,
    restart_max_abs_diff=0.0,
    recovery_seconds=12.0,
    utilization=0.8,
    ranks_told=2,
)
