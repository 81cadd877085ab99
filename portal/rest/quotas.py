"""REST API of the cluster's configuration: flavors, nodes, the team tree,
quotas (with the consequence preview), priority classes and the audit log.

Reads go through quotas.selectors, which scope them to the asking user, so a
team outside a user's view answers 404; writes go through quotas.services,
whose ValidationErrors become 400 answers naming the field. The serializers
live in portal.rest.quotas_serializers; this module holds the viewsets.
"""

from __future__ import annotations

from typing import Any

import django_filters
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import IsAdminOrReadOnly, Pagination, deny, responses
from portal.rest.access import access_of
from portal.rest.quotas_serializers import (
    AuditEntrySerializer,
    FlavorSerializer,
    NodeSerializer,
    PriorityClassSerializer,
    PriorityClassWriteSerializer,
    QuotaPreviewResultSerializer,
    QuotaPreviewSerializer,
    QuotaSerializer,
    QuotaUpdateSerializer,
    TeamNodeSerializer,
    TeamPriorityClassesSerializer,
    TeamPriorityClassesUpdateSerializer,
    TeamSerializer,
    TeamUpdateSerializer,
)
from preemption.quota_preview import quota_preview
from quotas import selectors, services
from quotas.limits import queued_job_limits
from quotas.models import AuditEntry, Node, PriorityClass, Quota, Team


def _team_priority_classes(team: Team) -> dict[str, Any]:
    allowance = selectors.priority_allowance(team=team)
    own = sorted(team.priority_classes.values_list("name", flat=True))
    return {
        "team": team.slug,
        "allowed": allowance.names,
        "default": allowance.default.name if allowance.default else None,
        "priority_classes": own or None,
        "default_priority_class": (
            team.default_priority_class.name if team.default_priority_class_id else None
        ),
        "source": allowance.source,
    }


# --- viewsets ------------------------------------------------------------------


class _Base(viewsets.GenericViewSet[Any]):
    pagination_class = Pagination
    lookup_value_regex = r"[0-9]+"
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]


@extend_schema_view(
    list=extend_schema(
        summary="GPU flavors", responses=responses(FlavorSerializer(many=True), 401)
    ),
    retrieve=extend_schema(summary="One flavor", responses=responses(FlavorSerializer, 401, 404)),
    create=extend_schema(
        summary="Add a flavor (admins)",
        responses=responses(FlavorSerializer, 400, 401, 403, status_code=201),
    ),
)
class FlavorViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.CreateModelMixin, _Base
):
    serializer_class = FlavorSerializer
    permission_classes = [IsAdminOrReadOnly]

    def get_queryset(self) -> Any:
        return selectors.flavor_list(user=self.request.user)

    def perform_create(self, serializer: Any) -> None:
        serializer.instance = services.flavor_create(
            actor=self.request.user, **serializer.validated_data
        )


@extend_schema_view(
    list=extend_schema(summary="Nodes", responses=responses(NodeSerializer(many=True), 401)),
    retrieve=extend_schema(summary="One node", responses=responses(NodeSerializer, 401, 404)),
    create=extend_schema(
        summary="Add a node (admins)",
        responses=responses(NodeSerializer, 400, 401, 403, status_code=201),
    ),
    partial_update=extend_schema(
        summary="Change a node (admins)", responses=responses(NodeSerializer, 400, 401, 403, 404)
    ),
    destroy=extend_schema(
        summary="Remove a node (admins)",
        responses=responses(None, 400, 401, 403, 404, status_code=204),
    ),
)
class NodeViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    mixins.DestroyModelMixin,
    _Base,
):
    serializer_class = NodeSerializer
    permission_classes = [IsAdminOrReadOnly]
    filterset_fields = ["schedulable"]

    def get_queryset(self) -> Any:
        return selectors.node_list(user=self.request.user)

    def perform_create(self, serializer: Any) -> None:
        values = serializer.validated_data
        if Node.objects.filter(name=values["name"]).exists():
            raise serializers.ValidationError(
                {"name": [f"A node named {values['name']!r} already exists."]}
            )
        serializer.instance = services.node_upsert(actor=self.request.user, **values)

    def perform_update(self, serializer: Any) -> None:
        node: Node = serializer.instance
        values = {
            "flavor": node.flavor,
            "gpus": node.gpus,
            "labels": node.labels,
            "schedulable": node.schedulable,
            **serializer.validated_data,
        }
        if values.get("name", node.name) != node.name:
            raise serializers.ValidationError(
                {"name": ["A node cannot be renamed; add a new one instead."]}
            )
        values["name"] = node.name
        serializer.instance = services.node_upsert(actor=self.request.user, **values)

    def perform_destroy(self, instance: Node) -> None:
        services.node_delete(actor=self.request.user, node=instance)


