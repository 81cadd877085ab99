"""Portal-wide pages: the cluster dashboard, priority classes, API tokens, the
gracetrap download, health, and plotly.js from the installed package."""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import plotly
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.db import connection
from django.db.models import Count, Q
from django.http import FileResponse, Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST

from core.forms import add_service_errors
from portal.forms import ApiTokenForm
from portal.models import ApiToken, TokenScope
from portal.services import api_token_create, api_token_revoke
from preemption.models import ACTIVE_STATES, WAITING_STATES
from preemption.reasons import describe_preemption
from preemption.runtime import runtime_problems
from preemption.selectors import job_list, preemption_event_list, with_stop_reason
from quotas.selectors import access_for, priority_class_list, priority_class_teams
from telemetry.history_selectors import overview_teams
from telemetry.selectors import (
    UsageNow,
    flavors_now,
    own_jobs,
    pending_jobs,
    team_rows,
    topology_free_blocks,
)

RECENT_PREEMPTIONS = 10
PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
GRACETRAP_DIR = Path(settings.BASE_DIR) / "gracetrap"


@login_required
def dashboard(request: HttpRequest) -> HttpResponse:
    """The cluster now: flavors, teams against their guarantees, the user's own
    jobs, the queue and the latest preemptions, all scoped to what the user may read."""
    access = access_for(request.user)
    shown = overview_teams(access=access)
    usage = UsageNow.load(access.tree)
    rows = [row for row in team_rows(access=access, only_team_ids=shown, usage=usage) if row.active]
    flavors = flavors_now(usage)
    # One scale per flavor, so every team's bar of that flavor is comparable.
    scale = {
        flavor.name: max(
            [flavor.capacity]
            + [
                max(row.flavors[flavor.name].guarantee, row.flavors[flavor.name].used)
                for row in rows
            ]
        )
        for flavor in flavors
    }
    team_bars = []
    for row in rows:
        bars = []
        for flavor in flavors:
            usage = row.flavors[flavor.name]
            if usage.guarantee or usage.used:
                bars.append({"usage": usage, "width": usage.bar(scale[flavor.name])})
        team_bars.append({"row": row, "bars": bars})
    jobs = job_list(user=request.user)
    pending, pending_count = pending_jobs(jobs=jobs, first_submitter_id=request.user.pk)
    mine, mine_count = own_jobs(jobs=with_stop_reason(jobs), submitter_id=request.user.pk)
    preemptions = list(
        preemption_event_list(user=request.user)
        .select_related("preemptor__priority_class")
        .order_by("-decided_at", "-id")[:RECENT_PREEMPTIONS]
    )
    for event in preemptions:
        event.words = describe_preemption(event)  # type: ignore[attr-defined]
    return render(
        request,
        "portal/dashboard.html",
        {
            "flavors": flavors,
            "team_bars": team_bars,
            "pending": pending,
            "pending_count": pending_count,
            "mine": mine,
            "mine_count": mine_count,
            "preemptions": preemptions,
            "free_blocks": topology_free_blocks(),
            "nav": "dashboard",
        },
    )


@login_required
def priority_classes(request: HttpRequest) -> HttpResponse:
    """Every priority class with what it means, which of the user's teams may use
    it and how many readable jobs use it."""
    classes = list(priority_class_list(user=request.user))
    teams = priority_class_teams(access=access_for(request.user))
    counts = {
        row["priority_class_id"]: row
        for row in job_list(user=request.user)
        .order_by()
        .values("priority_class_id")
        .annotate(
            active=Count("id", filter=Q(state__in=ACTIVE_STATES)),
            waiting=Count("id", filter=Q(state__in=WAITING_STATES)),
        )
    }
    for priority_class in classes:
        row = counts.get(priority_class.pk, {})
        priority_class.active_jobs = row.get("active", 0)  # type: ignore[attr-defined]
        priority_class.waiting_jobs = row.get("waiting", 0)  # type: ignore[attr-defined]
        priority_class.teams = teams.get(priority_class.pk, [])  # type: ignore[attr-defined]
    return render(
        request,
        "portal/priority_classes.html",
        {
            "classes": classes,
            "nav": "priority-classes",
        },
    )


@login_required
def tokens(request: HttpRequest) -> HttpResponse:
    """The user's own API tokens; a new token's value is shown once, here."""
    created: tuple[ApiToken, str] | None = None
    form = ApiTokenForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            created = api_token_create(
                user=request.user,
                name=form.cleaned_data["name"],
                days=form.cleaned_data["days"],
                scope=TokenScope.READ if form.cleaned_data["read_only"] else TokenScope.FULL,
            )
        except ValidationError as error:
            add_service_errors(form, error)
        else:
            form = ApiTokenForm()
    mine = list(ApiToken.objects.filter(user_id=request.user.pk).order_by("-created_at", "-id"))
    response = render(
        request,
        "portal/tokens.html",
        {
            "form": form,
            "tokens": mine,
            "created": created,
            "nav": "tokens",
            "public_url": settings.QM_PUBLIC_URL,
            "now": timezone.now(),
            "max_days": settings.QM_TOKEN_MAX_DAYS,
        },
        status=400 if form.errors else 200,
    )
    # A page that shows a secret once must not be kept by any cache.
    response["Cache-Control"] = "no-store"
    return response


@require_POST
@login_required
def token_revoke(request: HttpRequest, pk: int) -> HttpResponse:
    token = get_object_or_404(ApiToken, pk=pk, user_id=request.user.pk)
    api_token_revoke(user=request.user, token=token)
    messages.success(request, f"Revoked the token {token.name!r}.")
    return redirect("tokens")


