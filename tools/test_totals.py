"""Print the closing lines for all the pytest runs of `make test` together.

`make test` runs pytest more than once (the suite on PostgreSQL, the embedded
default's modules again on SQLite, the `make run` smoke), and each run closes with
its own count; this sums the JUnit reports the runs wrote, so the last lines say
which tests were slowest across the runs and how many tests passed in all. The runs
go on pytest-xdist workers, so a test's time is its own (setup, call and teardown),
not its share of the wall clock."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

SLOWEST = 10


def main(paths: list[str]) -> int:
    tests = failed = skipped = 0
    timings: list[tuple[float, str]] = []
    for path in paths:
        root = ElementTree.parse(path).getroot()
        run = Path(path).stem
        for suite in root.iter("testsuite"):
            tests += int(suite.get("tests", 0))
            failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skipped += int(suite.get("skipped", 0))
        for case in root.iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')} ({run})"
            timings.append((float(case.get("time", 0)), name))
    print(f"{len(paths)} pytest runs; the {SLOWEST} slowest tests:")
    for seconds, name in sorted(timings, reverse=True)[:SLOWEST]:
        print(f"{seconds:8.2f} s  {name}")
    passed = tests - failed - skipped
    print(f"total: {passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    return 1 if failed or not tests else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
