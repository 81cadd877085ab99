"""Run the trace replay: ``python -m simulation --help``."""

from simulation.cli import main

raise SystemExit(main())
