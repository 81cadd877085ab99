"""Every read of jobs and their history, scoped to the asking user, and the control
plane's own estimate of each running attempt's preemption risk."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import (
    Case,
    DurationField,
    ExpressionWrapper,
    F,
    Func,
    IntegerField,
    OuterRef,
    PositiveIntegerField,
    Q,
    QuerySet,
    Subquery,
    Sum,
    Value,
    When,
)
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

import fairshare
from core.access import User
from preemption.models import (
    Attempt,
    Checkpoint,
    Job,
    JobState,
    PreemptionEvent,
    Rank,
    TrapEvent,
    Webhook,
    attempt_ranks,
)
from preemption.reasons import describe_preemption
from preemption.risk import (
    HOUR,
    NO_OWNER_WAITS,
    MeasuredRate,
    Reclaimer,
    Risk,
    RunningJob,
    Standing,
    estimate_mtbp,
)
from preemption.snapshot import build_snapshot
from quotas.selectors import access_for


def _readable(user: User) -> set[int] | None:
    """Team ids whose jobs the user may read, or None for everything."""
    access = access_for(user)
    if access.is_admin:
        return None
    return access.readable_teams


def job_list(
    *,
    user: User,
    team_id: int | None = None,
    state: str | None = None,
    submitter_id: int | None = None,
) -> QuerySet[Job]:
    queryset = Job.objects.select_related("team", "submitter", "priority_class", "flavor")
    teams = _readable(user)
    if teams is not None:
        queryset = queryset.filter(team_id__in=teams)
    if team_id is not None:
        queryset = queryset.filter(team_id=team_id)
    if state:
        queryset = queryset.filter(state=state)
    if submitter_id is not None:
        queryset = queryset.filter(submitter_id=submitter_id)
    return queryset


def attempt_list(*, user: User) -> QuerySet[Attempt]:
    queryset = Attempt.objects.select_related("job")
    teams = _readable(user)
    return queryset if teams is None else queryset.filter(job__team_id__in=teams)


def with_checkpoint_step(attempts: QuerySet[Attempt]) -> QuerySet[Attempt]:
    """Attempts annotated with `checkpoint_step`: the step of the last checkpoint each
    committed (the one its stop saved, for a stopped attempt), from the stop's own
    record where the checkpoint's row is missing; None where it committed none."""
    last = (
        Checkpoint.objects.filter(attempt=OuterRef("pk"))
        .order_by("-committed_at", "-id")
        .values("step")[:1]
    )
    return attempts.annotate(
        checkpoint_step=Coalesce(
            Subquery(last), F("preemption__checkpoint_step"), output_field=IntegerField()
        )
    )


def jobs_with_checkpoint_step(jobs: QuerySet[Job]) -> QuerySet[Job]:
    """Jobs annotated with `checkpoint_step`: the step of the last checkpoint any of
    their attempts committed; None where none committed one."""
    last = (
        Checkpoint.objects.filter(job=OuterRef("pk"))
        .order_by("-committed_at", "-id")
        .values("step")[:1]
    )
    return jobs.annotate(checkpoint_step=Subquery(last, output_field=IntegerField()))


def rank_list(*, user: User) -> QuerySet[Rank]:
    queryset = Rank.objects.select_related("attempt")
    teams = _readable(user)
    return queryset if teams is None else queryset.filter(attempt__job__team_id__in=teams)


def preemption_event_list(*, user: User) -> QuerySet[PreemptionEvent]:
    """Preemptions the user may read; a person's cancel is not one of them."""
    queryset = PreemptionEvent.objects.preemptions().select_related(
        "job",
        "job__team",
        "preemptor",
        "preemptor__team",
        "preemptor__priority_class",
        "victim_attempt",
    )
    teams = _readable(user)
    return queryset if teams is None else queryset.filter(job__team_id__in=teams)


def checkpoint_list(*, user: User) -> QuerySet[Checkpoint]:
    queryset = Checkpoint.objects.select_related("job", "attempt")
    teams = _readable(user)
    return queryset if teams is None else queryset.filter(job__team_id__in=teams)


