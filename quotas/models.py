"""The cluster and who may use it: flavors, nodes, the team tree, quotas,
priority classes, memberships and the audit log."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Q

from core.access import Role

# The smallest limits a flavor may set for its ranks' sandbox on the local runtime: below
# them a rank could not start its shell and Python (the site's QM_RANK_PIDS_MAX has the
# same floor).
RANK_PIDS_MIN = 8
RANK_MEMORY_PER_GPU_MIN = 64 << 20
RANK_FILE_SIZE_MIN = 1 << 20


class ResourceFlavor(models.Model):
    """A kind of GPU that quotas are counted in, e.g. `h100-80gb`.

    The `rank_*` fields override, for the ranks of jobs on this flavor, the site's
    limits of the local runtime's sandbox (QM_RANK_PIDS_MAX, QM_RANK_MEMORY_MAX,
    QM_RANK_FILE_SIZE_MAX); empty means the site's. Memory is given per GPU, since a
    rank with more GPUs feeds more of them: a rank's limit is this times its GPUs.
    """

    name = models.SlugField(max_length=63, unique=True)
    description = models.CharField(max_length=200, blank=True)
    rank_pids_max = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(RANK_PIDS_MIN)],
        help_text="Processes and threads a rank may have at once; empty: the site's limit.",
    )
    rank_memory_per_gpu = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(RANK_MEMORY_PER_GPU_MIN)],
        help_text="Bytes of memory a rank may hold per GPU it has; empty: the site's "
        "limit per rank.",
    )
    rank_file_size_max = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(RANK_FILE_SIZE_MIN)],
        help_text="Bytes of the largest file a rank may write; empty: the site's limit.",
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Node(models.Model):
    """A machine with `gpus` GPUs of one flavor that the engine may place ranks on."""

    name = models.CharField(max_length=253, unique=True)
    flavor = models.ForeignKey(ResourceFlavor, on_delete=models.PROTECT, related_name="nodes")
    gpus = models.PositiveIntegerField()
    labels = models.JSONField(default=dict, blank=True)
    schedulable = models.BooleanField(default=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(condition=Q(gpus__gte=0), name="node_gpus_nonnegative")
        ]

    def __str__(self) -> str:
        return self.name


class Team(models.Model):
    """A node of the team tree. Leaves submit jobs; inner teams group them.

    `weight` divides the surplus beyond guarantees among siblings.

    `priority_classes` are the classes the team's jobs may use, like a QOS list
    on a Slurm association. Left empty, the team uses its parent's classes; a
    list of its own can only narrow its parent's (see
    `quotas.selectors.priority_allowance`). `default_priority_class` is the
    class of a job submitted without one (null: the parent's default).

    `max_queued_jobs` caps the jobs waiting to run (pending or requeued) that
    the team may have, like Slurm's MaxSubmitJobs. It is inherited the way
    priority classes are: a team's own limit can only narrow those above it,
    and where no team on the way up sets one the site default applies
    (settings.QM_MAX_QUEUED_JOBS_PER_TEAM; `quotas.limits.queued_job_limits`).
    """

    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="children"
    )
    slug = models.SlugField(max_length=63, unique=True)
    name = models.CharField(max_length=120)
    weight = models.FloatField(default=1.0)
    created_at = models.DateTimeField(auto_now_add=True)
    priority_classes = models.ManyToManyField(
        "PriorityClass",
        blank=True,
        related_name="allowed_teams",
        help_text="The classes this team's jobs may use; empty: the parent team's.",
    )
    default_priority_class = models.ForeignKey(
        "PriorityClass",
        null=True,
        blank=True,
        # Deleting a class makes its teams fall back to their parent's default.
        on_delete=models.SET_NULL,
        related_name="default_for_teams",
        help_text="The class of a job submitted without one; empty: the parent team's.",
    )
    max_queued_jobs = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text=(
            "How many jobs the team may have waiting to run; empty: the teams' above "
            "it, or the site default. A limit here can only narrow theirs."
        ),
    )

    class Meta:
        ordering = ["slug"]
        constraints = [
            models.CheckConstraint(condition=Q(weight__gt=0), name="team_weight_positive"),
            models.CheckConstraint(condition=~Q(parent=models.F("id")), name="team_not_own_parent"),
        ]

    def __str__(self) -> str:
        return self.slug


class Quota(models.Model):
    """What a team holds of one flavor.

    `guarantee` GPUs are the team's own; `borrow_limit` caps what it may borrow
    beyond them (null: no cap); `lend_limit` caps what others may borrow of its
    idle guarantee (null: all of it).
    """

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="quotas")
    flavor = models.ForeignKey(ResourceFlavor, on_delete=models.PROTECT, related_name="quotas")
    guarantee = models.PositiveIntegerField(default=0)
    borrow_limit = models.PositiveIntegerField(null=True, blank=True)
    lend_limit = models.PositiveIntegerField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["team__slug", "flavor__name"]
        constraints = [
            models.UniqueConstraint(fields=["team", "flavor"], name="quota_one_per_team_flavor"),
            models.CheckConstraint(
                condition=Q(guarantee__gte=0), name="quota_guarantee_nonnegative"
            ),
            models.CheckConstraint(
                condition=Q(borrow_limit__isnull=True) | Q(borrow_limit__gte=0),
                name="quota_borrow_limit_nonnegative",
            ),
            models.CheckConstraint(
                condition=Q(lend_limit__isnull=True) | Q(lend_limit__gte=0),
                name="quota_lend_limit_nonnegative",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.team.slug}/{self.flavor.name}"


# The checkpoint notice window a priority class gets unless it says otherwise: long
# enough for a background save of a few GB, short against the default grace window.
DEFAULT_NOTICE_SECONDS = 30


class PriorityClass(models.Model):
    """How much a job matters and how it may be stopped.

    `preemption_policy` decides only whether this class preempts lower ones
    inside its own team; `preemptible` decides whether it may ever be a victim.
    `min_runtime_seconds` protects a fresh job from priority, fair-share and
    consolidation preemption; the four `*_min_runtime_seconds` fields set this
    class's own minimum for one preemption reason (empty: the cluster's scheduling
    policy, `SchedulingPolicy`, raised to `min_runtime_seconds`).
    `notice_seconds` is the checkpoint notice window: how long a victim whose
    trap speaks the notice protocol may take to commit a checkpoint before it
    is evicted (0: no notice). It is part of the grace budget, so the GPUs are
    free by the same deadline with or without it.
    `shrink_elastic` lets the scheduler resize this class's running elastic jobs:
    shrink one to a smaller size rather than evict it for reclaim, priority or fair
    share, and grow it back once its team has room (`fairshare/README.md`, "Elastic
    gangs that run"). Off, an elastic job runs at the size it started at.
    """

    class Policy(models.TextChoices):
        PREEMPT_LOWER = "PreemptLowerPriority", "PreemptLowerPriority"
        NEVER = "Never", "Never"

    name = models.SlugField(max_length=63, unique=True)
    value = models.IntegerField()
    preemption_policy = models.CharField(
        max_length=32, choices=Policy.choices, default=Policy.NEVER
    )
    preemptible = models.BooleanField(default=True)
    grace_seconds = models.PositiveIntegerField(default=60)
    # A database default as well, so that code of the release before (which knows no
    # such column) can still add classes during a deploy or after a rollback.
    notice_seconds = models.PositiveIntegerField(
        default=DEFAULT_NOTICE_SECONDS, db_default=DEFAULT_NOTICE_SECONDS
    )
    min_runtime_seconds = models.PositiveIntegerField(default=0)
    # A database default as well, for the reason notice_seconds gives.
    shrink_elastic = models.BooleanField(default=False, db_default=False)
    priority_min_runtime_seconds = models.PositiveIntegerField(null=True, blank=True)
    fair_share_min_runtime_seconds = models.PositiveIntegerField(null=True, blank=True)
    reclaim_min_runtime_seconds = models.PositiveIntegerField(null=True, blank=True)
    consolidation_min_runtime_seconds = models.PositiveIntegerField(null=True, blank=True)
    description = models.CharField(max_length=300, blank=True)
    is_default = models.BooleanField(default=False)

    class Meta:
        ordering = ["-value"]
        verbose_name_plural = "priority classes"
        constraints = [
            models.UniqueConstraint(
                fields=["is_default"],
                condition=Q(is_default=True),
                name="one_default_priority_class",
            ),
            models.CheckConstraint(
                condition=Q(preemption_policy__in=["PreemptLowerPriority", "Never"]),
                name="priority_class_policy_valid",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def min_runtime_by_reason(self) -> dict[str, float]:
        """This class's own minimum runtime per preemption reason, in the engine's terms."""
        fields = (
            ("priority", self.priority_min_runtime_seconds),
            ("fair-share", self.fair_share_min_runtime_seconds),
            ("reclaim", self.reclaim_min_runtime_seconds),
            ("consolidate", self.consolidation_min_runtime_seconds),
        )
        return {reason: float(value) for reason, value in fields if value is not None}


class Membership(models.Model):
    """A person's role in a team. Managers edit the quotas below their team;
    researchers submit jobs. Platform admins are Django staff instead."""

    Role = Role

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices)

    class Meta:
        ordering = ["team__slug", "user__username"]
        constraints = [
            models.UniqueConstraint(fields=["user", "team"], name="membership_one_per_user_team"),
            models.CheckConstraint(
                condition=Q(role__in=["manager", "researcher"]), name="membership_role_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.user} {self.role} of {self.team}"


class AuditEntry(models.Model):
    """One change a person made: who, when, to what, and the values before and after."""

    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    at = models.DateTimeField(auto_now_add=True, db_index=True)
    action = models.CharField(max_length=64)
    object_type = models.CharField(max_length=64)
    object_id = models.CharField(max_length=64)
    object_repr = models.CharField(max_length=200)
    team = models.ForeignKey(
        Team, null=True, blank=True, on_delete=models.SET_NULL, related_name="audit_entries"
    )
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    # Why the person made the change, in their words; optional.
    reason = models.CharField(max_length=300, blank=True, default="")

    class Meta:
        ordering = ["-at", "-id"]
        verbose_name_plural = "audit entries"
        indexes = [models.Index(fields=["object_type", "object_id"])]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M} {self.actor} {self.action} {self.object_repr}"


class SchedulingPolicy(models.Model):
    """The cluster-wide scheduling settings an admin may change while it runs: decayed
    usage (half-life and strength) and the minimum runtime per preemption reason.

    There is at most one row (pk 1); until an admin saves it, the deployment's settings
    (`QM_USAGE_*`, `QM_*_MIN_RUNTIME_SECONDS`) are the policy, and the first save
    starts from them (`quotas.selectors.scheduling_policy`). A priority class's own
    `*_min_runtime_seconds` replace the minimum for its jobs.
    """

    SINGLETON = 1

    usage_strength = models.FloatField(
        help_text="How much recent use beyond a guarantee lowers a team's share of spare "
        "GPUs; 0: weight alone."
    )
    usage_half_life_seconds = models.FloatField(
        help_text="Every second of use counts half as much after this long."
    )
    priority_min_runtime_seconds = models.PositiveIntegerField()
    fair_share_min_runtime_seconds = models.PositiveIntegerField()
    reclaim_min_runtime_seconds = models.PositiveIntegerField()
    consolidation_min_runtime_seconds = models.PositiveIntegerField()
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "scheduling policy"
        constraints = [
            models.CheckConstraint(condition=Q(pk=1), name="scheduling_policy_single_row"),
            models.CheckConstraint(
                condition=Q(usage_strength__gte=0), name="scheduling_policy_strength_nonnegative"
            ),
            models.CheckConstraint(
                condition=Q(usage_half_life_seconds__gt=0),
                name="scheduling_policy_half_life_positive",
            ),
        ]

    def __str__(self) -> str:
        return "scheduling policy"