def _team_tree(teams: list[Team], quotas: list[Quota]) -> list[dict[str, Any]]:
    """Nest readable teams under their readable parents; the rest are roots."""
    by_team: dict[int, list[dict[str, Any]]] = {}
    for quota in quotas:
        by_team.setdefault(quota.team_id, []).append(
            {
                "id": quota.pk,
                "flavor": quota.flavor.name,
                "guarantee": quota.guarantee,
                "borrow_limit": quota.borrow_limit,
                "lend_limit": quota.lend_limit,
            }
        )
    nodes = {
        team.pk: {
            "id": team.pk,
            "slug": team.slug,
            "name": team.name,
            "weight": team.weight,
            "quotas": by_team.get(team.pk, []),
            "children": [],
        }
        for team in teams
    }
    roots: list[dict[str, Any]] = []
    for team in teams:
        if team.parent_id in nodes:
            nodes[team.parent_id]["children"].append(nodes[team.pk])
        else:
            roots.append(nodes[team.pk])
    return roots


@extend_schema_view(
    list=extend_schema(
        summary="Teams you can see", responses=responses(TeamSerializer(many=True), 401)
    ),
    retrieve=extend_schema(summary="One team", responses=responses(TeamSerializer, 401, 404)),
    create=extend_schema(
        summary="Add a team (admins)",
        responses=responses(TeamSerializer, 400, 401, 403, status_code=201),
    ),
    partial_update=extend_schema(
        summary="Rename, reweigh or move a team",
        description="A manager above the team may change its name and weight; moving it is for admins.",
        request=TeamUpdateSerializer,
        responses=responses(TeamSerializer, 400, 401, 403, 404),
    ),
    destroy=extend_schema(
        summary="Delete a team (admins)",
        responses=responses(None, 400, 401, 403, 404, status_code=204),
    ),
)
class TeamViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    mixins.DestroyModelMixin,
    _Base,
):
    serializer_class = TeamSerializer
    permission_classes = [IsAuthenticated]

    def get_queryset(self) -> Any:
        return selectors.team_list(user=self.request.user)

    def get_serializer(self, *args: Any, **kwargs: Any) -> Any:
        """The serializer, with the queued-job limits in force of the teams it shows
        worked out in one pass (`quotas.limits`), however many there are."""
        shown = args[0] if args else None
        teams = shown if isinstance(shown, list) else [shown] if isinstance(shown, Team) else []
        if teams:
            kwargs.setdefault("context", self.get_serializer_context())
            kwargs["context"]["queued_job_limits"] = queued_job_limits(
                team_ids=[team.pk for team in teams], tree=selectors.team_tree()
            )
        return super().get_serializer(*args, **kwargs)

    def perform_create(self, serializer: Any) -> None:
        if not access_of(self.request).is_admin:
            raise deny("Only platform admins may add teams.")
        values = serializer.validated_data
        serializer.instance = services.team_create(
            actor=self.request.user,
            slug=values["slug"],
            name=values.get("name", ""),
            parent=values.get("parent"),
            weight=values.get("weight", 1.0),
        )

    def partial_update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        team = self.get_object()
        access = access_of(request)
        incoming = TeamUpdateSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        values = incoming.validated_data
        if not access.can_edit_quota_of(team.pk):
            raise deny(f"Only a manager above {team.slug} or an admin may change it.")
        if "parent" in values and not access.is_admin:
            raise deny("Only platform admins may move teams in the tree.")
        team = services.team_update(
            actor=request.user,
            team=team,
            name=values.get("name"),
            weight=values.get("weight"),
            parent=values.get("parent", services.UNSET),
            max_queued_jobs=values.get("max_queued_jobs", services.UNSET),
            may_widen=access.is_admin,
        )
        return Response(self.get_serializer(team).data)

    def perform_destroy(self, instance: Team) -> None:
        if not access_of(self.request).is_admin:
            raise deny("Only platform admins may delete teams.")
        services.team_delete(actor=self.request.user, team=instance)

    @extend_schema(
        methods=["GET"],
        summary="The priority classes a team may use, and its default",
        responses=responses(TeamPriorityClassesSerializer, 401, 404),
    )
    @extend_schema(
        methods=["PATCH"],
        summary="Change the priority classes a team may use",
        description=(
            "Admins set any list inside the parent's classes. A manager above the team may "
            "only narrow it and pick its default among the classes it may already use."
        ),
        request=TeamPriorityClassesUpdateSerializer,
        responses=responses(TeamPriorityClassesSerializer, 400, 401, 403, 404),
    )
    @action(detail=True, methods=["get", "patch"], url_path="priority-classes")
    def priority_classes(self, request: Request, pk: str | None = None) -> Response:
        team = self.get_object()
        if request.method == "GET":
            return Response(_team_priority_classes(team))
        access = access_of(request)
        if not access.can_edit_quota_of(team.pk):
            raise deny(f"Only a manager above {team.slug} or an admin may change its classes.")
        incoming = TeamPriorityClassesUpdateSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        values = incoming.validated_data
        services.team_priority_classes_set(
            actor=request.user,
            team=team,
            priority_classes=values.get("priority_classes", services.UNSET),
            default_priority_class=values.get("default_priority_class", services.UNSET),
            may_widen=access.is_admin,
        )
        team.refresh_from_db()
        return Response(_team_priority_classes(team))

    @extend_schema(
        summary="The team tree you can see, with quotas",
        responses=responses(TeamNodeSerializer(many=True), 401),
    )
    @action(detail=False, methods=["get"], pagination_class=None)
    def tree(self, request: Request) -> Response:
        teams = list(self.get_queryset())
        quotas = list(selectors.quota_list(user=request.user))
        return Response(_team_tree(teams, quotas))


