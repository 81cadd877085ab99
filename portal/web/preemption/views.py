"""Browser pages for jobs: the history with filters, one job's attempts, ranks,
checkpoints and preemption timelines, and per-rank logs.

Views stay thin: reads go through `preemption.selectors`, which scope every
query to the asking user exactly as the API does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from portal.web.preemption.forms import JobFilterForm
from preemption.logs import read_rank_log
from preemption.models import Attempt, Job, PreemptionEvent, TrapEvent
from preemption.reasons import describe_preemption
from preemption.runtimes.base import RuntimePermanentError, RuntimeTemporaryError
from preemption.selectors import job_list as job_selector
from preemption.services import job_cancel as cancel_job
from quotas.selectors import access_for

JOBS_PER_PAGE = 50
LOG_CHUNK = 65536


@dataclass
class TimelineStep:
    """One moment of a preemption, with its offset from the decision."""

    at: datetime | None
    title: str
    detail: str = ""
    kind: str = "info"  # info | good | warn | bad
    offset: float | None = None


@dataclass
class RankStory:
    """What one rank did during a preemption."""

    index: int
    node: str
    signal_sent: float | None
    signal_received: float | None
    exited: float | None
    exit_code: int | None


@dataclass
class Timeline:
    """A preemption told from the decision to the resume."""

    event: PreemptionEvent
    words: str
    steps: list[TimelineStep] = field(default_factory=list)
    ranks: list[RankStory] = field(default_factory=list)


def _seconds_after(moment: datetime | None, origin: datetime) -> float | None:
    return None if moment is None else (moment - origin).total_seconds()


def _moment(unix: float) -> datetime:
    return datetime.fromtimestamp(unix, tz=UTC)


def build_timeline(
    event: PreemptionEvent,
    attempt: Attempt,
    next_attempt: Attempt | None,
    events: list[TrapEvent],
) -> Timeline:
    """Order everything known about one preemption into steps: decision →
    signal per rank → checkpoint → exit → requeue → resume."""
    origin = event.decided_at
    timeline = Timeline(event=event, words=describe_preemption(event))
    steps = timeline.steps
    steps.append(
        TimelineStep(
            origin,
            "Preemption decided",
            f"{timeline.words}. Grace window {event.grace_seconds:g} s, "
            f"deadline {event.deadline:%H:%M:%S}.",
            "warn",
        )
    )
    ranks = list(attempt.rank_set.all())
    if event.signal_sent_at:
        steps.append(TimelineStep(event.signal_sent_at, f"Signal sent to all {len(ranks)} ranks"))
    mine = [e for e in events if e.attempt == attempt.number]
    received_by_rank = {e.rank: e.at for e in mine if e.event == "signal_received"}
    received = [r.signal_received_at for r in ranks if r.signal_received_at is not None] or [
        _moment(at) for at in received_by_rank.values()
    ]
    if received:
        first, last = min(received), max(received)
        spread = (last - first).total_seconds()
        steps.append(
            TimelineStep(
                last,
                f"Every rank received the signal ({len(received)} of {len(ranks)})"
                if len(received) == len(ranks)
                else f"{len(received)} of {len(ranks)} ranks received the signal",
                f"first after {(first - origin).total_seconds():.2f} s, spread {spread:.2f} s",
                "good" if len(received) == len(ranks) else "warn",
            )
        )
    started = [e for e in mine if e.event == "checkpoint_started"]
    if started:
        steps.append(
            TimelineStep(
                _moment(min(e.at for e in started)),
                "Checkpoint started",
                f"step {started[0].step}" if started[0].step is not None else "",
            )
        )
    committed = [e for e in mine if e.event == "checkpoint_committed"]
    skipped = [e for e in mine if e.event == "checkpoint_skipped"]
    if committed:
        payload = committed[0].payload or {}
        size = payload.get("bytes")
        detail = f"step {committed[0].step}"
        if size:
            detail += f", {int(size) / 1e6:.1f} MB"
        if payload.get("seconds") is not None:
            detail += f" in {float(payload['seconds']):.2f} s"
        steps.append(
            TimelineStep(
                _moment(max(e.at for e in committed)), "Checkpoint committed", detail, "good"
            )
        )
    elif event.checkpoint_step is not None:
        detail = f"step {event.checkpoint_step}"
        if event.checkpoint_seconds is not None:
            detail += f" in {event.checkpoint_seconds:.2f} s"
        steps.append(TimelineStep(None, "Checkpoint committed", detail, "good"))
    if skipped:
        reason = (skipped[0].payload or {}).get("reason", "not enough time left in the grace")
        steps.append(
            TimelineStep(_moment(skipped[0].at), "Checkpoint skipped", str(reason), "warn")
        )
    exits = [r.exited_at for r in ranks if r.exited_at is not None]
    if event.killed_at:
        steps.append(
            TimelineStep(event.killed_at, "Deadline passed: remaining ranks killed", "", "bad")
        )
    if exits or event.all_exited_at:
        codes = sorted({r.exit_code for r in ranks if r.exit_code is not None})
        clean = codes == [0]
        steps.append(
            TimelineStep(
                event.all_exited_at or max(exits),
                "Every rank exited",
                f"exit codes {', '.join(str(c) for c in codes) or 'unknown'}"
                + (f"; outcome {event.get_outcome_display().lower()}" if event.outcome else ""),
                "good" if clean and event.outcome != "killed" else "bad",
            )
        )
    if event.requeued_at:
        steps.append(
            TimelineStep(
                event.requeued_at,
                "Requeued",
                f"resumes from step {event.job.resume_step}"
                if event.job.resume_step is not None
                else "no checkpoint: starts over",
                "info",
            )
        )
    if event.resumed_at or next_attempt is not None:
        resumed = [
            e
            for e in events
            if next_attempt is not None
            and e.attempt == next_attempt.number
            and e.event == "resumed"
        ]
        detail = f"attempt {next_attempt.number}" if next_attempt is not None else ""
        if resumed and resumed[0].step is not None:
            detail += f", from step {resumed[0].step}"
        at = event.resumed_at or (next_attempt.admitted_at if next_attempt is not None else None)
        steps.append(TimelineStep(at, "Resumed", detail, "good"))
    for step in steps:
        step.offset = _seconds_after(step.at, origin)
    steps.sort(key=lambda step: (step.offset is None, step.offset or 0.0))
    for rank in ranks:
        timeline.ranks.append(
            RankStory(
                index=rank.index,
                node=rank.node,
                signal_sent=_seconds_after(rank.signal_sent_at, origin),
                signal_received=_seconds_after(rank.signal_received_at, origin)
                if rank.signal_received_at is not None
                else (
                    None
                    if rank.index not in received_by_rank
                    else _seconds_after(_moment(received_by_rank[rank.index]), origin)
                ),
                exited=_seconds_after(rank.exited_at, origin),
                exit_code=rank.exit_code,
            )
        )
    return timeline


@login_required
def job_list(request: HttpRequest) -> HttpResponse:
    """Every job the user may read, newest first, filtered by team, user, state and time."""
    access = access_for(request.user)
    form = JobFilterForm(request.GET or None, access=access)
    jobs = job_selector(user=request.user).select_related("priority_class")
    if form.is_valid():
        jobs = form.apply(jobs)
    paginator = Paginator(jobs.order_by("-submitted_at", "-id"), JOBS_PER_PAGE)
    page = paginator.get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    return render(
        request,
        "preemption/job_list.html",
        {
            "form": form,
            "page": page,
            "query": query.urlencode(),
            "nav": "jobs",
        },
    )


@login_required
def job_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One job: attempts, ranks, per-rank logs, checkpoints and each preemption's timeline."""
    job = get_object_or_404(job_selector(user=request.user), pk=pk)
    attempts = list(
        job.attempts.select_related(
            "preemption",
            "preemption__preemptor",
            "preemption__preemptor__team",
            "preemption__preemptor__priority_class",
        )
        .prefetch_related("rank_set")
        .order_by("number")
    )
    events = list(TrapEvent.objects.filter(job=job).order_by("at", "id")[:5000])
    timelines: list[Timeline] = []
    for index, attempt in enumerate(attempts):
        event: PreemptionEvent | None = getattr(attempt, "preemption", None)
        if event is None:
            continue
        # The event's job is this job; reuse the loaded object, saving a query.
        event.job = job
        following = attempts[index + 1] if index + 1 < len(attempts) else None
        timelines.append(build_timeline(event, attempt, following, events))
    checkpoints = list(job.checkpoints.select_related("attempt").order_by("-committed_at")[:100])
    access = access_for(request.user)
    return render(
        request,
        "preemption/job_detail.html",
        {
            "job": job,
            "attempts": list(reversed(attempts)),
            "timelines": list(reversed(timelines)),
            "checkpoints": checkpoints,
            "can_cancel": access.can_cancel(team_id=job.team_id, submitter_id=job.submitter_id),
            "nav": "jobs",
        },
    )


