"""The browser pages, health, metrics and the assets served from packages."""

from django.contrib.auth import views as auth_views
from django.urls import path

from portal import views as portal_views
from portal.web.preemption import submit as job_submit_views
from portal.web.preemption import views as job_views
from portal.web.quotas import views as quota_views
from portal.web.telemetry import views as telemetry_views

urlpatterns = [
    path("", portal_views.dashboard, name="dashboard"),
    path(
        "login/",
        auth_views.LoginView.as_view(
            template_name="registration/login.html", redirect_authenticated_user=True
        ),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("healthz", portal_views.healthz, name="healthz"),
    path("metrics", telemetry_views.metrics, name="metrics"),
    path("assets/plotly.min.js", portal_views.plotly_js, name="plotly-js"),
    path("teams/", quota_views.team_list, name="team-list"),
    path("teams/<slug:slug>/", quota_views.team_detail, name="team-detail"),
    path("quotas/<int:pk>/edit/", quota_views.quota_edit, name="quota-edit"),
    path("quotas/<int:pk>/preview/", quota_views.quota_preview, name="quota-preview"),
    path("nodes/", quota_views.node_list, name="node-list"),
    path("jobs/", job_views.job_list, name="job-list"),
    path("jobs/new/", job_submit_views.job_submit_page, name="job-submit"),
    path("jobs/<int:pk>/", job_views.job_detail, name="job-detail"),
    path("jobs/<int:pk>/cancel/", job_views.job_cancel, name="job-cancel"),
    path(
        "jobs/<int:pk>/attempts/<int:attempt>/ranks/<int:rank>/log/",
        job_views.rank_log,
        name="rank-log",
    ),
    path("telemetry/", telemetry_views.telemetry, name="telemetry"),
    path("telemetry/simulations/", telemetry_views.simulations, name="simulations"),
    path("telemetry/gpu-hours.csv", telemetry_views.gpu_hours_csv, name="gpu-hours-csv"),
    path("priority-classes/", portal_views.priority_classes, name="priority-classes"),
    path("tokens/", portal_views.tokens, name="tokens"),
    path("tokens/<int:pk>/revoke/", portal_views.token_revoke, name="token-revoke"),
    path("gracetrap/", portal_views.gracetrap, name="gracetrap"),
    path("gracetrap/<str:filename>", portal_views.gracetrap_download, name="gracetrap-wheel"),
]
