"""What a quota edit would do, before anyone saves it: validated exactly like
`quotas.services.quota_update`, then planned by the engine against today's
jobs. It lives with the jobs because its answer is about them: which running
jobs would be reclaimed, and why, in the words of `preemption.reasons`."""

from __future__ import annotations

from typing import Any

from django.db import models

import fairshare
from preemption.models import ACTIVE_STATES, WAITING_STATES, Job, JobState, running_ranks
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
        .annotate(size=running_ranks())
        .values(
            "id", "name", "team_id", "team__slug", "ranks_min", "size", "gpus_per_rank", "state"
        )
        .annotate(priority_class_name=models.F("priority_class__name"))
    )

    def describe(row: dict[str, Any]) -> dict[str, Any]:
        return {
            "job_id": row["id"],
            "job_name": row["name"],
            "team": row["team__slug"],
            # A running job holds its attempt's ranks; a waiting elastic one could start
            # at its smallest size.
            "gpus": (
                row["size"] if row["state"] in ACTIVE_STATES else row["ranks_min"] or row["size"]
            )
            * row["gpus_per_rank"],
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


def exposed_work(
    *,
    team: Team,
    flavor: ResourceFlavor,
    guarantee_before: int,
    guarantee_after: int,
    borrow_limit_before: int | None,
    borrow_limit_after: int | None,
) -> dict[str, Any]:
    """The running jobs of `team`'s subtree that a change of its (team, flavor)
    guarantee or borrow limit leaves beyond the guarantee, or over the borrow limit.

    Nobody is preempted by such a change at once (limits apply to new admissions,
    and R6 reclaims only for an owner that wants its GPUs back), but what runs
    beyond the guarantee is borrowed: by R3 and R6 it is what a reclaim takes
    first, and a gang that straddles the line goes whole. To say which jobs those
    are, the jobs fill the guarantee in the order the rules protect them: never-
    preempted jobs first (R5 keeps them inside it), then higher priority, then the
    longest running; the rest run beyond it. Jobs already preempting are leaving
    and count as used only. The jobs are all in `team`'s subtree, which whoever may
    edit the quota may read.
    """
    subtree = team_tree().subtree([team.pk])
    jobs = list(
        Job.objects.filter(team_id__in=subtree, flavor=flavor, state__in=ACTIVE_STATES)
        .select_related("team", "priority_class")
        .annotate(size=running_ranks())
        .order_by("id")
    )
    # What each job holds: its open attempt's ranks, not the most it asked for.
    held = {job.pk: job.size * job.gpus_per_rank for job in jobs}
    used = sum(held.values())

    def protection(job: Job) -> tuple[Any, ...]:
        admitted = job.admitted_at.timestamp() if job.admitted_at else float("inf")
        return (
            job.state == JobState.PREEMPTING,
            job.priority_class.preemptible,
            -job.priority_class.value,
            admitted,
            job.pk,
        )

    def beyond(guarantee: int) -> dict[int, int]:
        room, result = guarantee, {}
        for job in sorted(jobs, key=protection):
            inside = min(room, held[job.pk])
            room -= inside
            result[job.pk] = held[job.pk] - inside
        return result

    before, after = beyond(guarantee_before), beyond(guarantee_after)
    borrowed_before = max(used - guarantee_before, 0)
    borrowed_after = max(used - guarantee_after, 0)
    over_limit = (
        max(borrowed_after - borrow_limit_after, 0) if borrow_limit_after is not None else 0
    )
    over_limit_before = (
        max(borrowed_before - borrow_limit_before, 0) if borrow_limit_before is not None else 0
    )
    listed = []
    for job in sorted(jobs, key=protection):
        if job.state == JobState.PREEMPTING or not after[job.pk]:
            continue
        if after[job.pk] <= before[job.pk] and over_limit <= over_limit_before:
            continue
        listed.append(
            {
                "job_id": job.pk,
                "job_name": job.name,
                "team": job.team.slug,
                "gpus": held[job.pk],
                "beyond": after[job.pk],
                "beyond_before": before[job.pk],
                "why": exposure_words(
                    team=team.slug,
                    guarantee=guarantee_after,
                    beyond=after[job.pk],
                    gpus=held[job.pk],
                    over_borrow_limit=borrow_limit_after if over_limit else None,
                ),
            }
        )
    return {
        "team": team.slug,
        "flavor": flavor.name,
        "used": used,
        "beyond": borrowed_after,
        "beyond_before": borrowed_before,
        "over_borrow_limit": over_limit,
        "jobs": listed,
    }


def exposure_words(
    *, team: str, guarantee: int, beyond: int, gpus: int, over_borrow_limit: int | None
) -> str:
    """Why a running job is exposed by a quota change, in one sentence."""
    where = f"{beyond} of its {gpus} GPUs" if beyond < gpus else f"all {gpus} of its GPUs"
    text = f"{where} would run beyond {team}'s guarantee of {guarantee}"
    if over_borrow_limit is not None:
        text += f", over the new borrow limit of {over_borrow_limit}"
    return (
        f"{text}: it keeps them for now, but borrowed GPUs are the first to be reclaimed "
        "when an owner needs them, and the job would be preempted whole."
    )


def _scope_to_reader(
    result: dict[str, Any], visible_team_ids: set[int] | None, snapshot: fairshare.Snapshot
) -> None:
    """Name only what the asking user may read and sum up the rest, so a preview never
    shows another tenant's jobs, fair shares or usage: reclaimed and admitted jobs of
    other teams are counted (`reclaimed_elsewhere`, `admitted_elsewhere`), their
    released jobs dropped, their fair shares added up per flavor
    (`fair_share_elsewhere`) and their decayed usage only counted
    (`decayed_usage_elsewhere`). None (an admin) names everything."""
    if visible_team_ids is None:
        result["reclaimed_elsewhere"] = {"jobs": 0, "gpus": 0}
        result["admitted_elsewhere"] = {"jobs": 0, "gpus": 0}
        result["fair_share_elsewhere"] = {}
        result["decayed_usage_elsewhere"] = 0
        return
    visible_slugs = set(Team.objects.filter(id__in=visible_team_ids).values_list("slug", flat=True))
    named, hidden = [], []
    for item in result.get("reclaimed", []):
        team = item.get("team") or item.get("queue")
        (named if team in visible_slugs else hidden).append(item)
    result["reclaimed"] = named
    result["reclaimed_elsewhere"] = {
        "jobs": len(hidden),
        "gpus": sum(int(item.get("gpus") or 0) for item in hidden),
    }
    # The plan's own workloads say whose each admitted or released job is: no query.
    workloads = {workload.id: workload for workload in snapshot.workloads}

    def readable(value: Any) -> bool:
        workload = workloads.get(str(value))
        return workload is not None and workload.queue in visible_slugs

    admitted = result.get("admitted", [])
    hidden_admitted = [workloads.get(str(item.get("id"))) for item in admitted]
    hidden_admitted = [w for w in hidden_admitted if w is None or w.queue not in visible_slugs]
    result["admitted"] = [item for item in admitted if readable(item.get("id"))]
    result["admitted_elsewhere"] = {
        "jobs": len(hidden_admitted),
        "gpus": sum(w.ranks * w.gpus_per_rank for w in hidden_admitted if w is not None),
    }
    result["released"] = [item for item in result.get("released", []) if readable(item)]
    fair_share = result.get("fair_share", {})
    elsewhere: dict[str, dict[str, Any]] = {}
    for queue in [queue for queue in fair_share if queue not in visible_slugs]:
        for flavor, move in fair_share.pop(queue).items():
            total = elsewhere.setdefault(flavor, {"teams": 0, "before": 0.0, "after": 0.0})
            total["teams"] += 1
            total["before"] += move.get("before") or 0.0
            total["after"] += move.get("after") or 0.0
    result["fair_share_elsewhere"] = elsewhere
    usage = result.get("decayed_usage", [])
    result["decayed_usage"] = [item for item in usage if item.get("team") in visible_slugs]
    result["decayed_usage_elsewhere"] = len(usage) - len(result["decayed_usage"])


def quota_preview(
    *,
    quota: Quota,
    guarantee: Any = UNSET,
    borrow_limit: Any = UNSET,
    lend_limit: Any = UNSET,
    weight: Any = UNSET,
    visible_team_ids: set[int] | None = None,
) -> dict[str, Any]:
    """Validate a quota edit exactly like `quota_update`, save nothing, and say
    what it would do: running jobs that would be reclaimed, running jobs it leaves
    beyond the guarantee (`exposed`), admissions it would allow, and how every fair
    share moves.

    `visible_team_ids` are the teams the asking user may read (None: all, for
    admins): what concerns other teams is only counted or summed (`_scope_to_reader`)."""
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
    _scope_to_reader(result, visible_team_ids, snapshot)
    result["exposed"] = exposed_work(
        team=quota.team,
        flavor=quota.flavor,
        guarantee_before=quota.guarantee,
        guarantee_after=new_guarantee,
        borrow_limit_before=quota.borrow_limit,
        borrow_limit_after=new_borrow,
    )
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
