"""SIGKILL of a real two-rank gang at any moment of its background saves, many times:
the newest complete checkpoint always loads and is the one the next attempt resumes
from, ``latest`` (when written) names a complete checkpoint that loads, and every
resumed step is bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from gracetrap.checkpoints import is_complete, step_dir
from gracetrap_gang import LineServer, free_port, load_example, step_dirs

from gracetrap import Trap

train_ddp = load_example()

WORLD_SIZE = 2
MODEL_ARGS = ["--hidden", "1024", "--layers", "3"]
STEPS = 200
TRIALS = 12
SERVER = Path(__file__).with_name("gracetrap_rank_forkserver.py")


class RankServer(LineServer):
    """gracetrap_rank_forkserver.py for one rank, its output read line by line."""

    def __init__(self, rank: int, args: list[str]) -> None:
        super().__init__(
            [str(SERVER), str(rank), str(WORLD_SIZE), *args],
            cwd=SERVER.parent,
            env={"PYTHONUNBUFFERED": "1"},
        )

    def start(self, checkpoint_dir: Path, port: int, steps: int, extra: str, more: str = "") -> int:
        return self.send(f"{checkpoint_dir} {port} {steps} {extra} {more}")


def _losses(lines: list[str]) -> dict[int, str]:
    found = {}
    for line in lines:
        parts = line.split()
        if len(parts) == 8 and parts[0] == "STEP":
            found[int(parts[1])] = parts[7]
    return found


def _load_in_this_process(checkpoint_dir: Path, step: int) -> None:
    arguments = train_ddp.parse_args(MODEL_ARGS)
    model = train_ddp.build_model(arguments)
    optimizer = train_ddp.torch.optim.Adam(model.parameters(), lr=arguments.lr)
    with Trap(checkpoint_dir, {"model": model, "optimizer": optimizer}, signals=()) as trap:
        trap._load(step_dir(checkpoint_dir, step), step)


def _resumable_step(checkpoint_dir: Path) -> int:
    """Load what a resume would load, in this process; return its step (-1 for none).

    A resume takes the newest complete checkpoint. ``latest`` is written after the
    checkpoint it names is complete, so a kill between the two leaves a complete
    checkpoint newer than ``latest`` (or no ``latest`` at all before the first
    pointer): never a pointer to an incomplete folder.
    """
    complete = sorted(step for step, done in step_dirs(checkpoint_dir).items() if done)
    pointer = checkpoint_dir / "latest"
    if pointer.exists():
        latest = json.loads(pointer.read_text())
        path = step_dir(checkpoint_dir, latest["step"])
        assert path.name == latest["path"] and is_complete(path), latest
        # One background save is in flight at a time: at most one commit is ahead.
        assert latest["step"] in complete[-2:], (latest, complete)
        _load_in_this_process(checkpoint_dir, latest["step"])
    else:
        # Only the first commit can be caught between its folder and its pointer.
        assert len(complete) <= 1, complete
    if not complete:
        return -1
    _load_in_this_process(checkpoint_dir, complete[-1])
    return complete[-1]


@pytest.mark.slow
def test_sigkill_during_background_saves_always_leaves_the_checkpoint_the_next_attempt_resumes(
    tmp_path: Path,
) -> None:
    servers = [RankServer(rank, MODEL_ARGS) for rank in range(WORLD_SIZE)]
    try:
        # The uninterrupted run, without saves: the loss of every step on every rank.
        reference: list[dict[int, str]] = []
        port = free_port()
        for server in servers:
            server.start(tmp_path / "reference", port, STEPS, "-")
        for server in servers:
            line, lines = server.expect("EXIT ", timeout=300)
            assert line == "EXIT 0", lines[-20:]
            reference.append(_losses(lines))
        assert all(len(losses) == STEPS for losses in reference)

        checkpoint_dir = tmp_path / "checkpoints"
        # A background save after every step, each waiting for the previous one.
        extra = "QM_ASYNC_SAVES=1,QM_GRACE_SECONDS=60"
        in_flight_at_kill = 0
        resumed_from = []
        # The first step the next attempt must resume at: after the newest complete one.
        expected_resume = 0
        for trial in range(TRIALS):
            port = free_port()
            children = [
                server.start(checkpoint_dir, port, STEPS, extra, "--save-every 1")
                for server in servers
            ]
            early = []
            for server in servers:
                line, lines = server.expect("STEP ", timeout=120)
                early.append([*lines, line])
            # Kills spread over two seconds after the first step of the attempt.
            time.sleep(2.0 * (trial % TRIALS) / TRIALS)
            for child in children:
                os.kill(child, signal.SIGKILL)
            for rank, server in enumerate(servers):
                line, lines = server.expect("EXIT ", timeout=60)
                lines = early[rank] + lines
                assert line == f"EXIT {-signal.SIGKILL}", lines[-20:]
                assert not any("Traceback" in text for text in lines), lines
                # Every step this attempt trained is bit-identical to the reference.
                for step, loss in _losses(lines).items():
                    assert loss == reference[rank][step], (trial, rank, step)
                events = [json.loads(t.split(" ", 1)[1]) for t in lines if t.startswith("QM_EVENT")]
                resumed = [e["step"] for e in events if e["event"] == "resumed"]
                assert (resumed[0] if resumed else 0) == expected_resume, (trial, resumed)
                if rank == 0:
                    resumed_from.append(resumed[0] if resumed else 0)
            dirs = step_dirs(checkpoint_dir)
            in_flight_at_kill += any(not complete for complete in dirs.values())
            resumable = _resumable_step(checkpoint_dir)
            expected_resume = resumable + 1
            print(f"trial {trial:2d}: resumable {resumable}, folders {sorted(dirs.items())}")
        # Each attempt went on from where the previous one's newest checkpoint was.
        assert resumed_from == sorted(resumed_from) and resumed_from[-1] > 0, resumed_from
        print(f"{in_flight_at_kill} of {TRIALS} kills came while a write was in flight")
        assert in_flight_at_kill >= TRIALS // 3
    finally:
        for server in servers:
            server.close()
