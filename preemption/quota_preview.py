"""What a quota edit would do, before anyone saves it: validated exactly like
`quotas.services.quota_update`, then planned by the engine against today's
jobs. It lives with the jobs because its answer is about them: which running
jobs would be reclaimed, and why, in the words of `preemption.reasons`."""

from __future__ import annotations

from typing import Any

from django.db import models

import fairshare
from preemption.models import ACTIVE_STATES, WAITING_STATES, Job
from preemption.reasons import Preemptor, preemption_words, usage_lowers_share, usage_words
from preemption.snapshot import build_snapshot
from quotas.models import Quota, ResourceFlavor, Team
from quotas.selectors import team_tree
from quotas.services import UNSET, quota_validate
from quotas.validation import check_weight


def non_preemptible_work(*, team: Team, flavor: ResourceFlavor, guarantee: int) -> dict[str, Any]:
    """The jobs of a class that is never preempted, which a guarantee of
    (team, flavor) must make room for.

    R5 lets such jobs run only inside their team's guarantee and no rule may
    take them back, so the running ones are a floor under the guarantee of
    their team and of every team above it (`quota_validate` refuses a cut
    below it). A waiting one larger than its own team's guarantee would never
    start: the preview lists those as stranded by the change.
    """
    subtree = team_tree().subtree([team.pk])
    rows = list(
        Job.objects.filter(
            team_id__in=subtree,
            flavor=flavor,
            priority_class__preemptible=False,
            state__in=[*ACTIVE_STATES, *WAITING_STATES],
        )
        .order_by("id")
        .values("id", "name", "team_id", "team__slug", "ranks", "gpus_per_rank", "state")
        .annotate(priority_class_name=models.F("priority_class__name"))
    )

    def describe(row: dict[str, Any]) -> dict[str, Any]:
        return {
            "job_id": row["id"],
            "job_name": row["name"],
            "team": row["team__slug"],
            "gpus": row["ranks"] * row["gpus_per_rank"],
            "priority_class": row["priority_class_name"],
        }

    running = [describe(row) for row in rows if row["state"] in ACTIVE_STATES]
    stranded = []
    for row in rows:
        job = describe(row)
        if row["state"] in WAITING_STATES and row["team_id"] == team.pk and job["gpus"] > guarantee:
            job["why"] = (
                f"{job['priority_class']} is never preempted, so it runs only inside "
                f"{team.slug}'s guarantee: it needs {job['gpus']} GPUs of {flavor.name}, "
                f"the guarantee would be {guarantee}."
            )
            stranded.append(job)
    return {
        "running": running,
        "floor": sum(job["gpus"] for job in running),
        "stranded": stranded,
    }


def quota_preview(
    *,
    quota: Quota,
    guarantee: Any = UNSET,
    borrow_limit: Any = UNSET,
    lend_limit: Any = UNSET,
    weight: Any = UNSET,
) -> dict[str, Any]:
    """Validate a quota edit exactly like `quota_update`, save nothing, and say
    what it would do: running jobs that would be reclaimed, admissions it would
    allow, and how every fair share moves."""
    new_guarantee = quota.guarantee if guarantee is UNSET else guarantee
    new_borrow = quota.borrow_limit if borrow_limit is UNSET else borrow_limit
    new_lend = quota.lend_limit if lend_limit is UNSET else lend_limit
    quota_validate(
        team=quota.team,
        flavor=quota.flavor,
        guarantee=new_guarantee,
        borrow_limit=new_borrow,
        lend_limit=new_lend,
    )
    if weight is not UNSET:
        check_weight(weight)
    change = fairshare.QuotaChange(
        queue=quota.team.slug,
        flavor=quota.flavor.name,
        guarantee=new_guarantee,
        borrow_limit=new_borrow,
        lend_limit=new_lend,
        **({} if weight is UNSET else {"weight": float(weight)}),
    )
    snapshot = build_snapshot()
    consequences = fairshare.diff(snapshot, [change])
    result = fairshare.consequences_to_dict(consequences)
    result["decayed_usage"] = decayed_usage_effects(
        fairshare.apply_changes(snapshot, [change]), flavor=quota.flavor.name
    )
    _describe_reclaimed(result.get("reclaimed", []))
    result["non_preemptible"] = non_preemptible_work(
        team=quota.team, flavor=quota.flavor, guarantee=new_guarantee
    )
    result["change"] = {
        "team": quota.team.slug,
        "flavor": quota.flavor.name,
        "guarantee": {"before": quota.guarantee, "after": new_guarantee},
        "borrow_limit": {"before": quota.borrow_limit, "after": new_borrow},
        "lend_limit": {"before": quota.lend_limit, "after": new_lend},
    }
    return result


def decayed_usage_effects(snapshot: fairshare.Snapshot, *, flavor: str) -> list[dict[str, Any]]:
    """Each team whose fair share of `flavor` decayed usage makes smaller in the plan
    of `snapshot`: its usage ratio, fair share with and without it, and the sentence
    that says so (the one the job pages use). Empty while usage does not count."""
    if snapshot.usage_strength <= 0:
        return []
    effects = []
    for team, flavors in sorted(fairshare.plan(snapshot).queues.items()):
        status = flavors.get(flavor)
        if status is None or not usage_lowers_share(status):
            continue
        effects.append(
            {
                "team": team,
                "usage_ratio": round(status.usage_ratio, 2),
                "fair_share": round(status.fair_share, 2),
                "weight_fair_share": round(status.weight_fair_share, 2),
                "why": usage_words(
                    team=team,
                    flavor=flavor,
                    status=status,
                    half_life_seconds=snapshot.usage_half_life_seconds,
                ),
            }
        )
    return effects


def _job_key(value: Any) -> int | None:
    return int(value) if str(value if value is not None else "").isdigit() else None


def _describe_reclaimed(reclaimed: list[dict[str, Any]]) -> None:
    """Name each victim the engine chose by id (job id, name, team, GPUs) and
    say why, worded like the preemption it would become."""
    ids = {
        key
        for item in reclaimed
        for key in (
            _job_key(item.get("job_id")),
            _job_key(item.get("id")),
            _job_key(item.get("preemptor")),
        )
        if key is not None
    }
    jobs = {
        job.pk: job
        for job in Job.objects.select_related("team", "priority_class").filter(id__in=ids)
    }
    for item in reclaimed:
        victim = jobs.get(_job_key(item.get("job_id")) or _job_key(item.get("id")) or -1)
        if victim is not None:
            item.setdefault("job_id", victim.pk)
            item.setdefault("job_name", victim.name)
            item.setdefault("team", victim.team.slug)
            item.setdefault("gpus", victim.gpus)
        preemptor = jobs.get(_job_key(item.get("preemptor")) or -1)
        item["why"] = preemption_words(
            reason=str(item.get("reason", "")),
            preemptor=Preemptor.of(preemptor) if preemptor is not None else None,
            victim_gpus=victim.gpus if victim is not None else 0,
        )