def webhook_list(*, user: User) -> QuerySet[Webhook]:
    access = access_for(user)
    queryset = Webhook.objects.select_related("team")
    if access.is_admin:
        return queryset
    return queryset.filter(team_id__in=access.tree.subtree(access.managed))


# --- the jobs table ------------------------------------------------------------------

# The columns a reader may sort by, each mapped to the ordering it means. Only
# these keys reach `order_by`, so a crafted `?sort=` can neither fail the query
# nor sort by a field that is not shown (a password hash through a relation).
JOB_SORTS: dict[str, tuple[str, ...]] = {
    "job": ("id",),
    "name": ("name", "id"),
    "team": ("team__slug", "id"),
    "submitter": ("submitter__username", "id"),
    "class": ("priority_class__name", "id"),
    "gpus": ("gpu_count", "id"),
    "state": ("state", "id"),
    "submitted": ("submitted_at", "id"),
    "duration": ("run_time", "id"),
    "gpu_hours": ("gpu_time", "id"),
}
DEFAULT_JOB_SORT = "-submitted"
JOB_COLUMNS = [
    ("job", "Job"),
    ("team", "Team"),
    ("submitter", "Submitted by"),
    ("class", "Class"),
    ("gpus", "Ranks × GPUs"),
    ("state", "State"),
    ("submitted", "Submitted"),
    ("duration", "Ran for"),
    ("gpu_hours", "GPU-hours"),
]


def job_sort_headers(sort: str) -> list[dict[str, str]]:
    """The table's column heads: each links to sorting by it, ascending, or
    descending when it is already the ascending sort; `aria` tells assistive
    technology which column sorts the table and how."""
    heads = []
    for key, label in JOB_COLUMNS:
        current = sort.removeprefix("-") == key
        descending = sort.startswith("-")
        heads.append(
            {
                "key": key,
                "label": label,
                "next": f"-{key}" if current and not descending else key,
                "aria": ("descending" if descending else "ascending") if current else "none",
            }
        )
    return heads


def job_sort_key(requested: str | None) -> str:
    """The sort key asked for if it is one of JOB_SORTS (with an optional leading
    minus for descending), otherwise the default: an unknown key is ignored."""
    if requested and requested.removeprefix("-") in JOB_SORTS:
        return requested
    return DEFAULT_JOB_SORT


class DurationTimesCount(Func):
    """A duration times a whole number, as a duration, on both databases.

    Django compiles `duration * integer` through the backend's duration
    arithmetic, which on SQLite (durations stored as microseconds) knows only
    addition and subtraction and fails the whole query ("Invalid arguments for
    operator *"). PostgreSQL multiplies an interval by an integer natively, and
    SQLite's integer microseconds times an integer are still microseconds, which
    DurationField reads back as a timedelta: the plain product is right on both."""

    arg_joiner = " * "
    template = "(%(expressions)s)"
    output_field = DurationField()


def with_stop_reason(jobs: QuerySet[Job]) -> QuerySet[Job]:
    """`jobs` with `stop_reason`: the reason of the stop under way on each job's open
    attempt ("" when none), read in the same query, so that a list words a stopping
    job as its page does (`reasons.job_state_words`: "Stopping", not "Preempting",
    for the gang guard's stop or the portal's shutdown)."""
    stop_reason = PreemptionEvent.objects.filter(
        job=OuterRef("pk"), victim_attempt__ended_at__isnull=True, outcome=""
    ).values("reason")[:1]
    return jobs.annotate(stop_reason=Coalesce(Subquery(stop_reason), Value("")))


