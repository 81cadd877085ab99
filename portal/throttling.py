"""Login throttling: after too many wrong passwords, an account or an address is
locked out for a while, and then even the right password is refused.

The counting is django-axes: it listens to Django's own `authenticate()`, so the
portal's sign-in page, the Django admin's and the API's token login
(`POST /api/v1/tokens/login/`, what `qm login` calls) share one rule without
each view counting for itself, and it keeps the failures in the database, so
every web worker process sees the same count (a per-process cache would give
each gunicorn worker its own allowance). The limits come from settings:
`AXES_FAILURE_LIMIT` wrong passwords from one address lock that address out
(for every account) for `AXES_COOLOFF_TIME`, and a try during the lockout starts
the wait again. The account itself is never locked: wrong passwords sent from
elsewhere would otherwise lock its owner out from afar, and each address that
guesses gets only its few tries.

This module holds the pieces axes leaves to the project: the backend that lets
in-process callers without a request through, the client's address behind
`QM_PROXY_COUNT` reverse proxies, and the answer a locked-out request gets
(JSON with `Retry-After` for the API, the sign-in page with the reason for a
browser). It also holds the API's request rates (DRF throttles per user and per
anonymous address, QM_API_RATE_USER and QM_API_RATE_ANON), answered 429 with
`Retry-After` by DRF.
"""

from __future__ import annotations

from typing import Any

from axes.backends import AxesStandaloneBackend
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from rest_framework.request import Request
from rest_framework.throttling import AnonRateThrottle, UserRateThrottle


class LoginThrottleBackend(AxesStandaloneBackend):
    """axes' lockout check, for logins that come over HTTP.

    Every HTTP login path hands its request to `authenticate()`. A call without
    a request is in-process code (a management command, the shell, Django's test
    client): there is no address to count and nobody to throttle, so it is left
    to the next backend instead of failing with axes' "request required" error.
    """

    def authenticate(
        self,
        request: HttpRequest | None,
        username: str | None = None,
        password: str | None = None,
        **kwargs: Any,
    ) -> None:
        # axes raises PermissionDenied for a locked-out request and otherwise
        # lets the next backend check the password.
        if request is not None:
            super().authenticate(request, username=username, password=password, **kwargs)
        return None


def client_address(request: HttpRequest) -> str | None:
    """The address a login is counted against.

    Behind an ingress every request comes from the proxy's address, and one
    person's typos would lock everyone out. Each of the QM_PROXY_COUNT trusted
    proxies appends the address it saw to X-Forwarded-For, so the client is that
    many entries from the right; entries further left were sent by the client
    itself and prove nothing. With no proxies configured (the embedded default),
    the header is ignored.
    """
    hops = settings.QM_PROXY_COUNT
    if hops:
        forwarded = [
            entry.strip()
            for entry in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")
            if entry.strip()
        ]
        if len(forwarded) >= hops:
            return forwarded[-hops]
    address = request.META.get("REMOTE_ADDR")
    return str(address) if address else None


def lockout_seconds() -> int:
    """How long a lockout lasts; a try during it starts the wait again, so this is
    also exactly how long the client must wait after its last try."""
    return int(settings.AXES_COOLOFF_TIME.total_seconds())


def lockout_reason() -> str:
    minutes = max(1, round(lockout_seconds() / 60))
    return (
        f"Too many failed sign-ins from this address. Sign-in from it is locked "
        f"for {minutes} minute{'s' if minutes != 1 else ''}, even with the right password; "
        "each further try starts the wait again."
    )


def lockout_response(
    request: HttpRequest, original_response: HttpResponse | None, credentials: Any
) -> HttpResponse:
    """What a locked-out login gets: 429 with `Retry-After`, as JSON for the API
    and as the sign-in page with the reason for a browser (portal or admin)."""
    reason = lockout_reason()
    response: HttpResponse
    if request.path.startswith("/api/"):
        response = JsonResponse({"detail": reason}, status=429)
    else:
        response = render(
            request, "registration/login.html", {"lockout": reason, "next": ""}, status=429
        )
    response["Retry-After"] = str(lockout_seconds())
    return response


# --- API request rates --------------------------------------------------------------


class UserRequestThrottle(UserRateThrottle):
    """Requests per signed-in user (settings.QM_API_RATE_USER).

    The rate is read from settings at each request rather than from DRF's
    `DEFAULT_THROTTLE_RATES`, which DRF copies once at import, so a changed
    setting (a test's, above all) takes effect."""

    def get_rate(self) -> str:
        return str(settings.QM_API_RATE_USER)


class AnonRequestThrottle(AnonRateThrottle):
    """Requests per anonymous client address (settings.QM_API_RATE_ANON), the
    address counted as the login lockout counts it (`client_address`)."""

    def get_rate(self) -> str:
        return str(settings.QM_API_RATE_ANON)

    def get_ident(self, request: Request) -> str:
        return client_address(request) or super().get_ident(request)
