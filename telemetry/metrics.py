"""`/metrics` in the Prometheus text exposition format (version 0.0.4).

Everything is computed from the database at scrape time with a fixed number of
aggregate queries, and scoped like every other read: an admin sees the whole
cluster, anyone else only their readable teams.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta

from django.db.models import Count, DurationField, ExpressionWrapper, F, Q, Sum

from core.access import Access
from preemption.models import WAITING_STATES, Checkpoint, Job, PreemptionEvent, Rank
from telemetry.mission import MISSION
from telemetry.preemption_selectors import GROW, SHRINK, counted_resizes, resize_direction
from telemetry.selectors import team_rows

# One bucket edge sits on the mission's target, so a query can count the ranks over it.
SIGNAL_LATENCY_BUCKETS = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    MISSION.signal_propagation_seconds,
    2.0,
    5.0,
    10.0,
)
CHECKPOINT_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 90.0, 120.0)
# A resized gang stops like a victim: within its grace window (60 s for batch, 90 s
# for critical by default) or killed at its deadline, so the edges reach past both.
RESIZE_FREE_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 90.0, 120.0, 300.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: str) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{key}="{_escape(str(value))}"' for key, value in labels.items()) + "}"


def _number(value: float) -> str:
    return (
        repr(float(value))
        if isinstance(value, float) and not value.is_integer()
        else str(int(value))
    )


class Exposition:
    """Lines of one scrape, each metric family announced once."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, **labels: str) -> None:
        self.lines.append(f"{name}{_labels(**labels)} {_number(value)}")

    def histogram(
        self,
        name: str,
        buckets: Sequence[float],
        cumulative: Iterable[int],
        count: int,
        total: float,
        **labels: str,
    ) -> None:
        for bound, observed in zip(buckets, cumulative, strict=True):
            self.sample(f"{name}_bucket", observed, **labels, le=f"{bound:g}")
        self.sample(f"{name}_bucket", count, **labels, le="+Inf")
        self.sample(f"{name}_sum", round(total, 6), **labels)
        self.sample(f"{name}_count", count, **labels)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _scope(access: Access, lookup: str) -> Q:
    return Q() if access.is_admin else Q(**{f"{lookup}__in": access.readable_teams})


def render_metrics(*, access: Access) -> str:
    """The whole exposition for one scrape."""
    out = Exposition()
    rows = team_rows(access=access)
    out.family("qm_gpus_used", "gauge", "GPUs held by admitted, running or preempting jobs.")
    for row in rows:
        for flavor, usage in row.flavors.items():
            if usage.has_quota or usage.used:
                out.sample("qm_gpus_used", usage.used, team=row.slug, flavor=flavor)
    out.family("qm_gpu_guarantee", "gauge", "GPUs guaranteed to the team.")
    for row in rows:
        for flavor, usage in row.flavors.items():
            if usage.has_quota:
                out.sample("qm_gpu_guarantee", usage.guarantee, team=row.slug, flavor=flavor)
    out.family("qm_gpus_borrowed", "gauge", "GPUs the team uses beyond its guarantee.")
    for row in rows:
        for flavor, usage in row.flavors.items():
            if usage.has_quota or usage.used:
                out.sample("qm_gpus_borrowed", usage.borrowed, team=row.slug, flavor=flavor)

    pending = (
        Job.objects.filter(state__in=WAITING_STATES)
        .filter(_scope(access, "team_id"))
        .values("team__slug", "flavor__name")
        .annotate(jobs=Count("id"), gpus=Sum(F("ranks") * F("gpus_per_rank")))
        .order_by("team__slug", "flavor__name")
    )
    pending_rows = list(pending)
    out.family("qm_jobs_pending", "gauge", "Jobs waiting for admission (pending or requeued).")
    for item in pending_rows:
        out.sample(
            "qm_jobs_pending", item["jobs"], team=item["team__slug"], flavor=item["flavor__name"]
        )
    out.family("qm_gpus_pending", "gauge", "GPUs asked for by waiting jobs.")
    for item in pending_rows:
        out.sample(
            "qm_gpus_pending",
            item["gpus"] or 0,
            team=item["team__slug"],
            flavor=item["flavor__name"],
        )

    preemptions = (
        PreemptionEvent.objects.preemptions()
        .filter(_scope(access, "job__team_id"))
        .values("reason", "outcome")
        .annotate(n=Count("id"))
        .order_by("reason", "outcome")
    )
    out.family(
        "qm_preemptions_total",
        "counter",
        "Preemptions by reason and outcome (outcome empty while in progress).",
    )
    for item in preemptions:
        out.sample(
            "qm_preemptions_total",
            item["n"],
            reason=item["reason"],
            outcome=item["outcome"] or "in-progress",
        )

    cancels = (
        PreemptionEvent.objects.cancels()
        .filter(_scope(access, "job__team_id"))
        .values("job__team__slug")
        .annotate(n=Count("id"))
        .order_by("job__team__slug")
    )
    out.family(
        "qm_cancels_total",
        "counter",
        "Running jobs a person cancelled (stopped gracefully, never requeued), by team.",
    )
    for item in cancels:
        out.sample("qm_cancels_total", item["n"], team=item["job__team__slug"])

    _resizes(out, access)

    latency = ExpressionWrapper(
        F("signal_received_at") - F("attempt__preemption__decided_at"), output_field=DurationField()
    )
    ranks = (
        Rank.objects.filter(signal_received_at__isnull=False, attempt__preemption__isnull=False)
        .exclude(attempt__preemption__reason=PreemptionEvent.Reason.MANUAL)
        .filter(_scope(access, "attempt__job__team_id"))
    )
    figures = ranks.annotate(latency=latency).aggregate(
        count=Count("id"),
        total=Sum("latency"),
        **{
            f"le_{index}": Count("id", filter=Q(latency__lte=timedelta(seconds=bound)))
            for index, bound in enumerate(SIGNAL_LATENCY_BUCKETS)
        },
    )
    out.family(
        "qm_signal_latency_seconds",
        "histogram",
        "Seconds from the preemption decision to each rank's signal_received.",
    )
    total = figures["total"]
    out.histogram(
        "qm_signal_latency_seconds",
        SIGNAL_LATENCY_BUCKETS,
        [figures[f"le_{index}"] for index in range(len(SIGNAL_LATENCY_BUCKETS))],
        figures["count"],
        total.total_seconds() if total else 0.0,
    )

    checkpoints = Checkpoint.objects.filter(_scope(access, "job__team_id")).aggregate(
        count=Count("id"),
        total=Sum("seconds"),
        **{
            f"le_{index}": Count("id", filter=Q(seconds__lte=bound))
            for index, bound in enumerate(CHECKPOINT_BUCKETS)
        },
    )
    out.family(
        "qm_checkpoint_duration_seconds",
        "histogram",
        "Seconds each committed checkpoint took to save.",
    )
    out.histogram(
        "qm_checkpoint_duration_seconds",
        CHECKPOINT_BUCKETS,
        [checkpoints[f"le_{index}"] for index in range(len(CHECKPOINT_BUCKETS))],
        checkpoints["count"],
        float(checkpoints["total"] or 0.0),
    )
    return out.text()


