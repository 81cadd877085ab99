"""`manage.py simulate`: replay a job trace through the fair-share engine in
simulated time (see simulation/README.md) and keep the report for the
telemetry pages."""

from __future__ import annotations

import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from portal.database import require_migrated_database
from simulation import add_arguments, run_simulation
from simulation.traces import TraceError
from telemetry.models import SimulationRun


class Command(BaseCommand):
    help = "Replay a job trace through the fair-share engine and report allocation, delays and preemptions."

    def add_arguments(self, parser: Any) -> None:
        add_arguments(parser)
        parser.add_argument(
            "--no-store", action="store_true", help="do not keep the report for /telemetry/"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        store = not options.pop("no_store")
        if store:
            # Asked before the replay, which may take minutes, rather than
            # failing on the missing table once it is done.
            require_migrated_database(
                command="simulate", instead=" (or add --no-store to keep no report)"
            )
        wanted = {
            k: v
            for k, v in options.items()
            if k
            not in {
                "verbosity",
                "settings",
                "pythonpath",
                "traceback",
                "no_color",
                "force_color",
                "skip_checks",
            }
        }
        try:
            report = run_simulation(wanted, stderr=sys.stderr)
        except (TraceError, ValueError) as error:
            raise CommandError(str(error)) from error
        for line in report.summary_lines():
            self.stdout.write(line)
        if store:
            SimulationRun.objects.create(
                policy=str(wanted.get("policy", "")),
                trace=str(wanted.get("trace") or "synthetic")[:300],
                options={
                    k: (v if isinstance(v, int | float | str | bool | type(None)) else str(v))
                    for k, v in wanted.items()
                },
                report=report.to_dict(),
            )
