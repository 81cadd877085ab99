"""The telemetry page, its GPU-hours CSV, and /metrics for Prometheus.

Views hand selector output to the pure chart builders of `telemetry.charts`
and pass the figures' JSON to the template; nothing is computed here.
"""

from __future__ import annotations

import csv
from typing import Any

import plotly
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_GET
from rest_framework.exceptions import AuthenticationFailed

from portal.auth import BearerTokenAuthentication
from portal.web.telemetry.forms import PeriodForm
from quotas.selectors import access_for
from telemetry import charts
from telemetry.history_selectors import (
    chart_teams,
    first_sample_at,
    gpu_hours,
    period_bounds,
    readable_team_slugs,
    utilization_points,
)
from telemetry.metrics import render_metrics
from telemetry.preemption_selectors import (
    checkpoints_against_grace,
    exit_codes,
    recovery_seconds,
    resize_stops,
    signal_latencies,
    stops_by_team,
)
from telemetry.report_selectors import latest_drills, mission_matrix, simulation_reports
from telemetry.selectors import flavor_names, flavors_now


@login_required
def telemetry(request: HttpRequest) -> HttpResponse:
    """Utilization, borrowing, preemption latency, checkpoints, exit codes,
    recovery, resizes beside preemptions, the mission's matrix from the latest
    drills, and GPU-hours."""
    access = access_for(request.user)
    # The largest flavor comes first and is the one charted unless another is chosen.
    flavors = [f.name for f in sorted(flavors_now(), key=lambda f: (-f.capacity, f.name))]
    teams = readable_team_slugs(access=access)
    form = PeriodForm(request.GET or None, flavors=flavors, teams=list(teams))
    period, flavor = form.chosen(flavors)
    team_ids = chart_teams(access=access, team_id=teams.get(form.chosen_team()))
    since, until = period_bounds(
        timezone.now(), period, first_sample=first_sample_at(access=access, team_ids=team_ids)
    )
    points = utilization_points(access=access, since=since, until=until, team_ids=team_ids)
    span = {"since": since, "until": until}
    resizes = resize_stops(access=access)
    figures = {
        "utilization": charts.utilization_figure(points, flavor=flavor, **span),
        "borrowed": charts.borrowed_share_figure(points, flavor=flavor, **span),
        "latency": charts.signal_latency_figure(signal_latencies(access=access)),
        "checkpoint": charts.checkpoint_grace_figure(checkpoints_against_grace(access=access)),
        "exit-codes": charts.exit_code_figure(exit_codes(access=access)),
        "recovery": charts.recovery_figure(recovery_seconds(access=access)),
        "stops": charts.stops_by_team_figure(stops_by_team(access=access)),
        "resize-lost-work": charts.resize_lost_work_figure(resizes),
        "resize-free-time": charts.resize_free_time_figure(resizes),
    }
    drills = latest_drills()
    context: dict[str, Any] = {
        "form": form,
        "period": period,
        "flavor": flavor,
        "since": since,
        "until": until,
        "figures": [(name, figure.to_json()) for name, figure in figures.items()],
        "drills": drills,
        "matrix": mission_matrix(drills),
        "gpu_hours": gpu_hours(access=access, since=since, until=until),
        "plotly_version": plotly.__version__,
        "nav": "telemetry",
    }
    return render(request, "telemetry/telemetry.html", context)


@login_required
def gpu_hours_csv(request: HttpRequest) -> HttpResponse:
    """GPU-hours per team and flavor for the chosen period, as CSV."""
    access = access_for(request.user)
    flavors = flavor_names()
    period, _ = PeriodForm(request.GET or None, flavors=flavors).chosen(flavors)
    first = first_sample_at(access=access, team_ids=chart_teams(access=access))
    since, until = period_bounds(timezone.now(), period, first_sample=first)
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = (
        f'attachment; filename="gpu-hours-{since:%Y%m%dT%H%M}-{until:%Y%m%dT%H%M}.csv"'
    )
    writer = csv.writer(response)
    writer.writerow(["team", "flavor", "gpu_hours", "borrowed_gpu_hours", "since", "until"])
    for row in gpu_hours(access=access, since=since, until=until):
        writer.writerow(
            [
                row.team,
                row.flavor,
                f"{row.gpu_hours:.3f}",
                f"{row.borrowed_gpu_hours:.3f}",
                since.isoformat(),
                until.isoformat(),
            ]
        )
    return response


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus text format. A scraper authenticates with an API token
    (`Authorization: Bearer qm_...`; a read-only one is enough, and an expired
    one is refused); a signed-in browser session works too. What it sees is
    scoped like the API: an admin's token sees every team, anyone else's only
    the teams they may read (tests/security/test_security_auth.py)."""
    user = request.user
    try:
        authenticated = BearerTokenAuthentication().authenticate(request)
    except AuthenticationFailed as problem:
        return _unauthorized(str(problem.detail))
    if authenticated is not None:
        user = authenticated[0]
    if not user.is_authenticated:
        return _unauthorized("Authentication required: send an API token as a Bearer token.")
    body = render_metrics(access=access_for(user))
    return HttpResponse(body, content_type="text/plain; version=0.0.4; charset=utf-8")


def _unauthorized(message: str) -> HttpResponse:
    response = HttpResponse(message + "\n", status=401, content_type="text/plain")
    response["WWW-Authenticate"] = "Bearer"
    return response


@login_required
def simulations(request: HttpRequest) -> HttpResponse:
    """Stored trace replays (`manage.py simulate`): what fair-share lending buys
    against other policies. They are offline what-if runs, not live cluster
    data, so every signed-in user may read them."""
    reports = simulation_reports()
    wanted = request.GET.get("run", "")
    chosen = next((r for r in reports if str(r.run_id) == wanted), None)
    chosen = chosen or (reports[0] if reports else None)
    figures = [("comparison", charts.simulation_comparison_figure(reports).to_json())]
    if chosen is not None:
        figures.append(("teams", charts.simulation_teams_figure(chosen).to_json()))
    return render(
        request,
        "telemetry/simulations.html",
        {
            "reports": reports,
            "chosen": chosen,
            "figures": figures,
            "plotly_version": plotly.__version__,
            "nav": "telemetry",
        },
    )
