"""Refuse a request body larger than Django's DATA_UPLOAD_MAX_MEMORY_SIZE before
anything reads it.

Django enforces that setting only where `request.body` or `request.POST` is read;
Django REST Framework's parsers read the request as a stream and so never meet it,
and a client could make a web worker hold a body of any size in memory (a batch of
jobs is the largest legitimate one: 500 jobs of about 20 KB each). The declared
`Content-Length` decides, at the door: a body without one (chunked) is not read by
Django at all. The answer is 413 with the limit, as JSON under /api/ and as plain
text elsewhere (none of the portal's own forms comes near it).
"""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse


class BodyLimitMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        try:
            declared = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            declared = 0
        if limit is not None and declared > limit:
            reason = (
                f"The request body is {declared:,} bytes; at most {limit:,} are accepted. "
                "Send a large batch of jobs in smaller ones."
            )
            if request.path.startswith("/api/"):
                return JsonResponse({"detail": reason}, status=413)
            return HttpResponse(reason, status=413, content_type="text/plain; charset=utf-8")
        return self.get_response(request)
