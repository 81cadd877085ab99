"""Print one closing line for all the pytest runs of `make test` together.

`make test` runs pytest more than once (the suite on PostgreSQL, the embedded
default's modules again on SQLite, the `make run` smoke), and each run closes with
its own count; this sums the JUnit reports the runs wrote, so the last line says
how many tests passed in all."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree


def main(paths: list[str]) -> int:
    tests = failed = skipped = 0
    for path in paths:
        root = ElementTree.parse(path).getroot()
        for suite in root.iter("testsuite"):
            tests += int(suite.get("tests", 0))
            failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skipped += int(suite.get("skipped", 0))
    passed = tests - failed - skipped
    print(f"{len(paths)} pytest runs")
    print(f"total: {passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    return 1 if failed or not tests else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
