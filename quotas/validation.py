"""The allowed range of every quota field, and the one sentence that refuses a
value outside it.

A manager who types 12, -3, `abc`, `2.5` or nothing into a quota field needs the
same answer each time: which values would be accepted, and why. So the pages,
the API and the Django admin hand the value through as typed (a whole number
where it reads as one, see `parse_count`) and the quota services refuse it with
`AllowedRange.refusal`, which always names the range, e.g. "Must be a whole
number from 0 to 8: ml has 16 GPUs of h100-80gb and its other sub-teams hold 8
(got -3)."

A guarantee's range comes from the tree: at least what its sub-teams are
guaranteed and what its never-preempted jobs run, at most what its parent (or,
at the top, the cluster's schedulable GPUs) leaves beside its siblings. Limits
and weights have fixed ranges.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ValidationError
from django.db.models import QuerySet, Sum

from quotas.job_ledger import job_ledger
from quotas.models import Quota, ResourceFlavor, Team
from quotas.selectors import cluster_gpus
from quotas.wording import LEND_ALL, NO_LIMIT

MAX_GPUS = 1_000_000
MIN_WEIGHT = 0.001
MAX_WEIGHT = 1_000_000.0

# What a person may type for a whole number: digits with an optional sign, and
# a ".0" that number inputs and JSON encoders sometimes add. Nineteen digits keep
# int() clear of Python's limit on huge conversions; anything longer is refused
# by the range anyway.
WHOLE_NUMBER = re.compile(r"[+-]?\d{1,19}(\.0*)?")
# Floats above 2**53 are not exact whole numbers; they are shown as typed.
EXACT_FLOAT = 2**53


def parse_count(raw: Any) -> Any:
    """`raw` as a whole number where it reads as one, None where it is empty, and
    otherwise unchanged, so that the range check refuses it showing what was typed."""
    if raw is None:
        return None
    if isinstance(raw, str):
        text = raw.strip()
        if not text:
            return None
        if WHOLE_NUMBER.fullmatch(text):
            return int(text.split(".")[0])
        return raw
    if (
        isinstance(raw, float)
        and math.isfinite(raw)
        and raw.is_integer()
        and abs(raw) <= EXACT_FLOAT
    ):
        return int(raw)
    return raw


def parse_weight(raw: Any) -> Any:
    """`raw` as a float where it reads as a finite number, else unchanged (and refused)."""
    if isinstance(raw, bool) or raw is None:
        return raw
    if isinstance(raw, int | float):
        try:
            number = float(raw)
        except OverflowError:  # an int beyond any float
            return raw
        return number if math.isfinite(number) else raw
    if isinstance(raw, str):
        try:
            number = float(raw.strip())
        except ValueError:
            return raw
        return number if math.isfinite(number) else raw
    return raw


def shown(value: Any) -> str:
    """A refused value as the person typed it, short enough for a message."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return "nothing"
    if isinstance(value, float):
        return _number_words(value)
    text = value.strip() if isinstance(value, str) else str(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _number_words(value: float) -> str:
    # Twelve significant digits write 1000000.0 as 1000000 and 0.001 as 0.001.
    return format(value, ".12g") if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class AllowedRange:
    """The values a quota field accepts: `low` to `high`, whole numbers unless
    `whole` is false, and empty where `empty` says what empty means. `reasons`
    say where the bounds come from, in full sentences without the full stop."""

    field: str
    low: float
    high: float
    whole: bool = True
    empty: str | None = None
    reasons: tuple[str, ...] = ()

    @property
    def words(self) -> str:
        """The range in words: "from 0 to 8", "exactly 16", or both bounds where the
        tree allows no value (an over-committed flavor after a node was drained)."""
        if self.high < self.low:
            return f"at least {_number_words(self.low)} and at most {_number_words(self.high)}"
        if self.high == self.low:
            return f"exactly {_number_words(self.low)}"
        return f"from {_number_words(self.low)} to {_number_words(self.high)}"

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.empty is not None
        if isinstance(value, bool):
            return False
        if self.whole:
            if not isinstance(value, int):
                return False
        elif not isinstance(value, float) or not math.isfinite(value):
            # `parse_weight` made every readable number a float.
            return False
        return self.low <= value <= self.high

    def refusal(self, value: Any) -> str:
        """The one sentence every page and API answer uses to refuse `value`."""
        kind = "a whole number" if self.whole else "a number"
        if self.high < self.low:
            head = f"No value fits now: it would have to be {self.words}"
        elif self.high == self.low:
            head = f"Must be {self.words}"
        else:
            head = f"Must be {kind} {self.words}"
        if self.empty is not None:
            head += f", or empty ({self.empty})"
        if self.reasons:
            head += ": " + "; ".join(self.reasons)
        return f"{head} (got {shown(value)})."

    def check(self, value: Any) -> str | None:
        """The refusal of `value`, or None where the range accepts it."""
        return None if self.accepts(value) else self.refusal(value)


BORROW_LIMIT_RANGE = AllowedRange("borrow_limit", 0, MAX_GPUS, empty=NO_LIMIT)
LEND_LIMIT_RANGE = AllowedRange("lend_limit", 0, MAX_GPUS, empty=LEND_ALL)
WEIGHT_RANGE = AllowedRange("weight", MIN_WEIGHT, MAX_WEIGHT, whole=False)


def check_weight(value: Any) -> None:
    """Refuse a team weight outside its range (ValidationError naming `weight`)."""
    if (message := WEIGHT_RANGE.check(parse_weight(value))) is not None:
        raise ValidationError({"weight": [message]})


def _guarantee_sum(quotas: QuerySet[Quota]) -> int:
    return int(quotas.aggregate(total=Sum("guarantee"))["total"] or 0)


def guarantee_range(*, team: Team, flavor: ResourceFlavor, subtree: set[int]) -> AllowedRange:
    """What the guarantee of (team, flavor) may be, given every other quota of the
    tree and the never-preempted jobs that run in `subtree` (the team's)."""
    of_flavor = Quota.objects.filter(flavor=flavor)
    others = of_flavor.exclude(team=team)
    if team.parent_id is None:
        held = _guarantee_sum(others.filter(team__parent__isnull=True))
        capacity = cluster_gpus(flavor_id=flavor.pk)
        high = capacity - held
        ceiling = (
            f"the cluster has {capacity} GPUs of {flavor.name} and the other top-level teams "
            f"hold {held}"
        )
    else:
        parent = team.parent
        assert parent is not None
        parent_guarantee = _guarantee_sum(of_flavor.filter(team_id=team.parent_id))
        held = _guarantee_sum(others.filter(team__parent_id=team.parent_id))
        high = parent_guarantee - held
        ceiling = (
            f"{parent.slug} has {parent_guarantee} GPUs of {flavor.name} and its other "
            f"sub-teams hold {held}"
        )
    floors: list[tuple[int, str]] = []
    children = _guarantee_sum(of_flavor.filter(team__parent=team))
    if children:
        floors.append(
            (
                children,
                f"the sub-teams of {team.slug} are guaranteed {children} GPUs of {flavor.name}",
            )
        )
    jobs = job_ledger().active_non_preemptible(subtree, flavor_id=flavor.pk)
    running = sum(total for _, _, total in jobs)
    if running:
        names = ", ".join(
            f"job {job_id}" + (f" ({name})" if name else "") for job_id, name, _ in jobs
        )
        floors.append(
            (
                running,
                f"{team.slug} runs {running} GPUs of {flavor.name} in non-preemptible jobs "
                f"({names})",
            )
        )
    low = max((gpus for gpus, _ in floors), default=0)
    return AllowedRange(
        "guarantee",
        low,
        min(max(high, 0), MAX_GPUS),
        reasons=(*(reason for _, reason in floors), ceiling),
    )


def quota_ranges(
    *, team: Team, flavor: ResourceFlavor, subtree: set[int]
) -> dict[str, AllowedRange]:
    """The allowed range of each field of the quota of (team, flavor)."""
    return {
        "guarantee": guarantee_range(team=team, flavor=flavor, subtree=subtree),
        "borrow_limit": BORROW_LIMIT_RANGE,
        "lend_limit": LEND_LIMIT_RANGE,
    }
