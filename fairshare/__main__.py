"""Command line: ``python -m fairshare plan scenario.json`` and ``... diff scenario.json changes.json``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from .engine import plan
from .model import ScenarioError
from .scenario import changes_from_list, consequences_to_dict, plan_to_dict, snapshot_from_dict
from .whatif import diff


def _load(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except OSError as error:
        raise ScenarioError(f"{path}: cannot read: {error.strerror}") from error
    except json.JSONDecodeError as error:
        raise ScenarioError(f"{path}: not valid JSON: {error}") from error


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 for malformed input)."""
    parser = argparse.ArgumentParser(
        prog="python -m fairshare", description="Plan a GPU cluster with the fair-share engine."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    plan_command = commands.add_parser("plan", help="print the plan for a scenario as JSON")
    plan_command.add_argument("scenario")
    diff_command = commands.add_parser(
        "diff", help="print what a list of quota changes would do to a scenario"
    )
    diff_command.add_argument("scenario")
    diff_command.add_argument("changes")
    args = parser.parse_args(argv)
    try:
        snapshot = snapshot_from_dict(_load(args.scenario))
        if args.command == "plan":
            output = plan_to_dict(plan(snapshot))
        else:
            output = consequences_to_dict(diff(snapshot, changes_from_list(_load(args.changes))))
    except ScenarioError as error:
        print(f"fairshare: {error}", file=sys.stderr)
        return 2
    json.dump(output, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
