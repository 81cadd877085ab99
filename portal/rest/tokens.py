"""The API tokens people create for `qm` and scripts, and how the OpenAPI
schema describes the bearer scheme that checks them."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import authenticate
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from core.api import Pagination, deny, responses
from portal.models import ApiToken, TokenScope
from portal.services import api_token_create, api_token_revoke


class BearerTokenScheme(OpenApiAuthenticationExtension):  # type: ignore[no-untyped-call]
    """Describes portal.auth.BearerTokenAuthentication in the OpenAPI schema."""

    target_class = "portal.auth.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "description": "An API token from `tokens/`."}


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
        api_token_revoke(user=self.request.user, token=instance)

    @extend_schema(
        summary="Sign in with a username and password and get a new API token",
        description="What `qm login` calls. The token is shown only in this answer.",
        request=LoginSerializer,
        responses=responses(ApiTokenCreatedSerializer, 400, 403, 429, status_code=201),
    )
    @action(detail=False, methods=["post"], authentication_classes=[])
    def login(self, request: Request) -> Response:
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
