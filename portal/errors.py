"""The portal's error pages and the one log line a refused request leaves.

A 403 or 404 says why, in the portal's own layout (navigation included where
the user is signed in): the reason is the message of the PermissionDenied or
Http404 that a view raised, which services word for people. A URL that matches
no route says only that there is no page there; Django's own message for it
would list the URL patterns. Paths under /api/ get the API's JSON body instead
of a page.

A refusal is a normal outcome, not a fault: Django logs it with the exception's
traceback, which `OneLineRefusals` folds into one line with the reason.

Where Django's debug page is on (QM_DEBUG=1, never in production) or an error
report is mailed, `SettingsReporterFilter` also hides the database and broker
URLs, whose passwords Django's own filter does not recognise by name.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.urls import Resolver404
from django.views.debug import SafeExceptionReporterFilter
from django.views.decorators.csrf import requires_csrf_token

log = logging.getLogger(__name__)

GENERIC_403 = "You are not allowed to see or do this."


def _message(exception: Exception | None) -> str:
    """The exception's own message when a view gave one, else empty."""
    if exception is None or isinstance(exception, Resolver404):
        return ""
    message = exception.args[0] if exception.args else ""
    return message if isinstance(message, str) else ""


def _respond(
    request: HttpRequest, status: int, title: str, reason: str, template: str
) -> HttpResponse:
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": reason}, status=status)
    return render(request, template, {"title": title, "reason": reason}, status=status)


def permission_denied(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    reason = _message(exception) or GENERIC_403
    return _respond(request, 403, "Not allowed", reason, "403.html")


def page_not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    reason = _message(exception) or f"There is no page at {request.path}."
    return _respond(request, 404, "Not found", reason, "404.html")


@requires_csrf_token
def server_error(request: HttpRequest) -> HttpResponse:
    """The 500 page. Rendering it with the navigation needs the database, which
    may be what failed; then a bare page is still better than none."""
    reason = "Something went wrong on the server. It has been logged; please try again."
    try:
        return _respond(request, 500, "Server error", reason, "500.html")
    except Exception:
        log.exception("The 500 page could not be rendered with the portal layout")
        return HttpResponse(
            f"<!doctype html><title>Server error · Quartermaster</title><h1>Server error</h1><p>{reason}</p>",
            status=500,
        )


class OneLineRefusals(logging.Filter):
    """Folds the traceback of a refused request (any 4xx) into one line with the
    exception's message; a 5xx keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        status: Any = getattr(record, "status_code", None)
        if isinstance(status, int) and status < 500 and record.exc_info:
            exception = record.exc_info[1]
            line = record.getMessage()
            reason = _message(exception) if isinstance(exception, Exception) else ""
            record.msg = f"{line}: {reason}" if reason else line
            record.args = ()
            record.exc_info = None
            record.exc_text = None
        return True


class SettingsReporterFilter(SafeExceptionReporterFilter):
    """Django's filter of error reports, also hiding every *_URL setting and
    environment variable (DATABASE_URL, CELERY_BROKER_URL carry passwords)."""

    hidden_settings = re.compile(
        SafeExceptionReporterFilter.hidden_settings.pattern + "|URL", flags=re.IGNORECASE
    )
