"""Serializers and fields of the configuration API (portal.rest.quotas): flavors, nodes,
teams, quotas and their preview, priority classes and the audit log. They shape and
validate what is sent; they never write (the views call quotas.services).
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from core.api import NamedRelatedField
from quotas import selectors, services
from quotas.limits import queued_job_limits
from quotas.models import AuditEntry, Node, PriorityClass, Quota, ResourceFlavor, Team
from quotas.services import MAX_QUEUED_JOBS
from quotas.validation import MAX_GPUS, WEIGHT_RANGE, parse_count, parse_weight

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
    gpus = serializers.IntegerField(min_value=0, max_value=MAX_GPUS)
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
            "shrink_elastic",
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
    shrink_elastic = serializers.BooleanField(
        required=False,
        help_text=(
            "Let the scheduler shrink this class's running elastic jobs to a smaller size "
            "rather than evict them for reclaim, priority or fair share, and grow them back "
            "once their team has room. Default: false."
        ),
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