class QuotaFilter(django_filters.FilterSet):
    team = django_filters.CharFilter(field_name="team__slug", help_text="Team slug.")
    flavor = django_filters.CharFilter(field_name="flavor__name", help_text="Flavor name.")

    class Meta:
        model = Quota
        fields = ["team", "flavor"]


@extend_schema_view(
    list=extend_schema(
        summary="Quotas you can see", responses=responses(QuotaSerializer(many=True), 401)
    ),
    retrieve=extend_schema(summary="One quota", responses=responses(QuotaSerializer, 401, 404)),
    create=extend_schema(
        summary="Give a team a quota of a flavor",
        description="For a manager above the team, or an admin.",
        responses=responses(QuotaSerializer, 400, 401, 403, status_code=201),
    ),
    partial_update=extend_schema(
        summary="Change a quota",
        description="For a manager above the team, or an admin. Fields left out keep their value.",
        request=QuotaUpdateSerializer,
        responses=responses(QuotaSerializer, 400, 401, 403, 404),
    ),
    destroy=extend_schema(
        summary="Remove a quota", responses=responses(None, 400, 401, 403, 404, status_code=204)
    ),
)
class QuotaViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    mixins.DestroyModelMixin,
    _Base,
):
    serializer_class = QuotaSerializer
    permission_classes = [IsAuthenticated]
    filterset_class = QuotaFilter

    def get_queryset(self) -> Any:
        return selectors.quota_list(user=self.request.user)

    def _check_editable(self, team: Team) -> None:
        if not access_of(self.request).can_edit_quota_of(team.pk):
            raise deny(f"Only a manager above {team.slug} or an admin may change its quotas.")

    def perform_create(self, serializer: Any) -> None:
        values = serializer.validated_data
        self._check_editable(values["team"])
        if Quota.objects.filter(team=values["team"], flavor=values["flavor"]).exists():
            raise serializers.ValidationError(
                {
                    "flavor": [
                        f"{values['team'].slug} already has a quota of {values['flavor'].name}; change it with PATCH."
                    ]
                }
            )
        serializer.instance = services.quota_set(
            actor=self.request.user,
            team=values["team"],
            flavor=values["flavor"],
            guarantee=values.get("guarantee"),
            borrow_limit=values.get("borrow_limit"),
            lend_limit=values.get("lend_limit"),
        )

    def partial_update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        quota = self.get_object()
        self._check_editable(quota.team)
        incoming = QuotaUpdateSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        quota = services.quota_update(actor=request.user, quota=quota, **incoming.validated_data)
        return Response(QuotaSerializer(quota).data)

    def perform_destroy(self, instance: Quota) -> None:
        self._check_editable(instance.team)
        services.quota_delete(actor=self.request.user, quota=instance)

    @extend_schema(
        summary="Preview a quota change: validate it, save nothing, say what it would do",
        description=(
            "Answers which running jobs the change would reclaim, which pending jobs it would admit "
            "and how every team's fair share moves. Rejected exactly like a real change."
        ),
        request=QuotaPreviewSerializer,
        responses=responses(QuotaPreviewResultSerializer, 400, 401, 403, 404),
    )
    @action(detail=True, methods=["post"])
    def preview(self, request: Request, pk: str | None = None) -> Response:
        quota = self.get_object()
        self._check_editable(quota.team)
        incoming = QuotaPreviewSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        access = access_of(request)
        values = dict(incoming.validated_data)
        # A reason belongs to a saved change; a preview saves nothing.
        values.pop("reason", None)
        return Response(
            quota_preview(
                quota=quota,
                visible_team_ids=None if access.is_admin else set(access.readable_teams),
                **values,
            )
        )


