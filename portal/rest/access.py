"""The requesting user's access, computed once per API request."""

from __future__ import annotations

from rest_framework.request import Request

from core.access import Access
from quotas.selectors import access_for


def access_of(request: Request) -> Access:
    """The requesting user's access, computed once per request."""
    cached = getattr(request, "_qm_access", None)
    if cached is None:
        cached = access_for(request.user)
        request._qm_access = cached
    return cached
