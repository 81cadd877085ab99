"""What a checkpoint holds: the registered objects, every RNG of this rank, the step.

Models and optimizers go through ``torch.distributed.checkpoint.state_dict`` so that
a DDP (or FSDP) wrapper does not leak into parameter names and so that a fresh
optimizer gets its lazily created state (Adam moments) before it is loaded into.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
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


def capture_rng_state() -> bytes:
    """Every random number generator this process uses, as one opaque blob.

    CUDA generators are included only once CUDA is initialised, so that a CPU job on
    a GPU machine does not create a CUDA context just to be saved.
    """
    snapshot: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
    }
    numpy = _numpy()
    if numpy is not None:
        snapshot["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available() and _cuda_initialised():
        snapshot["cuda"] = torch.cuda.get_rng_state_all()
    return pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL)


def restore_rng_state(blob: bytes) -> None:
    """Put back the generators captured by :func:`capture_rng_state`."""
    # The blob comes from this job's own checkpoint folder, written by capture_rng_state.
    snapshot = pickle.loads(blob)
    random.setstate(snapshot["python"])
    torch.set_rng_state(snapshot["torch"])
    numpy = _numpy()
    if numpy is not None and "numpy" in snapshot:
        numpy.random.set_state(snapshot["numpy"])
    cuda_states = snapshot.get("cuda")
    if cuda_states and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
        torch.cuda.set_rng_state_all(cuda_states)
