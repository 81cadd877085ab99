"""The complete example in gracetrap/README.md runs as written, and resumes."""

from __future__ import annotations

import re
from pathlib import Path

from gracetrap_gang import REPO, launch, step_dirs


def test_the_readme_example_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    readme = (REPO / "gracetrap" / "README.md").read_text()
    example = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)[0]
    assert "TOTAL_STEPS = 10_000" in example and "(step + 1) % 500 == 0" in example
    # Shorter, so that the test stays quick: 120 steps, a checkpoint every 50.
    shorter = example.replace("TOTAL_STEPS = 10_000", "TOTAL_STEPS = 120")
    script = tmp_path / "readme_example.py"
    script.write_text(shorter.replace("(step + 1) % 500 == 0", "(step + 1) % 50 == 0"))
    checkpoint_dir = tmp_path / "checkpoints"

    first = launch(2, checkpoint_dir, tmp_path / "logs", [], script=script)
    try:
        assert first.wait(timeout=180) == [0, 0], first.tail()
    finally:
        first.kill()
    assert step_dirs(checkpoint_dir) == {49: True, 99: True}
    for rank in first.ranks:
        committed = [e["step"] for e in rank.events() if e["event"] == "checkpoint_committed"]
        assert committed == [49, 99]

    second = launch(2, checkpoint_dir, tmp_path / "logs", [], script=script, attempt=2)
    try:
        assert second.wait(timeout=180) == [0, 0], second.tail()
    finally:
        second.kill()
    for rank in second.ranks:
        assert [e["step"] for e in rank.events() if e["event"] == "resumed"] == [100]