# --- gracetrap, built from the source tree on demand ---------------------------------


def gracetrap_version() -> str:
    with (GRACETRAP_DIR / "pyproject.toml").open("rb") as handle:
        return str(tomllib.load(handle)["project"]["version"])


def _gracetrap_fingerprint() -> str:
    """A hash of the package's sources, so an edit without a version bump still
    yields a fresh wheel instead of a stale cached one."""
    digest = hashlib.sha256()
    for path in sorted(GRACETRAP_DIR.rglob("*")):
        relative = path.relative_to(GRACETRAP_DIR)
        if (
            not path.is_file()
            or relative.parts[0] in {"build", "dist"}
            or "__pycache__" in relative.parts
            or any(part.endswith(".egg-info") for part in relative.parts)
            or relative.parts[0] == "tests"
        ):
            continue
        digest.update(str(relative).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def gracetrap_wheel() -> Path:
    """The wheel of gracetrap, built once per version and source into var/wheels/.

    It is built from a copy of the sources so the build leaves nothing in the
    package's folder, without build isolation so no index is needed, and under
    a file lock so two requests never build at once.
    """
    version = gracetrap_version()
    folder = Path(settings.VAR_DIR) / "wheels" / f"{version}-{_gracetrap_fingerprint()}"
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = sorted(folder.glob("gracetrap-*.whl"))
        if built:
            return built[0]
        with tempfile.TemporaryDirectory(dir=folder.parent) as scratch:
            source = Path(scratch) / "gracetrap"
            shutil.copytree(
                GRACETRAP_DIR,
                source,
                ignore=shutil.ignore_patterns(
                    "build", "dist", "*.egg-info", "__pycache__", "tests"
                ),
            )
            output = Path(scratch) / "out"
            result = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "wheel",
                    "--no-deps",
                    "--no-build-isolation",
                    "--no-index",
                    "--quiet",
                    str(source),
                    "-w",
                    str(output),
                ],
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            wheels = sorted(output.glob("gracetrap-*.whl"))
            if result.returncode != 0 or not wheels:
                raise RuntimeError(
                    f"building the gracetrap wheel failed: {result.stderr.strip()[-2000:]}"
                )
            target = folder / wheels[0].name
            shutil.move(str(wheels[0]), target)
            return target


@login_required
def gracetrap(request: HttpRequest) -> HttpResponse:
    """Where researchers get the trap: the wheel, how to install it, how to use it."""
    error = None
    wheel_name = None
    try:
        wheel_name = gracetrap_wheel().name
    except (OSError, RuntimeError, KeyError, subprocess.TimeoutExpired) as problem:
        error = str(problem)
    # The address this page was reached at is the one the reader's pip can reach.
    wheel_url = (
        request.build_absolute_uri(reverse("gracetrap-wheel", args=[wheel_name]))
        if wheel_name
        else ""
    )
    return render(
        request,
        "portal/gracetrap.html",
        {
            "version": gracetrap_version(),
            "wheel_name": wheel_name,
            "wheel_url": wheel_url,
            "error": error,
            "nav": "gracetrap",
        },
    )


@require_GET
def gracetrap_download(request: HttpRequest, filename: str) -> FileResponse:
    """The wheel itself. It holds no secret, and pip inside a container has no
    session, so it is served without sign-in."""
    try:
        wheel = gracetrap_wheel()
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as problem:
        raise Http404(str(problem)) from None
    if filename != wheel.name:
        raise Http404(f"No such file; the current wheel is {wheel.name}.")
    response = FileResponse(
        wheel.open("rb"), as_attachment=True, filename=wheel.name, content_type="application/zip"
    )
    return response


# --- health and assets --------------------------------------------------------------


@never_cache
@require_GET
def healthz(request: HttpRequest) -> HttpResponse:
    """200 "ok" once the database answers and, in production, the runtime is
    safe to run jobs on (a checkpoint volume on Kubernetes); 503 with the reason
    otherwise, so a deployment without one never becomes ready."""
    problems = runtime_problems()
    if problems and settings.PRODUCTION:
        return HttpResponse("\n".join(problems) + "\n", status=503, content_type="text/plain")
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as problem:  # any database failure means unhealthy
        return HttpResponse(
            f"database unavailable: {type(problem).__name__}\n",
            status=503,
            content_type="text/plain",
        )
    return HttpResponse("ok\n", content_type="text/plain")


def _plotly_gzip() -> Path:
    """plotly.min.js compressed once into var/, since it is nearly 5 MB as is."""
    target = Path(settings.VAR_DIR) / "assets" / f"plotly-{plotly.__version__}.min.js.gz"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as scratch:
            scratch.write(gzip.compress(PLOTLY_JS.read_bytes(), compresslevel=9, mtime=0))
        Path(scratch.name).replace(target)
    return target


@require_GET
def plotly_js(request: HttpRequest) -> FileResponse:
    """The plotly.js bundle shipped inside the installed plotly package, never a CDN.
    The page links it with the package version in the query, so it is cached for good."""
    gzipped = "gzip" in request.headers.get("Accept-Encoding", "")
    path = _plotly_gzip() if gzipped else PLOTLY_JS
    response = FileResponse(path.open("rb"), content_type="text/javascript; charset=utf-8")
    if gzipped:
        response["Content-Encoding"] = "gzip"
    response["Vary"] = "Accept-Encoding"
    response["Cache-Control"] = "public, max-age=31536000, immutable"
    return response