@extend_schema_view(
    list=extend_schema(
        summary="Priority classes", responses=responses(PriorityClassSerializer(many=True), 401)
    ),
    retrieve=extend_schema(
        summary="One priority class", responses=responses(PriorityClassSerializer, 401, 404)
    ),
    destroy=extend_schema(
        summary="Delete a priority class (admins)",
        responses=responses(None, 400, 401, 403, 404, status_code=204),
    ),
)
class PriorityClassViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin, _Base
):
    serializer_class = PriorityClassSerializer
    permission_classes = [IsAdminOrReadOnly]

    def get_queryset(self) -> Any:
        return selectors.priority_class_list(user=self.request.user)

    @extend_schema(
        summary="Add a priority class (admins)",
        request=PriorityClassWriteSerializer,
        responses=responses(PriorityClassSerializer, 400, 401, 403, status_code=201),
    )
    def create(self, request: Request) -> Response:
        incoming = PriorityClassWriteSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        values = dict(incoming.validated_data)
        if "notice_seconds" not in values:
            values["notice_seconds"] = services.default_notice_seconds(
                values.get("grace_seconds", PriorityClass._meta.get_field("grace_seconds").default)
            )
        saved = services.priority_class_save(
            actor=request.user, priority_class=PriorityClass(**values)
        )
        return Response(PriorityClassSerializer(saved).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        summary="Change a priority class (admins)",
        request=PriorityClassWriteSerializer(partial=True),
        responses=responses(PriorityClassSerializer, 400, 401, 403, 404),
    )
    def partial_update(self, request: Request, pk: str | None = None) -> Response:
        priority_class = self.get_object()
        incoming = PriorityClassWriteSerializer(data=request.data, partial=True)
        incoming.is_valid(raise_exception=True)
        values = incoming.validated_data
        if "name" in values and values["name"] != priority_class.name:
            raise serializers.ValidationError({"name": ["A priority class cannot be renamed."]})
        for field, value in values.items():
            setattr(priority_class, field, value)
        saved = services.priority_class_save(actor=request.user, priority_class=priority_class)
        return Response(PriorityClassSerializer(saved).data)

    def perform_destroy(self, instance: PriorityClass) -> None:
        services.priority_class_delete(actor=self.request.user, priority_class=instance)


