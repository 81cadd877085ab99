"""Restart integrity: a resumed run against an uninterrupted reference, bit for bit.

Each rank of a drill's training job dumps its final model and optimizer state,
RNG states and loss; so does each rank of the reference run. They must be
identical: the largest absolute difference of any tensor is 0.0, the RNG states
are equal and the final loss has the same bits.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch


def rank_path(pattern: Path, rank: int) -> Path:
    """The dump of one rank, from a path with `{rank}` in it."""
    return Path(str(pattern).replace("{rank}", str(rank)))


def compare_with_reference(
    *, dump: Path, reference: Path, ranks: int
) -> tuple[float | None, bool, bool]:
    """Max absolute difference of every tensor against the reference, and
    whether RNG states and the final loss are identical, over all ranks.
    (None, False, False) when a dump is missing."""
    worst = 0.0
    same_rng = True
    same_loss = True
    for rank in range(ranks):
        mine, theirs = rank_path(dump, rank), rank_path(reference, rank)
        if not mine.exists() or not theirs.exists():
            return None, False, False
        a = torch.load(mine, weights_only=False)
        b = torch.load(theirs, weights_only=False)
        for left, right in zip(
            _tensors(a["model"]) + _tensors(a["optimizer"]),
            _tensors(b["model"]) + _tensors(b["optimizer"]),
            strict=True,
        ):
            if left.shape != right.shape:
                return math.inf, False, False
            if left.numel():
                worst = max(worst, float((left.double() - right.double()).abs().max()))
        same_loss &= a["loss_hex"] == b["loss_hex"]
        same_rng &= _rng_equal(a["rng"], b["rng"])
    return worst, same_rng, same_loss


def _tensors(state: Any) -> list[Any]:
    found: list[Any] = []
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        for key in sorted(state, key=str):
            found += _tensors(state[key])
    elif isinstance(state, list | tuple):
        for item in state:
            found += _tensors(item)
    elif isinstance(state, int | float):
        found.append(torch.tensor(float(state)))
    return found


def _rng_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["python"] != b["python"]:
        return False
    na, nb = a["numpy"], b["numpy"]
    if na[0] != nb[0] or not np.array_equal(na[1], nb[1]) or tuple(na[2:]) != tuple(nb[2:]):
        return False
    return bool(torch.equal(a["torch"], b["torch"]))
