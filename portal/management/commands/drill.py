"""`manage.py drill`: preempt a distributed training job with a critical one
and measure every part of the graceful path (see drills/harness.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from drills.elastic import run_elastic_drill
from drills.harness import DrillError, run_drill
from portal.database import require_migrated_database


class Command(BaseCommand):
    help = "Run the preemption drill on this installation and report what it measured."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--ranks",
            type=int,
            default=None,
            help="ranks of the borrower's job (default 16; 8 with --elastic)",
        )
        parser.add_argument(
            "--grace",
            type=float,
            default=None,
            help="grace seconds of the borrower (default: its class's)",
        )
        parser.add_argument("--runtime", choices=["local", "kubernetes"], default="local")
        parser.add_argument(
            "--chaos",
            type=int,
            default=0,
            metavar="N",
            help="repeat N times with random disturbances",
        )
        parser.add_argument(
            "--steps", type=int, default=120, help="training steps of the borrower's job"
        )
        parser.add_argument(
            "--critical-seconds", type=float, default=30.0, help="how long the critical job runs"
        )
        parser.add_argument(
            "--critical-at-step",
            type=int,
            default=None,
            metavar="STEP",
            help="submit the critical job once the borrower reaches this step (default: three "
            "quarters of --steps); the steps after it are the eviction's time to land",
        )
        parser.add_argument("--seed", type=int, default=None, help="seed of the chaos choices")
        parser.add_argument(
            "--notice",
            choices=["on", "off", "both"],
            default="on",
            help="the checkpoint notice before the eviction: on, off, or both to compare "
            "(chaos rounds alternate)",
        )
        parser.add_argument(
            "--elastic",
            action="store_true",
            help="the elastic drill instead: the borrower (--ranks, default 8) is shrunk to "
            "half by a reclaim and grown back, and checked sample for sample against an "
            "uninterrupted run",
        )
        parser.add_argument(
            "--json", dest="json_path", default=None, help="write the result as JSON here"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        require_migrated_database(command="drill")
        if options["elastic"]:
            self._elastic(options)
            return
        try:
            result = run_drill(
                ranks=options["ranks"] or 16,
                grace=options["grace"],
                runtime=options["runtime"],
                chaos=options["chaos"],
                seed=options["seed"],
                steps=options["steps"],
                critical_seconds=options["critical_seconds"],
                critical_at_step=options["critical_at_step"],
                notice=options["notice"],
                say=lambda line: self.stdout.write(line),
            )
        except DrillError as exc:
            raise CommandError(str(exc)) from exc
        self._report(result.to_json(), options["json_path"])
        compared = result.notice_figures()
        if compared is not None:
            lost, free = compared["lost_gpu_seconds"], compared["time_to_free_seconds"]
            stall_sync, stall_async = (
                compared["stall_sync_seconds"],
                compared["stall_async_seconds"],
            )
            self.stdout.write(
                "checkpoint notice, with vs without: "
                f"lost GPU-seconds {lost['with']} vs {lost['without']} "
                f"(share {compared['lost_work_share']}); "
                f"decision to GPUs free {free['with']} s vs {free['without']} s; "
                f"stall per checkpoint {stall_async['with']} s in the background "
                f"vs {stall_sync['without']} s synchronous"
            )
        verdict = "PASSED" if result.passed else "FAILED"
        style = self.style.SUCCESS if result.passed else self.style.ERROR
        self.stdout.write(style(f"drill {verdict}"))
        if not result.passed:
            raise CommandError(f"the drill did not meet its targets: {'; '.join(result.missed())}")

    def _elastic(self, options: dict[str, Any]) -> None:
        ranks = options["ranks"] or 8
        try:
            result = run_elastic_drill(
                ranks=ranks,
                runtime=options["runtime"],
                say=lambda line: self.stdout.write(line),
            )
        except DrillError as exc:
            raise CommandError(str(exc)) from exc
        self._report(result.to_json(), options["json_path"])
        for resize in result.resizes:
            self.stdout.write(
                f"{resize.cause}: GPUs free {resize.time_to_free_seconds} s after the decision, "
                f"resumed at step {resize.resumed_step} after {resize.time_to_resume_seconds} s, "
                f"{resize.steps_run_again} steps run again, "
                f"{resize.idle_gpu_seconds} GPU-seconds idle on the GPUs it kept"
            )
        check = result.samples
        self.stdout.write(
            f"samples: {check.samples_seen} of {check.samples_expected} seen, "
            f"{'exactly as' if check.exact else 'NOT as'} the uninterrupted run; final loss "
            f"{check.loss_relative_difference:.2e} apart (relative)"
        )
        style = self.style.SUCCESS if result.passed else self.style.ERROR
        self.stdout.write(style(f"elastic drill {'PASSED' if result.passed else 'FAILED'}"))
        if not result.passed:
            raise CommandError(f"the elastic drill missed: {'; '.join(result.missed())}")

    def _report(self, document: dict[str, Any], json_path: str | None) -> None:
        """Print the result's document, and write it to ``json_path`` when given."""
        text = json.dumps(document, indent=2, default=str)
        if json_path:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(json_path).write_text(text + "\n")
        self.stdout.write(text)