def job_table(
    jobs: QuerySet[Job],
    *,
    sort: str | None = None,
    search: str = "",
    first_submitter_id: int | None = None,
) -> QuerySet[Job]:
    """An already scoped queryset of jobs as the jobs table shows it: matched
    against `search` (name or command, case-insensitive), with the time its
    attempts ran (`run_time`) and that time times its GPUs (`gpu_time`), and
    ordered by a whitelisted sort key. With `first_submitter_id` that user's
    own jobs come first, in the chosen order among themselves; with `stop_reason`
    (`with_stop_reason`)."""
    if search.strip():
        needle = search.strip()
        jobs = jobs.filter(Q(name__icontains=needle) | Q(command__icontains=needle))
    # An attempt runs from its admission (as the GPU-hours report counts it)
    # until it ended, or until now while it is open.
    run_time = (
        Attempt.objects.filter(job=OuterRef("pk"))
        .order_by()
        .values("job")
        .annotate(total=Sum(Coalesce("ended_at", Now()) - F("admitted_at")))
        .values("total")
    )
    # Each attempt's time times the ranks it ran: an elastic job's attempts may
    # differ in size. Summed per job as run_time is.
    gpu_time = (
        Attempt.objects.filter(job=OuterRef("pk"))
        .order_by()
        .values("job")
        .annotate(
            total=Sum(
                DurationTimesCount(
                    ExpressionWrapper(
                        Coalesce("ended_at", Now()) - F("admitted_at"),
                        output_field=DurationField(),
                    ),
                    attempt_ranks(),
                )
            )
        )
        .values("total")
    )
    jobs = with_stop_reason(jobs).annotate(
        gpu_count=ExpressionWrapper(
            F("ranks") * F("gpus_per_rank"), output_field=PositiveIntegerField()
        ),
        run_time=Subquery(run_time, output_field=DurationField()),
        gpu_time=DurationTimesCount(
            Subquery(gpu_time, output_field=DurationField()), F("gpus_per_rank")
        ),
    )
    key = job_sort_key(sort)
    descending = key.startswith("-")
    ordering: list[Any] = []
    if first_submitter_id is not None:
        jobs = jobs.annotate(
            is_theirs=Case(
                When(submitter_id=first_submitter_id, then=Value(0)),
                default=Value(1),
                output_field=IntegerField(),
            )
        )
        ordering.append("is_theirs")
    for field in JOB_SORTS[key.removeprefix("-")]:
        # A job never admitted has no run time; it sorts last either way.
        expression = F(field)
        ordering.append(
            expression.desc(nulls_last=True) if descending else expression.asc(nulls_last=True)
        )
    return jobs.order_by(*ordering)


def stop_in_progress(attempts: list[Attempt]) -> PreemptionEvent | None:
    """The preemption or cancel now stopping the job's open attempt, whose
    deadline the job page counts down to; None when no stop is under way.
    Works on attempts already loaded with their `preemption`, so it costs no query."""
    for attempt in attempts:
        if attempt.ended_at is not None:
            continue
        event: PreemptionEvent | None = getattr(attempt, "preemption", None)
        if event is not None and not event.outcome:
            return event
    return None


# --- preemption risk -----------------------------------------------------------------

# Stops that the engine decides. A person's cancel, the gang guard (a rank died) and
# the embedded portal's shutdown say nothing about how often the engine takes GPUs back.
ENGINE_PREEMPTION_REASONS = (
    PreemptionEvent.Reason.RECLAIM,
    PreemptionEvent.Reason.PRIORITY,
    PreemptionEvent.Reason.FAIR_SHARE,
    PreemptionEvent.Reason.CONSOLIDATE,
)

# (team slug, flavor name, whether the attempt borrowed GPUs when admitted)
RateKey = tuple[str, str, bool]


