"""What every API module shares: the error handler, pagination, the per-request
access check, and the API tokens people create for `qm` and scripts."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import authenticate
from django.core.exceptions import ObjectDoesNotExist
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import DataError, IntegrityError
from django.http import Http404
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import exceptions, mixins, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from portal.models import ApiToken, TokenScope
from quotas.selectors import Access, access_for


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


def access_of(request: Request) -> Access:
    """The requesting user's access, computed once per request."""
    cached = getattr(request, "_qm_access", None)
    if cached is None:
        cached = access_for(request.user)
        request._qm_access = cached
    return cached


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
}


def responses(ok: Any, *codes: int, status_code: int = 200) -> dict[int, Any]:
    """An operation's documented responses: the success body and the listed errors."""
    documented: dict[int, Any] = {status_code: ok}
    for code in codes:
        documented[code] = ERROR_RESPONSES[code]
    return documented


class BearerTokenScheme(OpenApiAuthenticationExtension):  # type: ignore[no-untyped-call]
    """Describes portal.auth.BearerTokenAuthentication in the OpenAPI schema."""

    target_class = "portal.auth.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "description": "An API token from `tokens/`."}


# --- API tokens ----------------------------------------------------------------


class ApiTokenSerializer(serializers.ModelSerializer[ApiToken]):
    class Meta:
        model = ApiToken
        fields = [
            "id",
            "name",
            "prefix",
            "scope",
            "created_at",
            "expires_at",
            "last_used_at",
            "revoked_at",
        ]
        read_only_fields = fields


class ApiTokenCreateSerializer(serializers.Serializer[Any]):
    name = serializers.CharField(max_length=100)
    days = serializers.IntegerField(
        required=False,
        min_value=1,
        help_text="How many days the token lasts; the portal's default when left out, "
        "its maximum (QM_TOKEN_MAX_DAYS) at most.",
    )
    scope = serializers.ChoiceField(
        choices=TokenScope.choices,
        default=TokenScope.FULL,
        help_text="`read` limits the token to GET, HEAD and OPTIONS.",
    )


class ApiTokenCreatedSerializer(ApiTokenSerializer):
    token = serializers.CharField(help_text="The token itself. It is shown only this once.")

    class Meta(ApiTokenSerializer.Meta):
        fields = [*ApiTokenSerializer.Meta.fields, "token"]
        read_only_fields = fields


class LoginSerializer(ApiTokenCreateSerializer):
    username = serializers.CharField(max_length=150)
    password = serializers.CharField(max_length=4096, trim_whitespace=False)
    name = serializers.CharField(max_length=100, required=False, default="qm")


def _token_options(incoming: ApiTokenCreateSerializer) -> dict[str, Any]:
    return {
        "name": incoming.validated_data["name"],
        "days": incoming.validated_data.get("days"),
        "scope": incoming.validated_data["scope"],
    }


def _created(token: ApiToken, value: str) -> dict[str, Any]:
    body = dict(ApiTokenSerializer(token).data)
    body["token"] = value
    return body


@extend_schema_view(
    list=extend_schema(
        summary="Your API tokens", responses=responses(ApiTokenSerializer(many=True), 401)
    ),
    retrieve=extend_schema(
        summary="One of your API tokens", responses=responses(ApiTokenSerializer, 401, 404)
    ),
    destroy=extend_schema(
        summary="Revoke one of your API tokens",
        responses=responses(None, 401, 404, status_code=204),
    ),
)
class ApiTokenViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet[ApiToken],
):
    """A user's own API tokens. Nobody sees or revokes another person's tokens,
    admins included: a token is a password."""

    serializer_class = ApiTokenSerializer
    pagination_class = Pagination
    lookup_value_regex = r"[0-9]+"

    def get_queryset(self) -> Any:
        if getattr(self, "swagger_fake_view", False) or not self.request.user.is_authenticated:
            return ApiToken.objects.none()
        return ApiToken.objects.filter(user=self.request.user)

    def get_permissions(self) -> list[permissions.BasePermission]:
        if self.action == "login":
            return [permissions.AllowAny()]
        return [permissions.IsAuthenticated()]

    @extend_schema(
        summary="Create an API token",
        description="Only a signed-in browser session may create tokens; a token may not "
        "(so a leaked token cannot renew itself). Scripts sign in with `tokens/login/`.",
        request=ApiTokenCreateSerializer,
        responses=responses(ApiTokenCreatedSerializer, 400, 401, 403, status_code=201),
    )
    def create(self, request: Request) -> Response:
        from portal.services import api_token_create

        if isinstance(request.auth, ApiToken):
            raise deny(
                "A token cannot create tokens. Sign in with your password (`qm login`) "
                "or create one on the portal's tokens page."
            )
        incoming = ApiTokenCreateSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        token, value = api_token_create(user=request.user, **_token_options(incoming))
        return Response(_created(token, value), status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance: ApiToken) -> None:
        from portal.services import api_token_revoke

        api_token_revoke(user=self.request.user, token=instance)

    @extend_schema(
        summary="Sign in with a username and password and get a new API token",
        description="What `qm login` calls. The token is shown only in this answer.",
        request=LoginSerializer,
        responses=responses(ApiTokenCreatedSerializer, 400, 403, 429, status_code=201),
    )
    @action(detail=False, methods=["post"], authentication_classes=[])
    def login(self, request: Request) -> Response:
        from portal.services import api_token_create

        incoming = LoginSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        user = authenticate(
            request._request,
            username=incoming.validated_data["username"],
            password=incoming.validated_data["password"],
        )
        # A locked-out login is answered 429 by axes' middleware (portal/throttling.py).
        if user is None or not user.is_active:
            raise deny("Wrong username or password.")
        token, value = api_token_create(user=user, **_token_options(incoming))
        return Response(_created(token, value), status=status.HTTP_201_CREATED)
