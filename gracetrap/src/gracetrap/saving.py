"""The trap's checkpoints: saving (in the foreground or in a background thread),
pruning, resuming and loading. Decides not when to save (gracetrap.stopping) and
never exits the process (gracetrap.trap).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from gracetrap import checkpoints
from gracetrap.base import TrapBase
from gracetrap.staging import (
    STATE_KEY,
    STEP_KEY,
    WORLD_SIZE_KEY,
    BackgroundSave,
    FencedWriter,
    crc32,
    fencing_owner,
    prune_after,
    rank_rng_key,
    single_process_quietly,
    stage,
)
from gracetrap.state import SafeLoadPlanner, SafeReader, capture_rng_state, restore_rng_state


class TrapSaving(TrapBase):
    """Saves, resumes and loads the checkpoints of one rank."""

    # ------------------------------------------------------------ checkpoints

    def _dcp_state(self, step: int) -> dict[str, Any]:
        return {
            STATE_KEY: {name: entry.state_dict() for name, entry in self._state.items()},
            STEP_KEY: step,
            WORLD_SIZE_KEY: self.world_size(),
            rank_rng_key(self.rank()): capture_rng_state(),
        }

    def save(
        self, step: int, *, background: bool | None = None, notice: bool = False
    ) -> checkpoints.CheckpointInfo | None:
        """Checkpoint the state after ``step`` completed; every rank must call it.

        With ``background`` (default: the trap's ``async_saves``) the state is copied
        to host memory and written by a background thread while training goes on; the
        returned checkpoint is then not complete yet (``complete=False``) and the
        ``latest`` pointer moves once the files and folders are fsynced. A save first
        waits for the previous background save. Returns None when ``step`` was
        already checkpointed (the existing checkpoint is kept as it is).
        """
        if self.checkpoint_dir is None:
            raise ValueError(
                "no checkpoint directory: pass checkpoint_dir or set QM_CHECKPOINT_DIR"
            )
        entered = time.monotonic()
        background = self.async_saves if background is None else background
        self._report_signal()
        self._report_notice()
        # One background write at a time: it also settles what is already on disk.
        self.wait_for_save()
        root = self.checkpoint_dir
        path = checkpoints.step_dir(root, step, self.epoch)
        leader = self.rank() == 0
        already = 0.0
        owner = 0.0 if self._fenced_by == 0 else float(self._fenced_by)
        if leader:
            root.mkdir(parents=True, exist_ok=True)
            owner = max(owner, float(self._newer_owner()))
            newest = checkpoints.complete_checkpoints(root)
            if not newest or (self.epoch, step) <= newest[0].order:
                # Pruning drops incomplete folders older than the newest complete one,
                # which this save's folder would be until it commits: let it finish.
                # A save of a newer step is never touched by it, so the deletion of
                # old checkpoints (slow on big files, above all where the file system
                # discards freed blocks at once) runs on beside the save.
                self._wait_for_pruning()
            if checkpoints.is_complete(path):
                already = 1.0
            elif path.exists():
                # The remnant of a save that was killed: start that step afresh.
                checkpoints.discard(path)
        # This reduction doubles as the barrier after rank 0 prepared the folder.
        already, owner = self._reduce_max([already, owner])
        if owner > 0:
            # Nothing was written yet: a newer attempt owns the folder.
            self._stop_fenced(int(owner), step)
        if already:
            self.events.emit(
                "checkpoint_skipped", step=step, reason=f"step {step} is already checkpointed"
            )
            return None
        self.events.emit("checkpoint_started", step=step)
        self._last_checkpoint_at = entered
        if background:
            return self._save_in_background(step, path, notice, entered)
        started = time.monotonic()
        writer = self._writer(path)
        try:
            with single_process_quietly(), crc32(self.checksums):
                dcp_save(
                    self._dcp_state(step), storage_writer=writer, no_dist=not self._initialised()
                )
        except (Exception, CheckpointException) as error:
            # DCP raises alike on every rank. A fencing says so itself; any other
            # failure of a fenced rank (a newer attempt's pruning removed the folder
            # under it) is one too, as the folder's epoch shows.
            fenced_by = fencing_owner(error) or self._newer_owner()
            if fenced_by:
                self._stop_fenced(fenced_by, step, path)
            raise
        nbytes = 0.0
        if leader:
            checkpoints.fsync_dir(path)
            checkpoints.fsync_dir(root)
            nbytes = float(checkpoints.folder_bytes(path))
        seconds, nbytes = self._reduce_max([time.monotonic() - started, nbytes])
        if leader:
            checkpoints.write_pointer(
                root,
                step=step,
                seconds=seconds,
                nbytes=int(nbytes),
                world_size=self.world_size(),
                epoch=self.epoch,
            )
        stall = time.monotonic() - entered
        self._save_seconds.append(seconds)
        self._stall_seconds.append(stall)
        self._committed_step = step
        self.events.emit(
            "checkpoint_committed",
            step=step,
            bytes=int(nbytes),
            seconds=round(seconds, 6),
            stall=round(stall, 6),
            background=False,
            notice=notice,
        )
        if leader:
            self._start_pruning()
        return checkpoints.CheckpointInfo(step, path, True)

    def _writer(self, path: Path) -> FileSystemWriter:
        assert self.checkpoint_dir is not None
        return FencedWriter(
            path,
            root=self.checkpoint_dir,
            epoch=self.epoch if self._fencing else None,
            sync_files=True,
            thread_count=self.save_threads,
        )

    def _start_pruning(self) -> None:
        # Deleting old checkpoints is slow on big files and never needed for safety,
        # so it runs beside training instead of inside the save (or the grace window).
        # A kill in the middle leaves only renamed remnants that the next prune removes.
        # One deletion at a time: the new one starts once the previous one ended.
        assert self.checkpoint_dir is not None
        self._pruner = threading.Thread(
            target=prune_after,
            args=(self._pruner, self.checkpoint_dir, self.keep),
            name="gracetrap-prune",
        )
        self._pruner.daemon = True
        self._pruner.start()

    # ------------------------------------------------------ background saves

    def _background_group(self) -> Any:
        """A gloo group of its own for background saves, created on first use.

        DCP runs collectives (plan exchange, the commit) inside the save; on the
        default group they would race with training's own collectives from another
        thread, so background saves talk over a separate group.
        """
        if not self._distributed():
            return None
        if self._save_group is None:
            self._save_group = dist.new_group(backend="gloo")
        return self._save_group

    def _save_in_background(
        self, step: int, path: Path, notice: bool, entered: float
    ) -> checkpoints.CheckpointInfo:
        staged = stage(self._dcp_state(step), self._staging)
        group = self._background_group()
        pending = BackgroundSave(step, path, notice, stall=0.0)
        # Not a daemon: an interpreter that exits normally lets the write finish
        # rather than cutting it off (or unwinding it out of C++ frames).
        pending.thread = threading.Thread(
            target=self._write_in_background,
            args=(pending, staged, group),
            name="gracetrap-save",
        )
        self._pending = pending
        pending.thread.start()
        pending.stall = time.monotonic() - entered
        self._stall_seconds.append(pending.stall)
        return checkpoints.CheckpointInfo(step, path, False)

    def _write_in_background(self, pending: BackgroundSave, staged: Any, group: Any) -> None:
        assert self.checkpoint_dir is not None
        root = self.checkpoint_dir
        started = time.monotonic()
        try:
            writer = self._writer(pending.path)
            with crc32(self.checksums):
                if self._initialised():
                    dcp_save(staged, storage_writer=writer, process_group=group)
                else:
                    with single_process_quietly():
                        dcp_save(staged, storage_writer=writer, no_dist=True)
            leader = self.rank() == 0
            nbytes = 0.0
            if leader:
                checkpoints.fsync_dir(pending.path)
                checkpoints.fsync_dir(root)
                nbytes = float(checkpoints.folder_bytes(pending.path))
            values = torch.tensor([time.monotonic() - started, nbytes], dtype=torch.float64)
            if group is not None:
                dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
            seconds, nbytes = (float(v) for v in values.tolist())
            if leader:
                # Only now, with every rank's files and both folders fsynced, does the
                # pointer move.
                checkpoints.write_pointer(
                    root,
                    step=pending.step,
                    seconds=seconds,
                    nbytes=int(nbytes),
                    world_size=self.world_size(),
                    epoch=self.epoch,
                )
            pending.seconds = seconds
            pending.nbytes = int(nbytes)
            pending.committed_at = time.time()
            # Reported from here, not at the training thread's next step boundary:
            # a scheduler waiting for a notice's commit evicts a step sooner.
            self.events.emit(
                "checkpoint_committed",
                at=pending.committed_at,
                step=pending.step,
                bytes=pending.nbytes,
                seconds=round(pending.seconds, 6),
                stall=round(pending.stall, 6),
                background=True,
                notice=pending.notice,
            )
        except BaseException as error:
            # Reported by the training thread at its next call into the trap.
            pending.error = error
        finally:
            pending.done.set()

    def _poll_background(self) -> None:
        """Take in a background save that has finished (on the training thread); its
        commit was reported by the write thread, a failure is reported here."""
        pending = self._pending
        if pending is None or pending.reported or not pending.done.is_set():
            return
        pending.reported = True
        if pending.error is not None:
            fenced_by = fencing_owner(pending.error) or self._newer_owner()
            if fenced_by:
                # Agreed with the other ranks at the next all-reduce (should_stop,
                # save), which then stops the gang together.
                self._fenced_by = fenced_by
                if self.rank() == 0 and not checkpoints.is_complete(pending.path):
                    checkpoints.discard(pending.path)
                self.events.emit(
                    "checkpoint_skipped",
                    step=pending.step,
                    notice=pending.notice,
                    reason=checkpoints.fenced_line(fenced_by, self.epoch),
                )
                return
            self.events.emit(
                "checkpoint_skipped",
                step=pending.step,
                notice=pending.notice,
                reason=f"background save failed: {pending.error}",
            )
            return
        self._save_seconds.append(pending.seconds)
        self._committed_step = pending.step
        if self.rank() == 0:
            self._start_pruning()

    @property
    def save_in_flight(self) -> bool:
        """True while a background save is being written."""
        return self._pending is not None and not self._pending.done.is_set()

    def wait_for_save(self, timeout: float | None = None) -> bool:
        """Wait for the background save in flight, if any, and report it.

        Returns True when no background save is in flight any more, False when
        ``timeout`` seconds passed first.
        """
        pending = self._pending
        if pending is None:
            return True
        if not pending.done.wait(timeout):
            return False
        assert pending.thread is not None
        pending.thread.join()
        self._poll_background()
        self._pending = None
        return True

    def _wait_for_pruning(self) -> None:
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None

    def resume(self) -> int:
        """Load the newest complete checkpoint; return the first step not yet done (0 if none).

        A checkpoint that fails to load is passed over for the next older one.
        """
        if self.checkpoint_dir is None:
            return 0
        # Newest first by (epoch, step): a newer attempt's commit wins over any step of
        # an older one, and commits of attempts newer than this one (none, unless this
        # one is fenced already) are not this lineage's to take.
        candidates = [
            info
            for info in checkpoints.complete_checkpoints(self.checkpoint_dir)
            if not self._fencing or info.epoch <= self.epoch
        ]
        # Every rank must load the same checkpoint: follow rank 0's listing.
        listed = [info.order for info in candidates] if self.rank() == 0 else []
        (count,) = self._reduce_max([float(len(listed))])
        chosen: list[tuple[int, int]] = []
        for index in range(int(count)):
            epoch, step = self._reduce_max(
                [float(value) for value in listed[index]] if listed else [-1.0, -1.0]
            )
            chosen.append((int(epoch), int(step)))
        for epoch, step in chosen:
            path = checkpoints.step_dir(self.checkpoint_dir, step, epoch)
            try:
                self._load(path, step)
            except (Exception, CheckpointException) as error:
                # DCP raises on every rank alike, so all ranks fall back together.
                print(
                    f"gracetrap: checkpoint {path} could not be loaded ({error}); "
                    "trying the previous one",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            self._committed_step = step
            # The sizes tell a resize apart from a plain restart (an elastic job resumed
            # at 4 ranks from the checkpoint of 8).
            self.events.emit(
                "resumed",
                step=step + 1,
                world_size=self.world_size(),
                saved_world_size=self._saved_world_size,
            )
            return step + 1
        return 0

    def _load(self, path: Path, step: int) -> None:
        # Neither the index nor any value is unpickled freely: a folder that names
        # anything but tensors and plain data is refused (gracetrap.state).
        reader = SafeReader(path)
        saved_keys = set(reader.read_metadata().state_dict_metadata)
        rng_key = rank_rng_key(self.rank())
        # DCP loads into these dicts in place; each object then takes its own back.
        loaded = {name: entry.state_dict() for name, entry in self._state.items()}
        target: dict[str, Any] = {STATE_KEY: loaded, STEP_KEY: -1}
        if WORLD_SIZE_KEY in saved_keys:
            target[WORLD_SIZE_KEY] = -1
        if rng_key in saved_keys:
            target[rng_key] = b""
        else:
            print(
                f"gracetrap: {path} has no RNG state for rank {self.rank()} (saved with another "
                "world size); random streams continue unrestored",
                file=sys.stderr,
                flush=True,
            )
        with single_process_quietly():
            dcp_load(
                target,
                storage_reader=reader,
                planner=SafeLoadPlanner(),
                no_dist=not self._initialised(),
            )
        if target[STEP_KEY] != step:
            raise ValueError(f"{path} holds step {target[STEP_KEY]}, not {step}")
        saved_world_size = target.get(WORLD_SIZE_KEY, -1)
        self._saved_world_size = saved_world_size if saved_world_size > 0 else None
        for name, entry in self._state.items():
            entry.load_state_dict(target[STATE_KEY][name])
        if rng_key in target:
            restore_rng_state(target[rng_key])
