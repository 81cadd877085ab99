"""What the elastic drill checks in its ranks' logs: every step's global batch, every
epoch's samples and the final loss of a resized run against an uninterrupted one.

examples/train_elastic.py prints, on every rank and every step, the sample ids it
trained on and the loss of the global batch, and rank 0 the final loss and the sum of
squared parameters. A run resized at agreed steps must take, at each step, the same
global batch as the uninterrupted run (whichever ranks share it), so every epoch sees
every sample exactly once; the loss differs only by the order of float32 sums (each
world size adds a step's gradients up in another order, and Adam carries the last
bits on). Pure functions of the logs' text: reads no database and starts nothing.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

# Measured by tests/gracetrap/test_gracetrap_elastic.py: resized runs end 1e-7 apart
# (relative) from the uninterrupted run, a skipped and a repeated sample 1e-3 apart.
LOSS_RELATIVE_TOLERANCE = 1e-5


@dataclass
class TrainingRecord:
    """What the ranks of one or more attempts of a training run printed."""

    # step -> (epoch, world size, sample ids) for each rank that printed the step
    samples: dict[int, list[tuple[int, int, tuple[int, ...]]]] = field(default_factory=dict)
    # step -> every loss printed for it (float.hex), by each rank and each attempt
    losses: dict[int, set[str]] = field(default_factory=dict)
    # step -> how many attempts printed it: more than one means the step ran twice
    attempts_of_step: Counter[int] = field(default_factory=Counter)
    final_loss: float = math.nan
    params: float = math.nan

    def add_attempt(self, rank_logs: Iterable[str]) -> None:
        """Add the logs of one attempt's ranks."""
        steps: set[int] = set()
        for text in rank_logs:
            for line in text.splitlines():
                words = line.split()
                if words[:1] == ["SAMPLES"] and len(words) in (7, 8):
                    step = int(words[1])
                    ids = tuple(int(i) for i in words[7].split(",")) if len(words) == 8 else ()
                    self.samples.setdefault(step, []).append((int(words[3]), int(words[5]), ids))
                    steps.add(step)
                elif words[:1] == ["STEP"] and len(words) == 8:
                    self.losses.setdefault(int(words[1]), set()).add(words[7])
                elif words[:2] == ["FINAL", "LOSS"] and len(words) == 5:
                    self.final_loss = float.fromhex(words[2])
                    self.params = float.fromhex(words[4])
        self.attempts_of_step.update(steps)

    def per_epoch(self) -> dict[int, Counter[int]]:
        """How often each sample was trained on, by epoch."""
        seen: dict[int, Counter[int]] = {}
        for shares in self.samples.values():
            for epoch, _, ids in shares:
                seen.setdefault(epoch, Counter()).update(ids)
        return seen

    def global_batch(self, step: int) -> list[int]:
        """The sample ids of one step, over every rank that printed it."""
        return sorted(i for _, _, ids in self.samples.get(step, []) for i in ids)

    def world_sizes(self) -> dict[int, int]:
        """The world size each step ran at (the largest printed, should a step repeat)."""
        return {step: max(w for _, w, _ in shares) for step, shares in self.samples.items()}


@dataclass(frozen=True)
class SampleCheck:
    """A resized run against the uninterrupted one: the exact check and the loss."""

    steps: int
    samples_seen: int
    samples_expected: int
    # Steps whose global batch differs from the reference's, and steps run by more
    # than one attempt (a resize that lost work would redo them).
    steps_differing: tuple[int, ...]
    steps_repeated: tuple[int, ...]
    epochs_identical: bool
    world_sizes: tuple[int, ...]
    final_loss: float
    reference_final_loss: float
    loss_relative_difference: float
    params_relative_difference: float

    @property
    def exact(self) -> bool:
        """Every step took the reference's global batch, once, and every epoch the same
        samples the same number of times."""
        return (
            self.epochs_identical
            and not self.steps_differing
            and not self.steps_repeated
            and self.samples_seen == self.samples_expected
        )

    @property
    def loss_within_tolerance(self) -> bool:
        return (
            self.loss_relative_difference <= LOSS_RELATIVE_TOLERANCE
            and self.params_relative_difference <= LOSS_RELATIVE_TOLERANCE
        )


def _relative(mine: float, theirs: float) -> float:
    if math.isnan(mine) or math.isnan(theirs):
        return math.inf
    return abs(mine - theirs) / abs(theirs) if theirs else abs(mine)


def compare_samples(resized: TrainingRecord, reference: TrainingRecord) -> SampleCheck:
    """The exact sample check and the loss comparison of a resized run."""
    expected = reference.per_epoch()
    steps = sorted(set(resized.samples) | set(reference.samples))
    differing = tuple(s for s in steps if resized.global_batch(s) != reference.global_batch(s))
    repeated = tuple(sorted(s for s, n in resized.attempts_of_step.items() if n > 1))
    return SampleCheck(
        steps=len(resized.samples),
        samples_seen=sum(resized.per_epoch().values(), Counter()).total(),
        samples_expected=sum(expected.values(), Counter()).total(),
        steps_differing=differing,
        steps_repeated=repeated,
        epochs_identical=resized.per_epoch() == expected,
        world_sizes=tuple(sorted(set(resized.world_sizes().values()))),
        final_loss=resized.final_loss,
        reference_final_loss=reference.final_loss,
        loss_relative_difference=_relative(resized.final_loss, reference.final_loss),
        params_relative_difference=_relative(resized.params, reference.params),
    )
