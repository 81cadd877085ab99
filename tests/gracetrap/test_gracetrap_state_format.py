"""The trap's checkpoint cannot run code on load.

A checkpoint folder may be written by someone other than the job that reads it (a
shared volume, a copied folder). Each test plants a pickle whose unpickling would
create a marker file in one of the three places the trap reads back (DCP's index,
a saved non-tensor value, the RNG blob), first proves that the payload does create
the marker when unpickled the ordinary way, and then shows that ``resume`` refuses
the checkpoint with a clear reason and that the marker never appears.
"""

from __future__ import annotations

import enum
import io
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import gracetrap.saving
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from gracetrap.state import (
    UnsafeCheckpointError,
    capture_rng_state,
    load_plain,
    read_checkpoint_metadata,
    restore_rng_state,
)

from gracetrap import Trap, parse_event_line


class _Plant:
    """Unpickling this creates ``marker``: the simplest stand-in for running any code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (os.mknod, (str(self.marker),))


class _Extra:
    """A registered object whose state the test chooses (the planted value goes here)."""

    def __init__(self, value: object) -> None:
        self.value = value
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict


def _payload_works(payload: bytes, marker: Path) -> None:
    # The control: the ordinary unpickler does run it, so its absence later is the fix.
    pickle.loads(payload)
    assert marker.exists()
    marker.unlink()


def _trap(directory: Path, extra: object = 0) -> tuple[Trap, io.StringIO, torch.nn.Module]:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    stream = io.StringIO()
    state = {"model": model, "optimizer": optimizer, "extra": _Extra(extra)}
    return Trap(directory, state, stream=stream), stream, model


def _resumed_steps(stream: io.StringIO) -> list[object]:
    events = [parse_event_line(line) for line in stream.getvalue().splitlines()]
    return [e["step"] for e in events if e is not None and e["event"] == "resumed"]


def test_a_planted_metadata_index_runs_nothing_and_the_previous_checkpoint_is_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoints, marker = tmp_path / "checkpoints", tmp_path / "marker"
    trap, _, model = _trap(checkpoints)
    with trap:
        trap.save(10)
        saved = [p.detach().clone() for p in model.parameters()]
    # A newer-looking step whose index is the payload (its data copied from step 10).
    shutil.copytree(checkpoints / "step_10", checkpoints / "step_20")
    payload = pickle.dumps(_Plant(marker))
    _payload_works(payload, marker)
    (checkpoints / "step_20" / ".metadata").write_bytes(payload)

    fresh, stream, fresh_model = _trap(checkpoints)
    with fresh:
        assert fresh.resume() == 11
    assert not marker.exists()
    assert _resumed_steps(stream) == [11]
    for restored, expected in zip(fresh_model.parameters(), saved, strict=True):
        assert torch.equal(restored, expected)
    error = capsys.readouterr().err
    assert f"checkpoint {checkpoints / 'step_20'} could not be loaded" in error
    assert "gracetrap refuses to load" in error and "it names posix.mknod" in error


def test_a_planted_value_in_the_checkpoint_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoints, marker = tmp_path / "checkpoints", tmp_path / "marker"
    _payload_works(pickle.dumps(_Plant(marker)), marker)
    # DCP writes a non-tensor value with torch.save, so this one is a pickle of _Plant.
    trap, _, _ = _trap(checkpoints, extra=_Plant(marker))
    with trap:
        trap.save(5)
    assert not marker.exists()

    fresh, stream, _ = _trap(checkpoints)
    with fresh:
        assert fresh.resume() == 0
    assert not marker.exists()
    assert _resumed_steps(stream) == []
    error = capsys.readouterr().err
    assert "gracetrap refuses to load the checkpoint's value 'state.extra.value'" in error


def test_a_planted_rng_state_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoints, marker = tmp_path / "checkpoints", tmp_path / "marker"
    payload = pickle.dumps(_Plant(marker))
    _payload_works(payload, marker)
    # The trap's RNG blob used to be a pickle; this one is the payload instead.
    monkeypatch.setattr(gracetrap.saving, "capture_rng_state", lambda: payload)
    trap, _, _ = _trap(checkpoints)
    with trap:
        trap.save(3)
    monkeypatch.undo()

    fresh, _, _ = _trap(checkpoints)
    with fresh:
        assert fresh.resume() == 0
    assert not marker.exists()
    assert "gracetrap refuses to load the checkpoint's RNG state" in capsys.readouterr().err


def test_the_rng_state_is_plain_data_and_restores_every_generator_exactly() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached Gaussian in numpy's legacy state
    random.gauss(0, 1)  # and one in Python's
    blob = capture_rng_state()
    # Only tensors, ints, floats and strings: torch's weights-only loader takes it.
    assert isinstance(torch.load(io.BytesIO(blob), weights_only=True), dict)
    expected = (
        random.getrandbits(64),
        np.random.standard_normal(3),
        torch.rand(4),
        random.gauss(0, 1),
    )
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    restore_rng_state(blob)
    drawn = (
        random.getrandbits(64),
        np.random.standard_normal(3),
        torch.rand(4),
        random.gauss(0, 1),
    )
    assert drawn[0] == expected[0] and drawn[3] == expected[3]
    assert np.array_equal(drawn[1], expected[1])
    assert torch.equal(drawn[2], expected[2])


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (pickle.dumps(print), "it names builtins.print"),
        (pickle.dumps({"step": 1}), "it holds a dict, not a DCP index"),
        (b"not a pickle", "it is not a DCP index"),
    ],
    ids=["a callable", "another object", "garbage"],
)
def test_the_index_reader_names_what_it_refused(content: bytes, reason: str) -> None:
    with pytest.raises(UnsafeCheckpointError) as refused:
        read_checkpoint_metadata(io.BytesIO(content), "step_1/.metadata")
    assert str(refused.value).startswith("gracetrap refuses to load step_1/.metadata: ")
    assert reason in str(refused.value)


class _ByName(pickle.Pickler):
    """Pickles enum members as Debian 12's Python 3.11.2 does: ``getattr(Enum, "NAME")``."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _by_name(value: object) -> bytes:
    out = io.BytesIO()
    _ByName(out, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return out.getvalue()


def test_an_index_written_by_a_python_that_pickles_enums_by_name_loads(tmp_path: Path) -> None:
    """An index written on Debian 12's own Python names ``builtins.getattr`` for each
    tensor's memory format; the reader refused every such checkpoint (a job on the
    portal image resumed from step 0) until it resolved that getattr to enum members."""
    trap, _, _ = _trap(tmp_path)
    with trap:
        trap.save(3)
    index = pickle.loads((tmp_path / "step_3" / ".metadata").read_bytes())
    written = _by_name(index)
    assert b"getattr" in written
    assert read_checkpoint_metadata(io.BytesIO(written), "step_3/.metadata") == index


@pytest.mark.parametrize(
    ("owner", "name", "reason"),
    [
        (dcp_metadata.Metadata, "__init__", "the attribute '__init__' of Metadata"),
        (dcp_metadata._MEM_FORMAT_ENCODING, "__class__", "the attribute '__class__'"),
        (dcp_metadata._MEM_FORMAT_ENCODING, "_member_map_", "the attribute '_member_map_'"),
    ],
    ids=["a class's method", "an enum's class", "an enum's internals"],
)
def test_getattr_in_an_index_gives_enum_members_only(owner: type, name: str, reason: str) -> None:
    class _Ask:
        def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
            return getattr, (owner, name)

    with pytest.raises(UnsafeCheckpointError, match=reason):
        read_checkpoint_metadata(io.BytesIO(pickle.dumps(_Ask())), "step_1/.metadata")


def test_plain_values_load_and_objects_are_refused(tmp_path: Path) -> None:
    saved = io.BytesIO()
    torch.save(
        {"lr": 0.1, "betas": (0.9, 0.999), "params": ["a.weight"], "step": torch.ones(1)}, saved
    )
    assert load_plain(saved.getvalue(), "a value")["betas"] == (0.9, 0.999)
    planted = io.BytesIO()
    torch.save(_Plant(tmp_path / "marker"), planted)
    with pytest.raises(UnsafeCheckpointError, match="gracetrap refuses to load a value"):
        load_plain(planted.getvalue(), "a value")
    assert not (tmp_path / "marker").exists()
