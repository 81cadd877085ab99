"""What a checkpoint holds: the registered objects, every RNG of this rank, the step.

Models and optimizers go through ``torch.distributed.checkpoint.state_dict`` so that
a DDP (or FSDP) wrapper does not leak into parameter names and so that a fresh
optimizer gets its lazily created state (Adam moments) before it is loaded into.

Loading a checkpoint never runs code from it. A checkpoint folder is a place other
programs may have written to (a shared volume, a copied folder), and a pickle runs
whatever callable it names while it is read. Stock ``torch.distributed.checkpoint``
unpickles two things freely: its ``.metadata`` file and every non-tensor value (a
step, a learning rate, the RNG blob). :class:`SafeReader` reads the metadata with an
unpickler that resolves only the few checkpoint-description classes DCP writes
there, and :class:`SafeLoadPlanner` reads every non-tensor value with
``torch.load(weights_only=True)``, which admits only tensors and plain containers of
numbers and strings. The RNG state is itself such a container (tensors, ints, a
float), so restoring it is exact and needs no pickle. A file that names anything
else is refused with :class:`UnsafeCheckpointError` before any of it is used.
"""

from __future__ import annotations

import enum
import io
import pathlib
import pickle
import random
import warnings
from collections.abc import Callable, Mapping
from typing import IO, Any, Protocol, cast, runtime_checkable

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: LR schedulers, samplers, ..."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class ModuleState:
    """A model seen through DCP's state-dict helpers (wrapper prefixes removed)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        """The model's parameters and buffers under their unwrapped names."""
        return dict(get_model_state_dict(self.module))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load parameters and buffers in place."""
        set_model_state_dict(self.module, state_dict)


class OptimizerState:
    """An optimizer keyed by parameter names of the model that owns its parameters."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module = module
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state, created first if the optimizer has not stepped yet."""
        return dict(get_optimizer_state_dict(self.module, self.optimizer))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load moments, step counters and hyper-parameters in place."""
        set_optimizer_state_dict(self.module, self.optimizer, state_dict)


def _owner_of(optimizer: torch.optim.Optimizer, modules: list[nn.Module]) -> nn.Module:
    wanted = {id(param) for group in optimizer.param_groups for param in group["params"]}
    for module in modules:
        if wanted <= {id(param) for param in module.parameters()}:
            return module
    raise ValueError(
        "gracetrap saves an optimizer by the parameter names of its model: register the "
        "model that owns all of the optimizer's parameters in the same state dict"
    )


def adapt_state(state: Mapping[str, object]) -> dict[str, Stateful]:
    """Wrap each registered object so that DCP can save it and load it in place."""
    modules = [value for value in state.values() if isinstance(value, nn.Module)]
    adapted: dict[str, Stateful] = {}
    for name, value in state.items():
        if isinstance(value, nn.Module):
            adapted[name] = ModuleState(value)
        elif isinstance(value, torch.optim.Optimizer):
            adapted[name] = OptimizerState(_owner_of(value, modules), value)
        elif isinstance(value, Stateful):
            adapted[name] = value
        else:
            raise TypeError(
                f"state[{name!r}] is a {type(value).__name__}; gracetrap needs objects with "
                "state_dict() and load_state_dict()"
            )
    return adapted


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _cuda_initialised() -> bool:
    # torch.cuda.is_initialized carries no annotations; the answer is a plain bool.
    initialised: Callable[[], bool] = torch.cuda.is_initialized
    return initialised()


class UnsafeCheckpointError(ValueError):
    """A checkpoint file names something that loading it would have to call or build.

    gracetrap never writes such a file, so it was written by someone else: it is
    refused rather than loaded.
    """


def _refusal(what: str, detail: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"gracetrap refuses to load {what}: {detail}. A checkpoint written by gracetrap "
        "holds only tensors, numbers, strings and DCP's own index, so this file was "
        "written by something else, and loading it could run code"
    )


