"""Trace replay: measure what fair-share lending buys, on real and synthetic cluster traces.

The simulator replays a job trace through the real :func:`fairshare.plan` in simulated time
(:mod:`simulation.engine`) and reports allocation, completion times, time below guarantees,
borrowing, lending and preemptions (:mod:`simulation.report`).  :func:`run_simulation` takes the
options of ``python -m simulation`` / ``manage.py simulate``; :func:`main` is that command line.
"""

from simulation.cli import add_arguments, main, run_simulation
from simulation.engine import Progress, SimulationConfig, simulate
from simulation.report import Report

__all__ = [
    "Progress",
    "Report",
    "SimulationConfig",
    "add_arguments",
    "main",
    "run_simulation",
    "simulate",
]