def measured_preemption_rates(
    *, now: datetime, window_seconds: float
) -> dict[RateKey, MeasuredRate]:
    """Preempted GPUs per GPU-hour run over the window before ``now``, for each team,
    flavor and borrowing state, from the recorded attempts and preemptions.

    Two queries whatever the number of jobs; the GPU-hours are summed here rather than in
    SQL so that the same code runs on SQLite (the embedded portal) and PostgreSQL.
    """
    since = now - timedelta(seconds=window_seconds)
    gpu_seconds: dict[RateKey, float] = defaultdict(float)
    rows = (
        Attempt.objects.filter(admitted_at__lt=now)
        .filter(Q(ended_at__isnull=True) | Q(ended_at__gt=since))
        .values_list(
            "job__team__slug",
            "job__flavor__name",
            "borrowed_gpus",
            attempt_ranks(),
            "job__gpus_per_rank",
            "admitted_at",
            "ended_at",
        )
    )
    for team, flavor, borrowed, ranks, gpus_per_rank, admitted_at, ended_at in rows:
        start = max(admitted_at, since)
        end = min(ended_at or now, now)
        if end > start:
            gpu_seconds[(team, flavor, borrowed > 0)] += (
                ranks * gpus_per_rank * (end - start).total_seconds()
            )
    preempted: dict[RateKey, int] = defaultdict(int)
    for team, flavor, borrowed, ranks, gpus_per_rank in PreemptionEvent.objects.filter(
        reason__in=ENGINE_PREEMPTION_REASONS, decided_at__gt=since, decided_at__lte=now
    ).values_list(
        "job__team__slug",
        "job__flavor__name",
        "victim_attempt__borrowed_gpus",
        Coalesce("victim_attempt__ranks", "job__ranks"),
        "job__gpus_per_rank",
    ):
        preempted[(team, flavor, borrowed > 0)] += ranks * gpus_per_rank
    return {
        key: MeasuredRate(
            preempted_gpus=preempted.get(key, 0),
            gpu_hours=gpu_seconds.get(key, 0.0) / HOUR,
            window_hours=window_seconds / HOUR,
        )
        for key in set(gpu_seconds) | set(preempted)
    }


def running_attempt_risks(*, now: datetime, window_seconds: float) -> dict[int, Risk]:
    """Each running attempt's preemption risk (see ``preemption.risk``), by attempt id.

    The control plane's own read, for every team at once (it feeds the ranks' cadence
    hint); people read the stored estimate through ``job_list``. A fixed number of
    queries: the engine's snapshot, the running attempts and the measured rates.
    """
    snapshot = build_snapshot(now=now)
    plan = fairshare.plan(snapshot)
    workloads = {workload.id: workload for workload in snapshot.workloads}
    waiting: dict[tuple[str, str], list[int]] = defaultdict(list)
    for wait in plan.waiting:
        workload = workloads.get(wait.id)
        if workload is not None:
            waiting[(workload.queue, workload.flavor)].append(workload.gpus)

    def standing(team: str, flavor: str) -> Standing:
        status = plan.queues.get(team, {}).get(flavor)
        if status is None:
            return Standing(guarantee=0, usage=0, fair_share=0.0)
        return Standing(
            guarantee=status.guarantee, usage=status.usage, fair_share=status.fair_share
        )

    def reclaimers(team: str, flavor: str) -> tuple[Reclaimer, ...]:
        found = []
        for (queue, queue_flavor), sizes in sorted(waiting.items()):
            if queue == team or queue_flavor != flavor:
                continue
            owner = standing(queue, flavor)
            room = owner.guarantee - owner.usage
            fitting = sum(1 for gpus in sizes if gpus <= room)
            if fitting:
                found.append(Reclaimer(team=queue, waiting_jobs=fitting))
        return tuple(found)

    rates = measured_preemption_rates(now=now, window_seconds=window_seconds)
    risks: dict[int, Risk] = {}
    for attempt_id, team, flavor, class_name, preemptible, borrowed in Attempt.objects.filter(
        ended_at__isnull=True, job__state__in=[JobState.ADMITTED, JobState.RUNNING]
    ).values_list(
        "id",
        "job__team__slug",
        "job__flavor__name",
        "job__priority_class__name",
        "job__priority_class__preemptible",
        "borrowed_gpus",
    ):
        team_standing = standing(team, flavor)
        risks[attempt_id] = estimate_mtbp(
            RunningJob(
                team=team, flavor=flavor, preemptible=preemptible, priority_class=class_name
            ),
            standing=team_standing,
            reclaimers=reclaimers(team, flavor) if team_standing.borrowed else (),
            others_waiting=any(
                sizes for (queue, f), sizes in waiting.items() if queue != team and f == flavor
            ),
            measured=rates.get((team, flavor, borrowed > 0)),
        )
    return risks


