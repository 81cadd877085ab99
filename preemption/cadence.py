"""The cadence hint: estimate every running attempt's preemption risk, record it where
it changed, and hand it to the ranks through the runtime.

Run by the beat every ``QM_RISK_SECONDS``. The estimate costs a fixed number of
queries whatever the number of jobs (``running_attempt_risks``); the rows are written
in one bulk update, and only those whose estimate changed. Delivery is
level-triggered: every launched gang is handed its current estimate each time, and
the runtimes skip a gang whose ranks already have it (the local runtime compares the
file, the Kubernetes runtime remembers what it last wrote), so a gang launched
between the estimate and the write, or a worker that restarted, still gets it.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core.rows import update_rows
from preemption.models import Attempt
from preemption.runtime import get_runtime
from preemption.runtimes.base import (
    GangId,
    Runtime,
    RuntimePermanentError,
    RuntimeTemporaryError,
)
from preemption.selectors import running_attempt_risks

logger = logging.getLogger(__name__)

# An estimate that moved less than this fraction is not written again: the interval
# follows its square root, so 5% of MTBP moves the cadence by about 2.5%.
CHANGE_FRACTION = 0.05


@dataclass
class RiskRefresh:
    """What one refresh did."""

    estimated: int = 0
    changed: int = 0
    published: int = 0
    failed: int = 0


def _moved(old: float | None, new: float) -> bool:
    return old is None or not math.isclose(old, new, rel_tol=CHANGE_FRACTION)


def _causes(reasons: list[str] | tuple[str, ...]) -> list[str]:
    """The reasons without their figures: the GPU-hours of a measured rate grow with
    every refresh, and rewriting every row for that alone would cost a write per job."""
    return [re.sub(r"\d+(\.\d+)?", "#", reason) for reason in reasons]


def preemption_risk_refresh(
    *, now: datetime | None = None, runtime: Runtime | None = None
) -> RiskRefresh:
    """Estimate, record and deliver every running attempt's preemption risk."""
    now = now or timezone.now()
    result = RiskRefresh()
    risks = running_attempt_risks(now=now, window_seconds=settings.QM_RISK_WINDOW_SECONDS)
    result.estimated = len(risks)
    attempts = list(
        Attempt.objects.filter(pk__in=risks).values_list(
            "pk",
            "job_id",
            "number",
            "job__team__slug",
            "launched_at",
            "preemption_mtbp_seconds",
            "preemption_risk_reasons",
        )
    )
    changed = []
    deliver: list[tuple[GangId, float, str]] = []
    for pk, job_id, number, team, launched_at, old_mtbp, old_reasons in attempts:
        risk = risks[pk]
        mtbp = risk.mtbp_seconds
        if _moved(old_mtbp, mtbp) or _causes(risk.reasons) != _causes(old_reasons or []):
            if not _moved(old_mtbp, mtbp) and old_mtbp is not None:
                # Only the words changed: keep the number the ranks already have.
                mtbp = old_mtbp
            changed.append(
                Attempt(
                    pk=pk,
                    preemption_mtbp_seconds=mtbp,
                    preemption_risk_reasons=list(risk.reasons),
                    preemption_risk_at=now,
                )
            )
        elif old_mtbp is not None:
            mtbp = old_mtbp
        if launched_at is not None:
            deliver.append((GangId(job_id=job_id, attempt=number), mtbp, team))
    if changed:
        with transaction.atomic():
            update_rows(
                changed,
                ["preemption_mtbp_seconds", "preemption_risk_reasons", "preemption_risk_at"],
            )
    result.changed = len(changed)
    if deliver:
        runtime = runtime or get_runtime()
    for gang, mtbp, team in deliver:
        assert runtime is not None
        try:
            runtime.publish_preemption_risk(gang, mtbp, team=team)
            result.published += 1
        except (RuntimeTemporaryError, RuntimePermanentError) as error:
            # A hint is a courtesy: the gang keeps its last one, the next refresh retries.
            result.failed += 1
            logger.warning("cadence hint for %s not delivered: %s", gang, error)
    return result