@login_required
def rank_log(request: HttpRequest, pk: int, attempt: int, rank: int) -> HttpResponse:
    """A chunk of one rank's log; `?raw=1` answers plain text for scripts."""
    job: Job = get_object_or_404(job_selector(user=request.user), pk=pk)
    try:
        offset = max(int(request.GET.get("offset", "0")), 0)
    except ValueError:
        offset = 0
    unavailable = ""
    try:
        chunk, next_offset = read_rank_log(
            job=job, attempt=attempt, rank=rank, offset=offset, limit=LOG_CHUNK
        )
    except ValidationError as error:
        raise Http404("; ".join(error.messages)) from None
    except (OSError, RuntimePermanentError, RuntimeTemporaryError) as problem:
        # A runtime that cannot read the log now is shown as such, not as a crash.
        chunk, next_offset, unavailable = b"", offset, str(problem)
    text = chunk.decode("utf-8", errors="replace")
    if request.GET.get("raw"):
        response = HttpResponse(text, content_type="text/plain; charset=utf-8")
        response["X-Next-Offset"] = str(next_offset)
        return response
    context: dict[str, Any] = {
        "job": job,
        "attempt": attempt,
        "rank": rank,
        "text": text,
        "offset": offset,
        "next_offset": next_offset,
        "has_more": len(chunk) >= LOG_CHUNK,
        "ranks": range(job.ranks),
        "unavailable": unavailable,
        "nav": "jobs",
    }
    return render(request, "preemption/rank_log.html", context)


@require_POST
@login_required
def job_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    """Cancel a job: a waiting one at once, a running one gracefully (signal,
    grace window, then kill). Allowed to its submitter, a manager of its team
    and admins, as in the API."""
    job = get_object_or_404(job_selector(user=request.user), pk=pk)
    if not access_for(request.user).can_cancel(team_id=job.team_id, submitter_id=job.submitter_id):
        raise PermissionDenied(
            "Only the submitter, a manager of the team or an admin cancels a job."
        )
    try:
        job = cancel_job(actor=request.user, job=job)
    except ValidationError as error:
        messages.error(request, " ".join(error.messages))
    else:
        if job.state == "cancelled":
            messages.success(request, f"Cancelled job {job.pk}.")
        else:
            messages.success(
                request,
                f"Stopping job {job.pk} gracefully: its ranks get the signal and "
                f"{job.priority_class.grace_seconds} s to checkpoint and exit.",
            )
    return redirect("job-detail", pk=pk)