# A stop decided within this long is news the stored estimate may not reflect: the
# refresh rewrites an estimate only when it moved, and a borrower's estimate is hours.
RECENT_STOP = timedelta(hours=1)


@dataclass(frozen=True)
class Cadence:
    """A running job's checkpoint cadence: the control plane's risk estimate and
    reasons, and the interval its trap last reported choosing from it (None until it
    reported one: a trap of another version, or no checkpoint measured yet).

    `stop_*` tell the stop now under way on the open attempt or, failing that, the
    engine's last preemption of the job within RECENT_STOP: the estimate's reasons
    are worded with it, so the card never says no owner waits while one takes the
    GPUs back."""

    attempt: int
    mtbp_seconds: float | None
    reasons: list[str]
    estimated_at: datetime | None
    interval_seconds: float | None = None
    save_cost: float | None = None
    trap_mtbp_seconds: float | None = None
    reported_at: float | None = None
    stop_under_way: bool = False
    stop_attempt: int | None = None
    stop_decided_at: datetime | None = None
    stop_why: str = ""
    stop_ago: str = ""


def _ago(seconds: float) -> str:
    """ "79 s", "12 min", "3 h 5 min": how long ago a stop was decided."""
    seconds = max(0, round(seconds))
    if seconds < 120:
        return f"{seconds} s"
    minutes = seconds // 60
    if minutes < 120:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60} min"


def _latest_stop(
    attempts: list[Attempt], current: Attempt, now: datetime
) -> tuple[PreemptionEvent, int, bool] | None:
    """The stop under way on the open attempt, else the engine's latest preemption of
    an earlier attempt decided within RECENT_STOP: the stop, its attempt's number and
    whether it is under way."""
    under_way = stop_in_progress([current])
    if under_way is not None:
        return under_way, current.number, True
    recent = [
        (event, attempt.number, False)
        for attempt in attempts
        if attempt.number < current.number
        and (event := getattr(attempt, "preemption", None)) is not None
        and event.reason in ENGINE_PREEMPTION_REASONS
        and now - event.decided_at <= RECENT_STOP
    ]
    return max(recent, key=lambda found: found[0].decided_at) if recent else None


def job_cadence(*, attempts: list[Attempt], now: datetime | None = None) -> Cadence | None:
    """The cadence of the job's open attempt (from attempts already loaded and already
    scoped to the reader, with their `preemption`), or None when no attempt is open.
    One query: rank 0's latest `cadence` event."""
    current = next((attempt for attempt in attempts if attempt.ended_at is None), None)
    if current is None:
        return None
    reported = (
        TrapEvent.objects.filter(
            job_id=current.job_id, attempt=current.number, rank=0, event="cadence"
        )
        .order_by("-at", "-id")
        .values_list("payload", "at")
        .first()
    )
    payload, at = reported if reported is not None else ({}, None)
    reasons = list(current.preemption_risk_reasons or [])
    stop_fields: dict[str, Any] = {}
    now = now or timezone.now()
    found = _latest_stop(attempts, current, now)
    if found is not None:
        stop, number, under_way = found
        why = describe_preemption(stop)
        ago = _ago((now - stop.decided_at).total_seconds())
        told = (
            f"it is being stopped now: {why}"
            if under_way
            else f"attempt {number} was stopped {ago} ago: {why}"
        )
        reasons = [reason.replace(NO_OWNER_WAITS, told) for reason in reasons]
        stop_fields = {
            "stop_under_way": under_way,
            "stop_attempt": number,
            "stop_decided_at": stop.decided_at,
            "stop_why": why,
            "stop_ago": ago,
        }
    return Cadence(
        attempt=current.number,
        mtbp_seconds=current.preemption_mtbp_seconds,
        reasons=reasons,
        estimated_at=current.preemption_risk_at,
        interval_seconds=payload.get("interval_seconds"),
        save_cost=payload.get("save_cost"),
        trap_mtbp_seconds=payload.get("mtbp_seconds"),
        reported_at=at,
        **stop_fields,
    )