class AuditFilter(django_filters.FilterSet):
    team = django_filters.CharFilter(field_name="team__slug", help_text="Team slug.")
    object_type = django_filters.CharFilter()
    action = django_filters.CharFilter()

    class Meta:
        model = AuditEntry
        fields = ["team", "object_type", "action"]


@extend_schema_view(
    list=extend_schema(
        summary="Changes people made",
        description="Admins see everything; managers see the changes in their subtree.",
        responses=responses(AuditEntrySerializer(many=True), 401),
    ),
    retrieve=extend_schema(
        summary="One change", responses=responses(AuditEntrySerializer, 401, 404)
    ),
)
class AuditEntryViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, _Base):
    serializer_class = AuditEntrySerializer
    permission_classes = [IsAuthenticated]
    filterset_class = AuditFilter

    def get_queryset(self) -> Any:
        return selectors.audit_list(user=self.request.user)


# --- the cluster-wide scheduling policy ------------------------------------------


class SchedulingPolicySerializer(serializers.Serializer[Any]):
    usage_strength = serializers.FloatField(
        help_text="How much recent use beyond a guarantee lowers a team's share of spare "
        f"GPUs, 0 (weight alone) to {services.MAX_USAGE_STRENGTH:g}."
    )
    usage_half_life_seconds = serializers.FloatField(
        help_text="Every second of use counts half as much after this long "
        f"({services.MIN_HALF_LIFE_SECONDS:g} s to a year)."
    )
    priority_min_runtime_seconds = serializers.IntegerField()
    fair_share_min_runtime_seconds = serializers.IntegerField()
    reclaim_min_runtime_seconds = serializers.IntegerField()
    consolidation_min_runtime_seconds = serializers.IntegerField()
    topology_levels = serializers.DictField(
        child=serializers.CharField(),
        read_only=True,
        help_text="Each topology level, outermost first, with the node label it is read "
        "from; set by the deployment (QM_TOPOLOGY_LABELS), since runtimes read it too.",
    )


def _policy_body() -> dict[str, Any]:
    policy = selectors.scheduling_policy()
    body: dict[str, Any] = {
        field: getattr(policy, field)
        for field in ("usage_strength", "usage_half_life_seconds", *services.MIN_RUNTIME_FIELDS)
    }
    body["topology_levels"] = selectors.topology_levels()
    return body


class SchedulingPolicyView(APIView):
    """Decayed usage and the minimum runtime per preemption reason, for the whole
    cluster: everyone signed in reads it, only platform admins change it."""

    permission_classes = [IsAdminOrReadOnly]

    @extend_schema(
        summary="The cluster's scheduling policy",
        responses=responses(SchedulingPolicySerializer, 401),
    )
    def get(self, request: Request) -> Response:
        return Response(SchedulingPolicySerializer(_policy_body()).data)

    @extend_schema(
        summary="Change the cluster's scheduling policy (admins)",
        request=SchedulingPolicySerializer(partial=True),
        responses=responses(SchedulingPolicySerializer, 400, 401, 403),
    )
    def patch(self, request: Request) -> Response:
        if not isinstance(request.data, dict):
            raise serializers.ValidationError(
                {"non_field_errors": ["Send an object of the settings to change."]}
            )
        writable = set(SchedulingPolicySerializer().fields) - {"topology_levels"}
        unknown = {
            field: [
                "Set by the deployment (QM_TOPOLOGY_LABELS), not through the API."
                if field == "topology_levels"
                else "Not a setting of the scheduling policy."
            ]
            for field in request.data
            if field not in writable
        }
        if unknown:
            raise serializers.ValidationError(unknown)
        incoming = SchedulingPolicySerializer(data=request.data, partial=True)
        incoming.is_valid(raise_exception=True)
        services.scheduling_policy_update(actor=request.user, **incoming.validated_data)
        return Response(SchedulingPolicySerializer(_policy_body()).data)
