"""SIGKILL at any moment of a save never leaves an unloadable newest checkpoint."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from gracetrap_gang import LineServer, load_example, step_dirs

from gracetrap import Trap

train_ddp = load_example()

MODEL_ARGS = ["--hidden", "1024", "--layers", "3"]
MIN_TRIALS = 20
MAX_TRIALS = 40
FORKSERVER = Path(__file__).with_name("gracetrap_forkserver.py")


class ForkServer(LineServer):
    """The trial server of gracetrap_forkserver.py, with its output read line by line."""

    def __init__(self) -> None:
        super().__init__([str(FORKSERVER), *MODEL_ARGS], cwd=FORKSERVER.parent, env={})

    def start_trial(self, checkpoint_dir: Path) -> int:
        return self.send(str(checkpoint_dir))

    def started_event(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            line, _ = self.expect("QM_EVENT ", timeout=max(0.0, deadline - time.monotonic()))
            event: dict[str, Any] = json.loads(line.split(" ", 1)[1])
            if event["event"] == "checkpoint_started":
                return event


def _resume_in_this_process(checkpoint_dir: Path) -> int:
    arguments = train_ddp.parse_args(MODEL_ARGS)
    model = train_ddp.build_model(arguments)
    optimizer = train_ddp.torch.optim.Adam(model.parameters(), lr=arguments.lr)
    with Trap(checkpoint_dir, {"model": model, "optimizer": optimizer}) as trap:
        return trap.resume()


def _newest_complete(checkpoint_dir: Path) -> int:
    return max([-1, *(step for step, done in step_dirs(checkpoint_dir).items() if done)])


@pytest.mark.slow
def test_sigkill_during_saves_always_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    checkpoint_dir = tmp_path / "checkpoints"
    server = ForkServer()
    try:
        # Three saves that are left to finish: they measure how long a save takes on
        # this disk now, from its start until its metadata file exists (the moment it
        # commits), and leave complete checkpoints for the kills to threaten.
        durations = []
        for _ in range(3):
            child = server.start_trial(checkpoint_dir)
            started = server.started_event(timeout=120)
            metadata = checkpoint_dir / f"step_{started['step']}" / ".metadata"
            deadline = time.monotonic() + 120
            while not metadata.exists():
                assert time.monotonic() < deadline, "the calibration save never committed"
                time.sleep(0.001)
            durations.append(time.time() - started["at"])
            server.expect("SAVED ", timeout=120)
            os.kill(child, signal.SIGKILL)
            server.expect("EXIT ", timeout=30)
        # The quickest: the first save of a fresh process is often several times slower
        # (0.81 s against 0.15 s once), and kills spread over a save that long came
        # mostly after the commit.
        save_seconds = min(durations)
        print(f"\nmeasured save interval (start to metadata): {save_seconds:.3f} s {durations}")

        before_metadata = 0
        trials = 0
        while trials < MIN_TRIALS or before_metadata < MIN_TRIALS // 2:
            assert trials < MAX_TRIALS, f"only {before_metadata} of {trials} kills came early"
            # Offsets spread from the save's start to a little past its expected commit.
            offset = save_seconds * 1.25 * (trials % MIN_TRIALS) / MIN_TRIALS
            expected_resume = _newest_complete(checkpoint_dir) + 1
            child = server.start_trial(checkpoint_dir)
            started = server.started_event(timeout=120)
            time.sleep(max(0.0, started["at"] + offset - time.time()))
            os.kill(child, signal.SIGKILL)
            killed_after = time.time() - started["at"]
            exit_line, lines = server.expect("EXIT ", timeout=30)
            assert exit_line == f"EXIT {-signal.SIGKILL}"
            assert not any("Traceback" in line for line in lines), lines
            # The child resumed from the newest complete checkpoint before saving.
            assert started["step"] == expected_resume

            complete_at_kill = step_dirs(checkpoint_dir).get(started["step"], False)
            before_metadata += not complete_at_kill
            if complete_at_kill:
                # This save committed sooner than the kill: the offsets that follow
                # spread over no more than that.
                save_seconds = min(save_seconds, killed_after)
            trials += 1
            print(
                f"trial {trials:2d}: SIGKILL {killed_after:.3f} s into the save of step "
                f"{started['step']} (target {offset:.3f} s): metadata "
                f"{'written' if complete_at_kill else 'absent'}"
            )
            assert _resume_in_this_process(checkpoint_dir) == _newest_complete(checkpoint_dir) + 1
        print(f"{before_metadata} of {trials} kills came before the metadata file existed")
    finally:
        server.close()
