"""Browser pages for jobs: the history with filters, one job's attempts, ranks,
checkpoints and preemption timelines, and per-rank logs.

Views stay thin: reads go through `preemption.selectors`, which scope every
query to the asking user exactly as the API does.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import EmptyPage, PageNotAnInteger, Paginator
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.template.defaultfilters import pluralize
from django.utils import timezone
from django.views.decorators.http import require_POST

from portal.web.preemption.forms import JobFilterForm
from preemption.exports import job_csv_response
from preemption.job_rules import ranks_words
from preemption.log_tail import failed_rank_log
from preemption.logs import read_rank_log
from preemption.models import Job, PreemptionEvent, TrapEvent
from preemption.reasons import describe_preemption
from preemption.runtimes.base import RuntimePermanentError, RuntimeTemporaryError
from preemption.selectors import (
    job_cadence,
    job_sort_headers,
    job_sort_key,
    job_table,
    stop_in_progress,
)
from preemption.selectors import job_list as job_selector
from preemption.services import job_cancel as cancel_job
from quotas.selectors import access_for
from telemetry.timeline import Timeline, build_timeline

JOBS_PER_PAGE = 50
LOG_CHUNK = 65536


@login_required
def job_list(request: HttpRequest) -> HttpResponse:
    """Every job the user may read, filtered by team, user, state, time and a
    search of name and command, sorted by a whitelisted column; `?mine=1` keeps
    the user's own jobs ("My jobs" in the navigation); `?format=csv` answers the
    whole filtered list as CSV."""
    access = access_for(request.user)
    form = JobFilterForm(request.GET or None, access=access)
    jobs = job_selector(user=request.user).select_related("priority_class")
    search = ""
    mine = False
    if form.is_valid():
        jobs = form.apply(jobs)
        search = form.cleaned_data.get("q") or ""
        mine = bool(form.cleaned_data.get("mine"))
    sort = job_sort_key(request.GET.get("sort"))
    jobs = job_table(jobs, sort=sort, search=search)
    if request.GET.get("format") == "csv":
        return job_csv_response(jobs)
    paginator = Paginator(jobs, JOBS_PER_PAGE)
    try:
        page = paginator.page(request.GET.get("page") or 1)
    except PageNotAnInteger:
        raise Http404("The page number must be a whole number, such as ?page=2.") from None
    except EmptyPage:
        # A page past the end is an error, not silently the first page.
        raise Http404(
            f"There is no page {request.GET.get('page')}: this list has "
            f"{paginator.num_pages} page{pluralize(paginator.num_pages)}."
        ) from None
    query = request.GET.copy()
    query.pop("page", None)
    unsorted = query.copy()
    unsorted.pop("sort", None)
    return render(
        request,
        "preemption/job_list.html",
        {
            "form": form,
            "page": page,
            "query": query.urlencode(),
            "unsorted": unsorted.urlencode(),
            "sort": sort,
            "heads": job_sort_headers(sort),
            "mine": mine,
            "nav": "my-jobs" if mine else "jobs",
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
    cancels: list[Timeline] = []
    resizes: list[Timeline] = []
    for index, attempt in enumerate(attempts):
        event: PreemptionEvent | None = getattr(attempt, "preemption", None)
        if event is None:
            continue
        # The event's job is this job; reuse the loaded object, saving a query.
        event.job = job
        following = attempts[index + 1] if index + 1 < len(attempts) else None
        # A cancel is told as its own story and never counted as a preemption, nor is
        # a resize, which gives the job back at once at another size.
        told = (
            cancels
            if event.is_cancel
            else resizes
            if event.reason == PreemptionEvent.Reason.RESIZE
            else timelines
        )
        told.append(
            build_timeline(
                event=event,
                attempt=attempt,
                next_attempt=following,
                events=events,
                words=describe_preemption(event),
            )
        )
    checkpoints = list(job.checkpoints.select_related("attempt").order_by("-committed_at")[:100])
    access = access_for(request.user)
    stopping = stop_in_progress(attempts)
    cadence = job_cadence(attempts=attempts)
    # The rank whose failure ended the job, as `qm show` prints it: its last lines.
    failed_log = failed_rank_log(job, attempts[-1]) if job.state == "failed" and attempts else None
    # The size it runs (or last ran) at: an elastic job's attempts may be smaller than it asks.
    size = attempts[-1].world_size if attempts else job.ranks
    return render(
        request,
        "preemption/job_detail.html",
        {
            "job": job,
            "size_words": ranks_words(size, job.ranks, job.ranks_min, job.rank_sizes),
            "size_gpus": size * job.gpus_per_rank,
            "stopping": stopping,
            "stop_reason": stopping.reason if stopping else "",
            "stopping_left": max(0, round((stopping.deadline - timezone.now()).total_seconds()))
            if stopping
            else None,
            "attempts": list(reversed(attempts)),
            "timelines": list(reversed(timelines)),
            "cancels": cancels,
            "resizes": list(reversed(resizes)),
            "checkpoints": checkpoints,
            "cadence": cadence,
            "failed_log": failed_log,
            "can_cancel": access.can_cancel(team_id=job.team_id, submitter_id=job.submitter_id),
            "nav": "jobs",
        },
    )


def _attempt_size(job: Job, number: int) -> int:
    """How many ranks attempt `number` of `job` ran (its rank logs), or the job's size
    when it has no such attempt."""
    size = job.attempts.filter(number=number).values_list("ranks", flat=True).first()
    return size or job.ranks


@login_required
def rank_log(request: HttpRequest, pk: int, attempt: int, rank: int) -> HttpResponse:
    """A chunk of one rank's log; `?raw=1` answers plain text for scripts."""
    job: Job = get_object_or_404(job_selector(user=request.user), pk=pk)
    try:
        offset = max(int(request.GET.get("offset", "0")), 0)
    except ValueError:
        offset = 0
    # Asked before reading, so a follower that sees the attempt closed has
    # already been given everything the attempt wrote.
    attempt_open = job.attempts.filter(number=attempt, ended_at__isnull=True).exists()
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
        response["X-Attempt-Open"] = "1" if attempt_open else "0"
        return response
    context: dict[str, Any] = {
        "job": job,
        "attempt": attempt,
        "rank": rank,
        "text": text,
        "offset": offset,
        "next_offset": next_offset,
        "has_more": len(chunk) >= LOG_CHUNK,
        "ranks": range(_attempt_size(job, attempt)),
        "unavailable": unavailable,
        "attempt_open": attempt_open,
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