# What DCP's ``.metadata`` pickle names: its own dataclasses and enum, the storage
# record of the file-system writer, a tensor's size, dtype and layout, and the path it
# was saved to. Building any of them runs no code of the file's choosing.
_METADATA_GLOBALS: dict[tuple[str, str], object] = {
    (dcp_metadata.__name__, name): getattr(dcp_metadata, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
    if hasattr(dcp_metadata, name)
}
_METADATA_GLOBALS[(dcp_filesystem.__name__, "_StorageInfo")] = dcp_filesystem._StorageInfo
_METADATA_GLOBALS[("torch", "Size")] = torch.Size
_METADATA_GLOBALS[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
_METADATA_GLOBALS[("pathlib", "PosixPath")] = pathlib.PosixPath
_METADATA_GLOBALS[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath


# The enums among them, whose members an index may name through ``getattr``.
_METADATA_ENUMS = frozenset(
    value
    for value in _METADATA_GLOBALS.values()
    if isinstance(value, type) and issubclass(value, enum.Enum)
)


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the names in ``_METADATA_GLOBALS`` (and torch's dtypes).

    Every callable a pickle can reach comes through ``find_class``; refusing all
    other names leaves the file nothing to call but these constructors.
    """

    def __init__(self, stream: IO[bytes], source: str) -> None:
        super().__init__(stream)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        allowed = _METADATA_GLOBALS.get((module, name))
        if allowed is not None:
            return allowed
        if (module, name) in (("builtins", "getattr"), ("__builtin__", "getattr")):
            return self._enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _refusal(self.source, f"it names {module}.{name}")

    def _enum_member(self, owner: object, name: object) -> object:
        """``getattr`` as a DCP index may use it: some CPython 3.11 releases
        (Debian 12's 3.11.2; not 3.11.7) pickle an enum member as
        ``getattr(TheEnum, "NAME")``, so a rank on such a Python wrote every index
        so. Only a member of an enum the index may name is given; any other
        attribute of anything is refused."""
        if (
            isinstance(owner, type)
            and owner in _METADATA_ENUMS
            and isinstance(name, str)
            and name in owner.__members__
        ):
            return owner[name]
        what = getattr(owner, "__name__", type(owner).__name__)
        raise _refusal(self.source, f"it asks for the attribute {name!r} of {what}")


def read_checkpoint_metadata(stream: IO[bytes], source: str) -> Any:
    """DCP's checkpoint index from ``stream``, read without running code from it."""
    try:
        metadata = _MetadataUnpickler(stream, source).load()
    except UnsafeCheckpointError:
        raise
    except Exception as error:
        raise _refusal(source, f"it is not a DCP index ({error})") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise _refusal(source, f"it holds a {type(metadata).__name__}, not a DCP index")
    return metadata


def load_plain(stream: io.BytesIO | bytes, source: str) -> Any:
    """A value written with ``torch.save``, loaded only if it is tensors and plain data."""
    if isinstance(stream, bytes):
        stream = io.BytesIO(stream)
    try:
        with warnings.catch_warnings():
            # A planted raw pickle makes torch warn about its protocol; the refusal says more.
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as error:
        raise _refusal(source, _weights_only_reason(error)) from None


def _weights_only_reason(error: Exception) -> str:
    # torch's message around the reason advises loading with weights_only=False,
    # which is exactly what must not happen here: keep only the reason itself.
    for line in str(error).splitlines():
        if "nsupported" in line:
            reason = line.split("error:", 1)[-1].strip().rstrip(".")
            if reason:
                return f"it is not plain data ({reason})"
    return f"it is not plain data ({type(error).__name__})"


class SafeReader(FileSystemReader):
    """DCP's file-system reader, with the ``.metadata`` index read by an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        """The checkpoint's index; :class:`UnsafeCheckpointError` if it names anything else."""
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as stream:
            metadata: dcp_metadata.Metadata = read_checkpoint_metadata(
                cast(IO[bytes], stream), str(path)
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with every non-tensor value loaded ``weights_only``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Put one saved non-tensor value (a step, a learning rate, ...) in its place."""
        fqn = read_item.dest_index.fqn
        loaded = load_plain(value, f"the checkpoint's value {fqn!r}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def capture_rng_state() -> bytes:
    """Every random number generator this process uses, as one opaque blob.

    CUDA generators are included only once CUDA is initialised, so that a CPU job on
    a GPU machine does not create a CUDA context just to be saved. The blob is a
    ``torch.save`` of tensors, ints and a float only, so that it loads with
    ``weights_only=True``: no pickle of Python objects is ever read back.
    """
    version, internal, gauss_next = random.getstate()
    snapshot: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "torch": torch.get_rng_state(),
    }
    numpy = _numpy()
    if numpy is not None:
        name, key, position, has_gauss, cached_gaussian = numpy.random.get_state(legacy=True)
        snapshot["numpy"] = {
            "name": str(name),
            # torch has no general uint32 tensors; the words fit int64 exactly.
            "key": torch.from_numpy(key.astype(numpy.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }
    if torch.cuda.is_available() and _cuda_initialised():
        snapshot["cuda"] = list(torch.cuda.get_rng_state_all())
    blob = io.BytesIO()
    torch.save(snapshot, blob)
    return blob.getvalue()


def restore_rng_state(blob: bytes) -> None:
    """Put back the generators captured by :func:`capture_rng_state`.

    Raises :class:`UnsafeCheckpointError` when the blob is not plain data (for
    instance an old pickle, or one planted to run code) before any generator moves.
    """
    snapshot = load_plain(blob, "the checkpoint's RNG state")
    if not isinstance(snapshot, dict) or "python" not in snapshot or "torch" not in snapshot:
        raise _refusal("the checkpoint's RNG state", "it is not an RNG state saved by gracetrap")
    python = snapshot["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
    torch.set_rng_state(snapshot["torch"])
    numpy = _numpy()
    saved_numpy = snapshot.get("numpy")
    if numpy is not None and saved_numpy is not None:
        numpy.random.set_state(
            (
                saved_numpy["name"],
                saved_numpy["key"].numpy().astype(numpy.uint32),
                saved_numpy["position"],
                saved_numpy["has_gauss"],
                saved_numpy["cached_gaussian"],
            )
        )
    cuda_states = snapshot.get("cuda")
    if cuda_states and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
        torch.cuda.set_rng_state_all(cuda_states)
