"""What every API module shares: the error handler that turns the services' and
the ORM's errors into 400/403/404 answers, pagination, related fields named by
slug, the admin-or-read-only permission and the documented error responses.

Nothing here knows a model: the domains' viewsets build on it."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ObjectDoesNotExist
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import DataError, IntegrityError
from django.http import Http404
from drf_spectacular.utils import OpenApiResponse
from rest_framework import exceptions, permissions, serializers
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler


def validation_detail(error: DjangoValidationError) -> dict[str, list[str]]:
    """A django ValidationError as the API's `{field: [reasons]}` body."""
    if hasattr(error, "error_dict"):
        return {
            field: [str(message) for message in messages]
            for field, messages in error.message_dict.items()
        }
    return {"non_field_errors": [str(message) for message in error.messages]}


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's handler, taught the errors the services and the ORM raise.

    A service's ValidationError is bad input (400, naming the field); a row
    that is not there is 404; a constraint the database enforced is also bad
    input, never a 500.
    """
    if isinstance(exc, DjangoValidationError):
        exc = exceptions.ValidationError(validation_detail(exc))
    elif isinstance(exc, ObjectDoesNotExist):
        exc = Http404(str(exc))
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied(str(exc) or None)
    elif isinstance(exc, IntegrityError):
        exc = exceptions.ValidationError(
            {
                "non_field_errors": [
                    "The change conflicts with the current data; reload and try again."
                ]
            }
        )
    elif isinstance(exc, DataError | OverflowError):
        exc = exceptions.ValidationError(
            {"non_field_errors": ["A value is out of range for the database."]}
        )
    return drf_exception_handler(exc, context)


class Pagination(LimitOffsetPagination):
    """Limit/offset pages, capped so a huge `limit` cannot ask the database for the impossible."""

    default_limit = 100
    max_limit = 1000


def deny(message: str) -> exceptions.PermissionDenied:
    return exceptions.PermissionDenied(message)


class NamedRelatedField(serializers.SlugRelatedField):  # type: ignore[type-arg]
    """A related row named by its slug or name. Text no row can have (NUL bytes,
    lone surrogates, non-text) is refused before it reaches the database, which
    would otherwise fail on it."""

    def __init__(self, *args: Any, list_valid: bool = False, **kwargs: Any) -> None:
        # Only for rows every signed-in user may know of (flavors): a refusal then
        # names the valid choices. Team names are never listed to another tenant.
        self.list_valid = list_valid
        super().__init__(*args, **kwargs)

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, str | int) or isinstance(data, bool):
            self.fail("invalid")
        text = str(data)
        # A serializer that names the same rows many times (a batch of jobs) puts a
        # dict under `named_rows` in its context: each name is then looked up once.
        found = self.context.get("named_rows")
        if found is None:
            return self._look_up(text)
        key = (self.get_queryset().model, self.slug_field, text)
        if key not in found:
            found[key] = self._look_up(text)
        return found[key]

    def _look_up(self, text: str) -> Any:
        try:
            if "\x00" in text or any("\ud800" <= c <= "\udfff" for c in text) or len(text) > 253:
                self.fail("does_not_exist", slug_name=self.slug_field, value=text[:100])
            return super().to_internal_value(text)
        except serializers.ValidationError:
            if not self.list_valid:
                raise
            names = sorted(
                str(name) for name in self.get_queryset().values_list(self.slug_field, flat=True)
            )
            raise serializers.ValidationError(
                f"There is no {text[:100]!r}; the valid choices are: {', '.join(names) or 'none yet'}.",
                code="does_not_exist",
            ) from None


class IsAdminOrReadOnly(permissions.BasePermission):
    """Everyone signed in reads; only platform admins (staff) write."""

    message = "Only platform admins may change this."

    def has_permission(self, request: Request, view: Any) -> bool:
        if not request.user or not request.user.is_authenticated:
            return False
        return request.method in permissions.SAFE_METHODS or bool(request.user.is_staff)


ERROR_RESPONSES = {
    400: OpenApiResponse(description="Bad input: `{field: [reasons]}`."),
    401: OpenApiResponse(description="Not signed in."),
    403: OpenApiResponse(description="Not allowed."),
    404: OpenApiResponse(description="No such object (or not visible to you)."),
    429: OpenApiResponse(
        description="Over a limit (too many failed sign-ins, or too many trap events); the body says which, and `Retry-After` how long to wait where it applies."
    ),
    503: OpenApiResponse(
        description="Busy for a moment: nothing was stored; send the same request again after `Retry-After` seconds."
    ),
}


def responses(ok: Any, *codes: int, status_code: int = 200) -> dict[int, Any]:
    """An operation's documented responses: the success body and the listed errors."""
    documented: dict[int, Any] = {status_code: ok}
    for code in codes:
        documented[code] = ERROR_RESPONSES[code]
    return documented