def _resizes(out: Exposition, access: Access) -> None:
    """Resizes of elastic gangs, beside the preemptions and never among them: how
    many by team and direction, the work they lost, and how long from the decision
    until every rank of the stopped gang had exited (for a shrink, until the GPUs
    it gives up were free). Two aggregate queries."""
    resizes = (
        PreemptionEvent.objects.filter(counted_resizes())
        .filter(_scope(access, "job__team_id"))
        .annotate(direction=resize_direction())
        .values("job__team__slug", "direction")
        .annotate(n=Count("id"), lost=Sum("lost_gpu_seconds"))
        .order_by("job__team__slug", "direction")
    )
    resize_rows = list(resizes)
    out.family(
        "qm_resizes_total",
        "counter",
        "Resizes of elastic jobs by team and direction (shrink or grow), each a stop at an "
        "agreed step and a relaunch at the new size; no preemption.",
    )
    for item in resize_rows:
        out.sample(
            "qm_resizes_total", item["n"], team=item["job__team__slug"], direction=item["direction"]
        )
    out.family(
        "qm_resize_lost_gpu_seconds_total",
        "counter",
        "GPU-seconds of work lost by resizes (since the gang's last checkpoint when it "
        "stopped), by team and direction; a resize still stopping counts once it ends.",
    )
    for item in resize_rows:
        out.sample(
            "qm_resize_lost_gpu_seconds_total",
            round(item["lost"] or 0.0, 6),
            team=item["job__team__slug"],
            direction=item["direction"],
        )

    free = ExpressionWrapper(F("all_exited_at") - F("decided_at"), output_field=DurationField())
    stopped = {
        item["direction"]: item
        for item in PreemptionEvent.objects.filter(counted_resizes(), all_exited_at__isnull=False)
        .filter(_scope(access, "job__team_id"))
        .annotate(direction=resize_direction(), free=free)
        .values("direction")
        .annotate(
            count=Count("id"),
            total=Sum("free"),
            **{
                f"le_{index}": Count("id", filter=Q(free__lte=timedelta(seconds=bound)))
                for index, bound in enumerate(RESIZE_FREE_BUCKETS)
            },
        )
        .order_by("direction")
    }
    out.family(
        "qm_resize_free_seconds",
        "histogram",
        "Seconds from a resize decision until every rank of the gang had exited, by direction: "
        "for a shrink, until the GPUs it gives up were free.",
    )
    for direction in (SHRINK, GROW):
        figures = stopped.get(direction, {})
        total = figures.get("total")
        out.histogram(
            "qm_resize_free_seconds",
            RESIZE_FREE_BUCKETS,
            [figures.get(f"le_{index}", 0) for index in range(len(RESIZE_FREE_BUCKETS))],
            figures.get("count", 0),
            total.total_seconds() if total else 0.0,
            direction=direction,
        )
