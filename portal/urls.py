"""Top-level routes: the pages, the REST API under /api/v1/, its schema and docs,
the admin, health and metrics."""

from typing import Any

from django.conf import settings
from django.contrib import admin
from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.exceptions import NotAuthenticated
from rest_framework.permissions import BasePermission
from rest_framework.request import Request


class SignedInForSchema(BasePermission):
    """The schema lists every endpoint and field: with QM_API_SCHEMA_REQUIRES_SIGN_IN
    (the default) only a signed-in user (a session or an API token) reads it."""

    message = "Sign in (or send an API token) to read the API's schema."

    def has_permission(self, request: Request, view: Any) -> bool:
        if not settings.QM_API_SCHEMA_REQUIRES_SIGN_IN:
            return True
        if not (request.user and request.user.is_authenticated):
            # DRF would answer with its generic "credentials were not provided".
            raise NotAuthenticated(self.message)
        return True


_swagger = SpectacularSwaggerView.as_view(url_name="schema", permission_classes=[SignedInForSchema])


def api_docs(request: HttpRequest) -> HttpResponse:
    """The interactive docs, a page for a browser: a visitor who is not signed
    in is sent to the sign-in page, and back here afterwards."""
    if settings.QM_API_SCHEMA_REQUIRES_SIGN_IN and not request.user.is_authenticated:
        return redirect_to_login(request.get_full_path())
    response: HttpResponse = _swagger(request)
    return response


urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include("portal.api_urls")),
    path(
        "api/schema/",
        SpectacularAPIView.as_view(permission_classes=[SignedInForSchema]),
        name="schema",
    ),
    path("api/docs/", api_docs, name="api-docs"),
    path("", include("portal.page_urls")),
]

handler403 = "portal.errors.permission_denied"
handler404 = "portal.errors.page_not_found"
handler500 = "portal.errors.server_error"
