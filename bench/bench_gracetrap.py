"""gracetrap benchmark: checkpoint throughput against the disk, and the cost of should_stop.

Saves a model with about 1 GB of state (parameters plus Adam's two moments) several
ways, each timed through fsync so that every figure is bytes on disk:

* ``dd`` writing the same number of bytes sequentially, and a plain sequential write
  of random bytes from Python: the disk's speed right now is the better of the two,
* a plain ``torch.save`` of the model and optimizer state dicts, then ``fsync``, with
  and without torch's per-record CRC32,
* ``Trap.save`` (torch.distributed.checkpoint, fsync of files, folder and pointer),
  with its default (no CRC32) and with ``checksums=True``, and once more right after
  a previous save, while that save's deletion of the older checkpoint runs,
* ``Trap.save`` in the background (``async_saves``): the stall it costs training
  (staging the state in host memory) and the background write's own time, alone and
  for a save that follows another at once (it waits for the first write first).

The repeats are interleaved so that a burst of other load on a shared disk hits every
method alike; medians are printed.

Then it times ``Trap.should_stop`` per step in one process and across two gloo ranks.

    .venv/bin/python bench/bench_gracetrap.py [--state-gb 1.0] [--repeats 3] [--dir DIR]

Goals (issues 4 and 17): the trap's save, and the background write, within 80% of
the disk's write speed; should_stop under 1 ms per step in a single process.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from gracetrap import Trap, parse_event_line

WIDTH = 4096


def build_state(state_gb: float) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """A stack of linear layers whose parameters plus Adam moments add up to ``state_gb``."""
    layer_bytes = (WIDTH * WIDTH + WIDTH) * 4 * 3
    layers = max(1, round(state_gb * 1e9 / layer_bytes))
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(1, WIDTH)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tensors = [*model.state_dict().values()]
    for moments in optimizer.state.values():
        tensors += [t for t in moments.values() if isinstance(t, torch.Tensor)]
    return model, optimizer, sum(t.numel() * t.element_size() for t in tensors)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def time_dd(directory: Path, nbytes: int) -> float:
    target = directory / "dd.bin"
    block = 16 << 20
    count = max(1, nbytes // block)
    started = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", f"bs={block}", f"count={count}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    elapsed = time.perf_counter() - started
    target.unlink()
    # dd wrote count * block bytes; scale to the state's size for a like-for-like time.
    return elapsed * nbytes / (count * block)


def time_raw_write(directory: Path, nbytes: int) -> float:
    """Sequential write of incompressible bytes from Python, then fsync.

    A second measure of the disk next to dd: virtual disks may treat dd's zeros
    differently from real data.
    """
    target = directory / "raw.bin"
    block = os.urandom(16 << 20)
    started = time.perf_counter()
    with open(target, "wb", buffering=0) as handle:
        written = 0
        while written < nbytes:
            written += handle.write(block[: min(len(block), nbytes - written)])
        os.fsync(handle.fileno())
    fsync_dir(directory)
    elapsed = time.perf_counter() - started
    target.unlink()
    return elapsed


def time_torch_save(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, crc32: bool
) -> float:
    target = directory / "plain.pt"
    torch.serialization.set_crc32_options(crc32)
    started = time.perf_counter()
    with open(target, "wb") as handle:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    fsync_dir(directory)
    elapsed = time.perf_counter() - started
    torch.serialization.set_crc32_options(True)
    target.unlink()
    return elapsed


def time_trap_save(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    threads: int,
    step: int,
    checksums: bool,
) -> tuple[float, int]:
    checkpoints = directory / f"trap-{threads}-{checksums}"
    trap = Trap(
        checkpoints,
        {"model": model, "optimizer": optimizer},
        keep=1,
        save_threads=threads,
        checksums=checksums,
        signals=(),
        stream=open(os.devnull, "w"),  # noqa: SIM115 - lives as long as the trap
    )
    started = time.perf_counter()
    trap.save(step)
    elapsed = time.perf_counter() - started
    nbytes = sum(f.stat().st_size for f in (checkpoints / f"step_{step}").iterdir())
    trap.close()
    return elapsed, nbytes


def time_trap_save_after_save(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int
) -> float:
    """A save right after another one, as when a preemption follows a regular save.

    With ``keep=1`` the first save starts deleting the checkpoint before it (1 GB
    from the previous repeat) in the background; the timed save runs while it does.
    """
    checkpoints = directory / "trap-back-to-back"
    trap = Trap(
        checkpoints,
        {"model": model, "optimizer": optimizer},
        keep=1,
        signals=(),
        stream=open(os.devnull, "w"),  # noqa: SIM115 - lives as long as the trap
    )
    trap.save(2 * step)
    started = time.perf_counter()
    trap.save(2 * step + 1)
    elapsed = time.perf_counter() - started
    trap.close()
    return elapsed


def background_trap(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, after: bool
) -> tuple[Trap, io.StringIO]:
    """A trap with background saves, kept across repeats as a training job keeps its
    trap (its staging buffers are then warm, as from a job's second save on)."""
    stream = io.StringIO()
    trap = Trap(
        directory / f"trap-background-{after}",
        {"model": model, "optimizer": optimizer},
        keep=1,
        async_saves=True,
        signals=(),
        stream=stream,
    )
    return trap, stream


def time_trap_background(
    trap: Trap, stream: io.StringIO, step: int, after: bool
) -> tuple[float, float]:
    """(stall, write seconds) of a background save; with ``after``, of one that follows
    another background save at once and so first waits for that one's write."""
    # Step 0 was the untimed first save; each repeat saves newer steps.
    if after:
        trap.save(2 * step + 1)
    started = time.perf_counter()
    trap.save(2 * step + 2)
    stall = time.perf_counter() - started
    trap.wait_for_save()
    events = [parse_event_line(line) for line in stream.getvalue().splitlines()]
    committed = [e for e in events if e is not None and e["event"] == "checkpoint_committed"]
    assert committed[-1]["step"] == 2 * step + 2
    return stall, float(committed[-1]["seconds"])


def should_stop_cost(steps: int) -> float:
    """Seconds per should_stop call in one process without a process group."""
    trap = Trap(None, signals=(), stream=open(os.devnull, "w"))  # noqa: SIM115
    started = time.perf_counter()
    for step in range(steps):
        trap.should_stop(step)
    elapsed = time.perf_counter() - started
    trap.close()
    return elapsed / steps


def _gloo_rank(
    rank: int, world_size: int, port: int, steps: int, results: dict[int, float]
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    trap = Trap(None, signals=(), stream=open(os.devnull, "w"))  # noqa: SIM115
    for step in range(100):
        trap.should_stop(step)
    dist.barrier()
    started = time.perf_counter()
    for step in range(steps):
        trap.should_stop(step)
    results[rank] = (time.perf_counter() - started) / steps
    dist.destroy_process_group()


def should_stop_cost_gloo(world_size: int, steps: int) -> float:
    """Seconds per should_stop call (an all-reduce) across ``world_size`` gloo ranks."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_gloo_rank, args=(world_size, port, steps, results), nprocs=world_size)
        return max(results.values())


def main() -> None:
    """Run every measurement and print figures and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-gb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--stop-steps", type=int, default=100_000)
    args = parser.parse_args()
    torch.set_num_threads(1)

    model, optimizer, state_bytes = build_state(args.state_gb)
    root = Path(tempfile.mkdtemp(prefix="bench-gracetrap-", dir=args.dir))
    print(f"state: {state_bytes / 1e9:.3f} GB (parameters + Adam moments), written to {root}")
    runs: dict[str, list[float]] = {}
    stalls: dict[str, list[float]] = {}
    background: dict[bool, tuple[Trap, io.StringIO]] = {}
    checkpoint_bytes = 0
    trap_variants = [(1, False), (1, True)]
    try:
        # Interleaved repeats, so that a burst of other load on the disk hits all alike.
        for index in range(args.repeats):
            runs.setdefault("dd sequential write", []).append(time_dd(root, state_bytes))
            runs.setdefault("Python sequential write", []).append(time_raw_write(root, state_bytes))
            for crc32 in (True, False):
                label = f"torch.save + fsync (CRC32 {'on' if crc32 else 'off'})"
                runs.setdefault(label, []).append(time_torch_save(root, model, optimizer, crc32))
            for threads, checksums in trap_variants:
                label = (
                    f"Trap.save, {threads} writer thread{'s' if threads > 1 else ''}, "
                    f"CRC32 {'on' if checksums else 'off'}"
                )
                elapsed, checkpoint_bytes = time_trap_save(
                    root, model, optimizer, threads, index, checksums
                )
                runs.setdefault(label, []).append(elapsed)
            runs.setdefault("Trap.save right after a save", []).append(
                time_trap_save_after_save(root, model, optimizer, index)
            )
            for after in (False, True):
                if after not in background:
                    background[after] = background_trap(root, model, optimizer, after)
                    # The first save allocates the staging buffers: not timed.
                    background[after][0].save(0)
                    background[after][0].wait_for_save()
                stall, write = time_trap_background(*background[after], index, after)
                suffix = ", right after a background save" if after else ""
                stalls.setdefault(f"background save{suffix}", []).append(stall)
                runs.setdefault(f"background write{suffix}", []).append(write)
    finally:
        for trap, _ in background.values():
            trap.close()
        shutil.rmtree(root, ignore_errors=True)

    def rate(seconds: list[float]) -> float:
        return state_bytes / statistics.median(seconds) / 1e6

    # The disk's speed is the better of the two plain writes: the stricter yardstick.
    disk = max(rate(runs["dd sequential write"]), rate(runs["Python sequential write"]))
    plain = rate(runs["torch.save + fsync (CRC32 on)"])
    print(f"median of {args.repeats}, all through fsync:")
    print(
        f"  {'method':42s} {'s':>7s} {'MB/s':>8s} {'of disk':>8s} {'of torch.save':>14s}"
        f" {'best MB/s':>10s}"
    )
    for label, seconds in runs.items():
        print(
            f"  {label:42s} {statistics.median(seconds):7.3f} {rate(seconds):8.1f} "
            f"{rate(seconds) / disk:8.0%} {rate(seconds) / plain:14.0%}"
            f" {state_bytes / min(seconds) / 1e6:10.1f}"
        )
    print(f"disk speed (the better plain write): {disk:.1f} MB/s")
    print("training stall per save (median):")
    synchronous = statistics.median(runs["Trap.save, 1 writer thread, CRC32 off"])
    print(f"  {'synchronous Trap.save':54s} {synchronous:7.3f} s")
    for label, seconds in stalls.items():
        print(
            f"  {label:54s} {statistics.median(seconds):7.3f} s "
            f"({statistics.median(seconds) / synchronous:.0%} of synchronous)"
        )
    print(f"checkpoint on disk: {checkpoint_bytes / 1e9:.3f} GB")

    single = should_stop_cost(args.stop_steps)
    print(f"should_stop, one process: {single * 1e6:.2f} us/step ({single * 1e3 / 1.0:.4f} ms)")
    gloo = should_stop_cost_gloo(2, 2_000)
    print(f"should_stop, 2 gloo ranks (all-reduce MAX): {gloo * 1e6:.1f} us/step")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
