"""Writes of telemetry that the system makes on its own schedule, and the
record of each drill."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import transaction

import fairshare
from core.access import Access
from preemption.snapshot import build_snapshot
from quotas.selectors import team_tree
from telemetry.models import DrillRun, UtilizationSample
from telemetry.selectors import UsageNow, flavors_now, team_rows


@transaction.atomic
def utilization_sample(now: datetime) -> int:
    """Record what every team uses, is guaranteed and borrows of every flavor at
    `now`, one row per (team, flavor) that has a quota or usage.

    Inner teams get rows too (their subtree's usage), so a chart can stack any
    level of the tree. Sampling the same moment twice writes nothing new.
    Returns the number of rows written.
    """
    tree = team_tree()
    everyone = Access(
        is_admin=True, user_id=None, tree=tree, managed=frozenset(), member_of=frozenset()
    )
    usage = UsageNow.load(tree)
    flavors = flavors_now(usage)
    capacity = {flavor.name: flavor.capacity for flavor in flavors}
    flavor_ids = {flavor.name: flavor.flavor_id for flavor in flavors}
    # Who lends to whom, and each team's fair share, are the engine's view:
    # ask it once for the whole cluster.
    engine = fairshare.plan(build_snapshot(now=now)).queues
    samples = []
    for row in team_rows(access=everyone, usage=usage):
        for flavor, usage in row.flavors.items():
            if not (usage.has_quota or usage.used):
                continue
            status = engine.get(row.slug, {}).get(flavor)
            samples.append(
                UtilizationSample(
                    at=now,
                    team_id=row.team_id,
                    flavor_id=flavor_ids[flavor],
                    used=usage.used,
                    guarantee=usage.guarantee,
                    borrowed=usage.borrowed,
                    capacity=capacity.get(flavor, 0),
                    lent=status.lent if status is not None else 0,
                    fair_share=status.fair_share if status is not None else 0.0,
                )
            )
    before = UtilizationSample.objects.filter(at=now).count()
    UtilizationSample.objects.bulk_create(samples, ignore_conflicts=True)
    return UtilizationSample.objects.filter(at=now).count() - before


def drill_run_record(
    *,
    started_at: datetime,
    finished_at: datetime,
    runtime: str,
    ranks: int,
    grace_seconds: float,
    chaos_rounds: int,
    passed: bool,
    result: dict[str, Any],
) -> DrillRun:
    """Store a finished drill with every figure it measured (its `--json` document)."""
    return DrillRun.objects.create(
        started_at=started_at,
        finished_at=finished_at,
        runtime=runtime,
        ranks=ranks,
        grace_seconds=grace_seconds,
        chaos_rounds=chaos_rounds,
        passed=passed,
        result=result,
    )
