"""REST API of the cluster's configuration: flavors, nodes, the team tree,
quotas (with the consequence preview), priority classes and the audit log.

Reads go through quotas.selectors, which scope them to the asking user, so a
team outside a user's view answers 404; writes go through quotas.services,
whose ValidationErrors become 400 answers naming the field.
"""

from __future__ import annotations

from typing import Any

import django_filters
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, extend_schema_field, extend_schema_view
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import IsAdminOrReadOnly, NamedRelatedField, Pagination, deny, responses
from portal.rest.access import access_of
from preemption.quota_preview import quota_preview
from quotas import selectors, services
from quotas.limits import queued_job_limits
from quotas.models import AuditEntry, Node, PriorityClass, Quota, ResourceFlavor, Team
from quotas.services import MAX_QUEUED_JOBS
from quotas.validation import WEIGHT_RANGE, parse_count, parse_weight

# --- fields ----------------------------------------------------------------------


@extend_schema_field(OpenApiTypes.INT)
class QuotaCountField(serializers.Field):  # type: ignore[type-arg]
    """A guarantee or limit as sent: a whole number where it reads as one (8, "8",
    8.0), else the value itself. The quota services refuse anything else with the
    field's allowed range, in the words the quota editor shows (`quotas.validation`)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("allow_null", True)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> Any:
        return parse_count(data)

    def to_representation(self, value: Any) -> Any:
        return value


@extend_schema_field(OpenApiTypes.DOUBLE)
class WeightField(serializers.Field):  # type: ignore[type-arg]
    """A team's weight, refused outside its range with the services' sentence."""

    def validate_empty_values(self, data: Any) -> tuple[bool, Any]:
        # A null weight is refused like any other value outside the range,
        # rather than with DRF's own "may not be null".
        if data is None:
            return False, data
        return super().validate_empty_values(data)

    def to_internal_value(self, data: Any) -> float:
        weight = parse_weight(data)
        if (message := WEIGHT_RANGE.check(weight)) is not None:
            raise serializers.ValidationError(message)
        return float(weight)

    def to_representation(self, value: Any) -> float:
        return float(value)


# --- serializers ---------------------------------------------------------------


class FlavorSerializer(serializers.ModelSerializer[ResourceFlavor]):
    class Meta:
        model = ResourceFlavor
        fields = ["id", "name", "description"]
        read_only_fields = ["id"]
        # Uniqueness is the service's rule, with its own message.
        extra_kwargs = {"name": {"validators": []}}


class NodeSerializer(serializers.ModelSerializer[Node]):
    flavor = NamedRelatedField(
        slug_field="name", queryset=ResourceFlavor.objects.all(), list_valid=True
    )
    gpus = serializers.IntegerField(min_value=0, max_value=services.MAX_GPUS)
    labels = serializers.DictField(
        child=serializers.CharField(max_length=253, allow_blank=True), required=False
    )
    # Written into the labels under each level's key (QM_TOPOLOGY_LABELS); read back
    # from them, so that a label set on Kubernetes and a domain set here are one fact.
    topology = serializers.DictField(
        child=serializers.CharField(max_length=63, allow_blank=True, allow_null=True),
        required=False,
        write_only=True,
        help_text='The node\'s domain at each topology level, e.g. {"rack": "r3"}; '
        "null or an empty string removes one.",
    )

    class Meta:
        model = Node
        fields = ["id", "name", "flavor", "gpus", "labels", "topology", "schedulable"]
        read_only_fields = ["id"]
        extra_kwargs = {"name": {"validators": []}}

    def to_representation(self, instance: Node) -> dict[str, Any]:
        body = super().to_representation(instance)
        body["topology"] = selectors.node_topology(instance)
        return body

    def validate_labels(self, labels: dict[str, str]) -> dict[str, str]:
        for key in labels:
            serializers.CharField(max_length=253).run_validation(key)
        return labels


class QueuedJobLimitSerializer(serializers.Serializer[Any]):
    limit = serializers.IntegerField(help_text="The most jobs the team may have waiting.")
    set_by = serializers.CharField(
        allow_null=True, help_text="The team whose own limit this is; null: the site default."
    )


class TeamSerializer(serializers.ModelSerializer[Team]):
    """A team. `max_queued_jobs` is its own limit (null: inherited); `queued_job_limit`
    the one in force, the smallest set on it or above it (`quotas.limits`)."""

    parent = NamedRelatedField(
        slug_field="slug", queryset=Team.objects.all(), allow_null=True, required=False
    )
    weight = WeightField(required=False)
    queued_job_limit = serializers.SerializerMethodField()

    class Meta:
        model = Team
        fields = [
            "id",
            "slug",
            "name",
            "parent",
            "weight",
            "max_queued_jobs",
            "queued_job_limit",
            "created_at",
        ]
        read_only_fields = ["id", "created_at", "max_queued_jobs"]
        extra_kwargs = {"slug": {"validators": []}, "name": {"required": False}}

    @extend_schema_field(QueuedJobLimitSerializer)
    def get_queued_job_limit(self, team: Team) -> dict[str, Any]:
        limits = self.context.get("queued_job_limits") or {}
        found = limits.get(team.pk)
        if found is None:
            found = queued_job_limits(team_ids=[team.pk], tree=selectors.team_tree())[team.pk]
        return {"limit": found.limit, "set_by": found.set_by}


class TeamUpdateSerializer(serializers.Serializer[Any]):
    name = serializers.CharField(max_length=120, required=False)
    weight = WeightField(required=False)
    max_queued_jobs = serializers.IntegerField(
        allow_null=True,
        required=False,
        min_value=0,
        max_value=MAX_QUEUED_JOBS,
        help_text=(
            "The most jobs the team may have waiting; null: inherit the limit of the teams "
            "above it (or the site default). It can only narrow theirs."
        ),
    )
    parent = NamedRelatedField(
        slug_field="slug", queryset=Team.objects.all(), allow_null=True, required=False
    )


class TeamPriorityClassesSerializer(serializers.Serializer[Any]):
    team = serializers.CharField()
    allowed = serializers.ListField(
        child=serializers.CharField(), help_text="The classes the team's jobs may use now."
    )
    default = serializers.CharField(
        allow_null=True, help_text="The class of a job submitted without one."
    )
    priority_classes = serializers.ListField(
        child=serializers.CharField(),
        allow_null=True,
        help_text="The team's own list; null: it uses its parent's classes.",
    )
    default_priority_class = serializers.CharField(
        allow_null=True, help_text="The team's own default; null: its parent's."
    )
    source = serializers.CharField(
        allow_null=True, help_text="The team whose own list is in force (this one or above)."
    )


class TeamPriorityClassesUpdateSerializer(serializers.Serializer[Any]):
    priority_classes = serializers.ListField(
        child=NamedRelatedField(slug_field="name", queryset=PriorityClass.objects.all()),
        allow_null=True,
        allow_empty=True,
        max_length=100,
        required=False,
        help_text="Class names; null or []: use the parent's classes. Admins only may widen.",
    )
    default_priority_class = NamedRelatedField(
        slug_field="name",
        queryset=PriorityClass.objects.all(),
        allow_null=True,
        required=False,
        help_text="Must be one the team may use; null: the parent's default.",
    )


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


class QuotaBriefSerializer(serializers.Serializer[Any]):
    id = serializers.IntegerField()
    flavor = serializers.CharField()
    guarantee = serializers.IntegerField()
    borrow_limit = serializers.IntegerField(allow_null=True)
    lend_limit = serializers.IntegerField(allow_null=True)


class TeamNodeSerializer(serializers.Serializer[Any]):
    id = serializers.IntegerField()
    slug = serializers.CharField()
    name = serializers.CharField()
    weight = serializers.FloatField()
    quotas = QuotaBriefSerializer(many=True)
    children = serializers.ListField(
        child=serializers.DictField(), help_text="Sub-teams, same shape."
    )


class QuotaSerializer(serializers.ModelSerializer[Quota]):
    team = NamedRelatedField(slug_field="slug", queryset=Team.objects.all())
    flavor = NamedRelatedField(
        slug_field="name", queryset=ResourceFlavor.objects.all(), list_valid=True
    )
    # Types, bounds and signs are checked by the service, so the API and the pages
    # give the same messages, each naming the allowed range.
    guarantee = QuotaCountField(required=False)
    borrow_limit = QuotaCountField(required=False)
    lend_limit = QuotaCountField(required=False)

    class Meta:
        model = Quota
        fields = ["id", "team", "flavor", "guarantee", "borrow_limit", "lend_limit", "updated_at"]
        read_only_fields = ["id", "updated_at"]
        validators: list[Any] = []

    def to_internal_value(self, data: Any) -> Any:
        # A missing guarantee is left to the service, which names its range; where
        # the team or flavor is wrong too there is no range to name yet.
        try:
            return super().to_internal_value(data)
        except serializers.ValidationError as error:
            if isinstance(data, dict) and "guarantee" not in data:
                assert isinstance(error.detail, dict)
                error.detail.setdefault(
                    "guarantee", [serializers.ErrorDetail("This field is required.", "required")]
                )
            raise


class QuotaUpdateSerializer(serializers.Serializer[Any]):
    guarantee = QuotaCountField(required=False)
    borrow_limit = QuotaCountField(required=False)
    lend_limit = QuotaCountField(required=False)
    reason = serializers.CharField(
        max_length=300, allow_blank=True, required=False, help_text="Kept with the audit entry."
    )


class QuotaPreviewSerializer(QuotaUpdateSerializer):
    weight = WeightField(
        required=False,
        help_text=f"The team's weight, which divides the surplus among siblings "
        f"({WEIGHT_RANGE.words}).",
    )


class PriorityClassSerializer(serializers.ModelSerializer[PriorityClass]):
    class Meta:
        model = PriorityClass
        fields = [
            "id",
            "name",
            "value",
            "preemption_policy",
            "preemptible",
            "grace_seconds",
            "notice_seconds",
            "min_runtime_seconds",
            *services.MIN_RUNTIME_FIELDS,
            "description",
            "is_default",
        ]
        read_only_fields = fields


class PriorityClassWriteSerializer(serializers.Serializer[Any]):
    name = serializers.SlugField(max_length=63)
    value = serializers.IntegerField(min_value=-1_000_000_000, max_value=1_000_000_000)
    preemption_policy = serializers.ChoiceField(
        choices=PriorityClass.Policy.choices, required=False
    )
    preemptible = serializers.BooleanField(required=False)
    grace_seconds = serializers.IntegerField(min_value=0, max_value=7 * 24 * 3600, required=False)
    notice_seconds = serializers.IntegerField(
        min_value=0,
        max_value=7 * 24 * 3600,
        required=False,
        help_text=(
            "The checkpoint notice window: a victim whose trap speaks the notice protocol gets "
            "this long to commit a checkpoint before its eviction; part of the grace period, so "
            "shorter than it; 0 for no notice. Default: 30 s, or half the grace period if shorter."
        ),
    )
    min_runtime_seconds = serializers.IntegerField(
        min_value=0, max_value=7 * 24 * 3600, required=False
    )
    # This class's own minimum per preemption reason; null: the scheduling policy's.
    priority_min_runtime_seconds = serializers.IntegerField(
        min_value=0, max_value=7 * 24 * 3600, required=False, allow_null=True
    )
    fair_share_min_runtime_seconds = serializers.IntegerField(
        min_value=0, max_value=7 * 24 * 3600, required=False, allow_null=True
    )
    reclaim_min_runtime_seconds = serializers.IntegerField(
        min_value=0, max_value=7 * 24 * 3600, required=False, allow_null=True
    )
    consolidation_min_runtime_seconds = serializers.IntegerField(
        min_value=0, max_value=7 * 24 * 3600, required=False, allow_null=True
    )
    description = serializers.CharField(max_length=300, allow_blank=True, required=False)
    is_default = serializers.BooleanField(required=False)


class AuditEntrySerializer(serializers.ModelSerializer[AuditEntry]):
    actor = serializers.SlugRelatedField(slug_field="username", read_only=True)
    team = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    before = serializers.JSONField(read_only=True)
    after = serializers.JSONField(read_only=True)

    class Meta:
        model = AuditEntry
        fields = [
            "id",
            "at",
            "actor",
            "action",
            "object_type",
            "object_id",
            "object_repr",
            "team",
            "before",
            "after",
            "reason",
        ]
        read_only_fields = fields


class QuotaPreviewResultSerializer(serializers.Serializer[Any]):
    change = serializers.DictField(help_text="The edited fields, before and after.")
    reclaimed = serializers.ListField(
        child=serializers.DictField(),
        help_text="Running jobs the change would preempt, with the reason.",
    )
    reclaimed_elsewhere = serializers.DictField(
        help_text="Reclaimed jobs of teams you may not read, only counted: `jobs` and `gpus`."
    )
    admitted_elsewhere = serializers.DictField(
        help_text="Admitted jobs of teams you may not read, only counted: `jobs` and `gpus`."
    )
    fair_share_elsewhere = serializers.DictField(
        help_text="Per flavor, the fair shares of the teams you may not read, added up: "
        "`teams`, `before` and `after` (`fair_share` names only teams you may read)."
    )
    decayed_usage_elsewhere = serializers.IntegerField(
        help_text="How many teams you may not read recent usage makes smaller after the change "
        "(`decayed_usage` names only teams you may read)."
    )
    exposed = serializers.DictField(
        help_text="Running jobs of the team the change leaves beyond its guarantee or over its "
        "new borrow limit: they keep their GPUs for now but are the first to be reclaimed. "
        "`used`, `beyond` (GPUs beyond the guarantee after the change), `beyond_before`, "
        "`over_borrow_limit` and `jobs` (each with `beyond`, `beyond_before` and `why`)."
    )
    released = serializers.ListField(child=serializers.CharField(), required=False)
    admitted = serializers.ListField(
        child=serializers.DictField(),
        help_text="Pending jobs the change would admit, with placement.",
    )
    fair_share = serializers.DictField(
        help_text="Per team and flavor: the fair share before and after."
    )
    decayed_usage = serializers.ListField(
        child=serializers.DictField(),
        help_text="Teams whose fair share of the flavor recent usage makes smaller after "
        "the change: `team`, `usage_ratio`, `fair_share`, `weight_fair_share` and `why`.",
    )
    non_preemptible = serializers.DictField(
        help_text=(
            "Jobs of never-preempted classes in the team's subtree: `running` (their GPUs, "
            "`floor`, are the lowest guarantee allowed) and `stranded` (waiting jobs larger "
            "than the new guarantee, which could then never start)."
        )
    )


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
