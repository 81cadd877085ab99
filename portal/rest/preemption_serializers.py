"""Serializers of the jobs API (portal.rest.preemption): jobs, attempts, ranks, logs, the
trap's events, preemption events, checkpoints and webhooks, and the checks of a
submission. They shape and validate; they never write (the views call the services).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from drf_spectacular.utils import extend_schema_field
from gracetrap_protocol import EVENT_NAMES
from rest_framework import serializers

from core.access import Access
from core.api import NamedRelatedField, deny
from preemption import selectors, services
from preemption.models import Attempt, Checkpoint, Job, PreemptionEvent, Rank, Webhook
from preemption.reasons import describe_preemption, rank_end_words, why_waiting
from preemption.typed_command import command_as_typed
from quotas.models import PriorityClass, ResourceFlavor, Team

MAX_LOG_CHUNK = 1 << 20
MAX_OFFSET = 1 << 62
MAX_EVENTS_PER_POST = 100
MAX_ID = 2**63 - 1

# --- serializers ---------------------------------------------------------------


class RankSerializer(serializers.ModelSerializer[Rank]):
    job = serializers.IntegerField(source="attempt.job_id", read_only=True)
    attempt_number = serializers.IntegerField(source="attempt.number", read_only=True)
    # A plain string here: an enum would collide in the schema with the job's `state`.
    state = serializers.CharField(
        read_only=True, help_text="starting, running, terminating, exited or lost."
    )
    end_reason = serializers.CharField(
        read_only=True,
        help_text="Why the rank ended where the runtime knows: out-of-memory when the "
        "kernel killed it past its memory limit, disk-limit when its Kubernetes node "
        "evicted it past its ephemeral-storage limit; empty otherwise.",
    )
    ended_because = serializers.SerializerMethodField(
        help_text='Why the rank ended, in words: "rank 1 was killed: it used more than its '
        'memory limit of 2 GiB"; empty where the runtime does not know more than the code.'
    )

    class Meta:
        model = Rank
        fields = [
            "id",
            "job",
            "attempt",
            "attempt_number",
            "index",
            "node",
            "state",
            "exit_code",
            "end_reason",
            "ended_because",
            "memory_limit",
            "pid",
            "pod_name",
            "started_at",
            "signal_sent_at",
            "signal_received_at",
            "exited_at",
        ]
        read_only_fields = fields

    def get_ended_because(self, rank: Rank) -> str:
        return rank_end_words(rank) if rank.end_reason else ""


class AttemptSerializer(serializers.ModelSerializer[Attempt]):
    world_size = serializers.IntegerField(
        read_only=True,
        help_text="How many ranks this attempt runs (its WORLD_SIZE): the job's ranks, or "
        "for an elastic job the size it was admitted at.",
    )
    placement = serializers.JSONField(read_only=True)
    orphaned_ports = serializers.JSONField(read_only=True)
    checkpoint_step = serializers.SerializerMethodField(
        help_text="The step of the last checkpoint this attempt committed (for a stopped "
        "attempt, the one its stop saved, as `checkpoint_step` of its preemption event); "
        "null when it committed none."
    )

    class Meta:
        model = Attempt
        fields = [
            "id",
            "job",
            "number",
            "world_size",
            "placement",
            "borrowed_gpus",
            "master_port",
            "admitted_at",
            "launched_at",
            "ended_at",
            "end_reason",
            "orphaned_ports",
            "preemption_mtbp_seconds",
            "preemption_risk_reasons",
            "preemption_risk_at",
            "checkpoint_step",
        ]
        read_only_fields = fields

    @extend_schema_field(serializers.IntegerField(allow_null=True))
    def get_checkpoint_step(self, attempt: Attempt) -> int | None:
        # Annotated by selectors.with_checkpoint_step on every list; asked for here
        # only where an attempt came from elsewhere.
        if hasattr(attempt, "checkpoint_step"):
            return attempt.checkpoint_step
        annotated = selectors.with_checkpoint_step(Attempt.objects.filter(pk=attempt.pk))
        return annotated.values_list("checkpoint_step", flat=True).first()


class AttemptWithRanksSerializer(AttemptSerializer):
    ranks = RankSerializer(many=True, read_only=True, source="rank_set")
    preempted_because = serializers.SerializerMethodField(
        help_text="Why this attempt was preempted, in the job page's words; null if it was not."
    )

    resized_because = serializers.SerializerMethodField(
        help_text="Why this attempt was stopped to relaunch the job at another size, in the "
        "job page's words (\"shrunk from 8 to 4 ranks to reclaim team vision's guarantee for "
        'job 12", "grown from 4 to 8 ranks"); null if it was not resized.'
    )

    class Meta(AttemptSerializer.Meta):
        fields = [*AttemptSerializer.Meta.fields, "ranks", "preempted_because", "resized_because"]
        read_only_fields = fields

    def get_preempted_because(self, attempt: Attempt) -> str | None:
        event = getattr(attempt, "preemption", None)
        if event is None or event.reason == PreemptionEvent.Reason.RESIZE:
            return None
        return describe_preemption(event)

    def get_resized_because(self, attempt: Attempt) -> str | None:
        event = getattr(attempt, "preemption", None)
        if event is None or event.reason != PreemptionEvent.Reason.RESIZE:
            return None
        return describe_preemption(event)


class ResizeSerializer(serializers.Serializer[Any]):
    """One resize of an elastic job: the attempt stopped at an agreed step and the
    attempt it was relaunched as at once, at its new size."""

    attempt_number = serializers.IntegerField(
        source="victim_attempt.number", help_text="The attempt that was stopped."
    )
    relaunched_as = serializers.SerializerMethodField(
        help_text="The number of the attempt the job was relaunched as; null until then."
    )
    from_ranks = serializers.IntegerField(source="victim_attempt.world_size")
    to_ranks = serializers.IntegerField(source="resize_ranks")
    placement = serializers.JSONField(source="resize_placement")
    why = serializers.SerializerMethodField(help_text="Why, in the job page's words.")
    for_job = serializers.IntegerField(
        source="preemptor_id",
        allow_null=True,
        help_text="The waiting job a shrink freed GPUs for; null for a grow.",
    )
    decided_at = serializers.DateTimeField()
    deadline = serializers.DateTimeField()
    signal_sent_at = serializers.DateTimeField(allow_null=True)
    all_exited_at = serializers.DateTimeField(allow_null=True)
    checkpoint_step = serializers.IntegerField(allow_null=True)
    resume_step = serializers.IntegerField(allow_null=True)
    outcome = serializers.CharField()
    lost_gpu_seconds = serializers.FloatField(allow_null=True)
    resumed_at = serializers.DateTimeField(allow_null=True)

    def get_why(self, event: PreemptionEvent) -> str:
        return describe_preemption(event)

    @extend_schema_field(serializers.IntegerField(allow_null=True))
    def get_relaunched_as(self, event: PreemptionEvent) -> int | None:
        if event.victim_attempt.ended_at is None:
            return None
        return int(event.victim_attempt.number) + 1


class JobSerializer(serializers.ModelSerializer[Job]):
    team = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    submitter = serializers.SlugRelatedField(slug_field="username", read_only=True)
    priority_class = serializers.SlugRelatedField(slug_field="name", read_only=True)
    flavor = serializers.SlugRelatedField(slug_field="name", read_only=True)
    ranks = serializers.IntegerField(
        read_only=True, help_text="The size asked for; an elastic job's largest."
    )
    ranks_min = serializers.IntegerField(
        read_only=True,
        allow_null=True,
        help_text="An elastic job's smallest size; null for a fixed-size job.",
    )
    rank_sizes = serializers.ListField(
        child=serializers.IntegerField(),
        read_only=True,
        help_text="The only sizes an elastic job runs at; empty: any from ranks_min to ranks.",
    )
    gpus = serializers.IntegerField(read_only=True)
    env = serializers.DictField(child=serializers.CharField(), read_only=True)
    why_waiting = serializers.SerializerMethodField(
        help_text="Why a waiting job waits, as its page says it; empty otherwise."
    )

    class Meta:
        model = Job
        fields = [
            "id",
            "name",
            "team",
            "submitter",
            "priority_class",
            "flavor",
            "ranks",
            "ranks_min",
            "rank_sizes",
            "gpus_per_rank",
            "gpus",
            "command",
            "image",
            "env",
            "state",
            "submitted_at",
            "admitted_at",
            "running_at",
            "preempting_at",
            "requeued_at",
            "finished_at",
            "cancel_requested_at",
            "waiting_reason",
            "failure_reason",
            "resume_step",
            "checkpoint_dir",
            "max_attempts",
            "retries",
            "retries_used",
            "topology_level",
            "topology_required",
            "protected_until",
            "why_waiting",
        ]
        read_only_fields = fields

    def get_why_waiting(self, job: Job) -> str:
        return why_waiting(job)


class CadenceSerializer(serializers.Serializer[Any]):
    attempt = serializers.IntegerField(help_text="The open attempt's number.")
    mtbp_seconds = serializers.FloatField(
        allow_null=True,
        help_text="The control plane's estimate of the mean seconds between preemptions, "
        "handed to the ranks as QM_PREEMPTION_MTBP_FILE; null before the first estimate.",
    )
    reasons = serializers.ListField(
        child=serializers.CharField(), help_text="Why, the deciding cause first."
    )
    estimated_at = serializers.DateTimeField(allow_null=True)
    interval_seconds = serializers.FloatField(
        allow_null=True,
        help_text="The regular checkpoint interval the trap last reported choosing "
        "(its `cadence` event); null until it reported one.",
    )
    save_cost = serializers.FloatField(
        allow_null=True, help_text="The cost of a checkpoint to training the trap measured."
    )
    trap_mtbp_seconds = serializers.FloatField(
        allow_null=True, help_text="The estimate the trap had read when it chose the interval."
    )
    reported_at = serializers.FloatField(
        allow_null=True, help_text="When the trap reported it (Unix time)."
    )
    stop_under_way = serializers.BooleanField(
        help_text="The open attempt is being stopped now (a preemption or a cancel)."
    )
    stop_attempt = serializers.IntegerField(
        allow_null=True,
        help_text="The attempt of the stop under way or, failing that, of the engine's "
        "preemption of this job within the last hour; null when there is none. The "
        "`reasons` are worded with it.",
    )
    stop_decided_at = serializers.DateTimeField(allow_null=True)
    stop_why = serializers.CharField(help_text="Why it was stopped, as the job page says it.")


class JobDetailSerializer(JobSerializer):
    attempts = AttemptWithRanksSerializer(many=True, read_only=True)
    checkpoint_step = serializers.IntegerField(
        read_only=True,
        allow_null=True,
        help_text="The step of the job's last committed checkpoint, whichever attempt "
        "committed it; null when none did. The job resumes after it (`resume_step`).",
    )
    cadence = serializers.SerializerMethodField(
        help_text="The running job's preemption risk and the checkpoint interval its trap "
        "chose from it; null when no attempt is open."
    )
    command_as_typed = serializers.SerializerMethodField(
        help_text="`command` as its submitter typed it, for reading: words that `qm submit` "
        "joined for `sh` are quoted again the way a person writes them (the same words); "
        "any other command as stored. What runs is `command`."
    )

    resizes = serializers.SerializerMethodField(
        help_text="The job's resizes, oldest first: each an attempt stopped at an agreed "
        "step and relaunched at once at another size."
    )

    class Meta(JobSerializer.Meta):
        fields = [
            *JobSerializer.Meta.fields,
            "checkpoint_step",
            "attempts",
            "resizes",
            "cadence",
            "command_as_typed",
        ]
        read_only_fields = fields

    @extend_schema_field(ResizeSerializer(many=True))
    def get_resizes(self, job: Job) -> list[dict[str, Any]]:
        # From the attempts already loaded with their stops: no query of its own.
        stops = []
        for attempt in sorted(job.attempts.all(), key=lambda attempt: attempt.number):
            event = getattr(attempt, "preemption", None)
            if event is not None and event.reason == PreemptionEvent.Reason.RESIZE:
                # The attempt as loaded, with its job, rather than another query each.
                event.victim_attempt = attempt
                attempt.job = job
                stops.append(event)
        return list(ResizeSerializer(stops, many=True).data)

    def get_command_as_typed(self, job: Job) -> str:
        return command_as_typed(job.command)

    @extend_schema_field(CadenceSerializer(allow_null=True))
    def get_cadence(self, job: Job) -> dict[str, Any] | None:
        cadence = selectors.job_cadence(attempts=list(job.attempts.all()))
        return CadenceSerializer(cadence).data if cadence is not None else None


@dataclass(frozen=True)
class UnknownTeam:
    """A team name no team has: refused by `checked_submission` exactly as a team
    the user may not submit to, so a refusal never tells whether a name exists."""

    slug: str


class SubmitTeamField(NamedRelatedField):
    """The team a job is submitted to. A name no team has becomes `UnknownTeam`
    rather than a 400 of its own (a 403 for an existing team's name would tell
    a researcher which hidden teams exist)."""

    def to_internal_value(self, data: Any) -> Any:
        try:
            return super().to_internal_value(data)
        except serializers.ValidationError:
            if isinstance(data, bool) or not isinstance(data, str | int):
                raise
            return UnknownTeam(slug=str(data)[:100].replace("\x00", ""))


def may_not_submit(slugs: list[str]) -> Exception:
    """The one refusal for teams that are hidden, not allowed or not there at all."""
    names = ", ".join(slugs)
    return deny(f"You may not submit jobs to team{'s' if len(slugs) > 1 else ''} {names}.")


def may_submit(team: Team | UnknownTeam, access: Access) -> bool:
    return isinstance(team, Team) and access.can_submit_to(team.pk)


@extend_schema_field(
    {
        "oneOf": [
            {"type": "integer"},
            {
                "type": "object",
                "properties": {
                    "min": {"type": "integer"},
                    "max": {"type": "integer"},
                    "sizes": {"type": "array", "items": {"type": "integer"}},
                },
            },
        ]
    }
)
class RanksField(serializers.Field):  # type: ignore[type-arg]
    """A job's `ranks` as POST /jobs/ takes it: a whole number, or an elastic job's
    range. Becomes the service's `ranks` (the largest size), `ranks_min` and
    `rank_sizes` in `JobSubmitSerializer.validate`."""

    KEYS = ("min", "max", "sizes")

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, dict):
            return serializers.IntegerField().to_internal_value(data)
        unknown = sorted(str(key) for key in data if key not in self.KEYS)
        if unknown:
            raise serializers.ValidationError(
                f"Unknown key {unknown[0]!r}: an elastic job's ranks take min, max and sizes."
            )
        whole = serializers.IntegerField()
        out: dict[str, Any] = {}
        for key in ("min", "max"):
            if data.get(key) is not None:
                try:
                    out[key] = whole.to_internal_value(data[key])
                except serializers.ValidationError:
                    raise serializers.ValidationError(
                        f"{key} must be a whole number (got {data[key]!r})."
                    ) from None
        sizes = data.get("sizes")
        if sizes is not None:
            if not isinstance(sizes, list) or not sizes:
                raise serializers.ValidationError("sizes must be a list of whole numbers.")
            try:
                out["sizes"] = [whole.to_internal_value(size) for size in sizes]
            except serializers.ValidationError:
                raise serializers.ValidationError(
                    f"sizes must be whole numbers (got {sizes!r})."
                ) from None
        if "sizes" in out:
            out.setdefault("min", min(out["sizes"]))
            out.setdefault("max", max(out["sizes"]))
        if "min" not in out or "max" not in out:
            raise serializers.ValidationError(
                'An elastic job gives both min and max (or sizes): {"min": 2, "max": 8}.'
            )
        return out

    def to_representation(self, value: Any) -> Any:
        return value


class JobSubmitSerializer(serializers.Serializer[Any]):
    name = serializers.CharField(required=False, allow_blank=True, default="")
    team = SubmitTeamField(slug_field="slug", queryset=Team.objects.all())
    flavor = NamedRelatedField(
        slug_field="name", queryset=ResourceFlavor.objects.all(), list_valid=True
    )
    priority_class = NamedRelatedField(
        slug_field="name",
        queryset=PriorityClass.objects.all(),
        required=False,
        allow_null=True,
        help_text=(
            "One of the classes the team may use (GET /teams/{id}/priority-classes/); "
            "left out: the team's default class."
        ),
    )
    # Ranges, sizes and formats are the service's rules, with its messages (the
    # drill and the demo seed submit through it too); only types are checked here.
    ranks = RanksField(
        help_text=(
            "A whole number for a fixed size, or an elastic job's range as "
            '{"min": 2, "max": 8}, optionally with "sizes": [2, 4, 8], the only sizes it '
            "may run at (min and max then default to the smallest and largest). The "
            "scheduler starts it at the largest size that fits."
        )
    )
    gpus_per_rank = serializers.IntegerField()
    command = serializers.CharField(
        trim_whitespace=False, help_text="Run by /bin/sh -c on every rank."
    )
    image = serializers.CharField(
        required=False,
        allow_blank=True,
        default="",
        help_text="An OCI image reference, e.g. registry.example.org/team/trainer:1.4.",
    )
    env = serializers.DictField(
        child=serializers.CharField(allow_blank=True, trim_whitespace=False),
        required=False,
        default=dict,
        help_text="Portable names ([A-Za-z_][A-Za-z0-9_]*); QM_* and the rendezvous names are the runtime's.",
    )
    max_attempts = serializers.IntegerField(
        min_value=1, max_value=services.MAX_ATTEMPTS, required=False, allow_null=True
    )
    retries = serializers.IntegerField(
        required=False,
        default=0,
        help_text=(
            f"How often to run the job again when it fails on its own (a rank exits "
            f"non-zero unasked), 0 to {services.MAX_RETRIES}. Preemptions and lost "
            f"ranks always requeue and use none."
        ),
    )
    topology_level = serializers.CharField(
        required=False,
        allow_blank=True,
        default="",
        max_length=63,
        help_text="All ranks inside one domain of this topology level (e.g. rack); "
        "empty: anywhere.",
    )
    topology_required = serializers.BooleanField(
        required=False,
        default=True,
        help_text="False: only prefer one domain, and fall back to any nodes.",
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """An elastic job's range as the service's keywords: its largest size as
        `ranks`, with `ranks_min` and `rank_sizes`."""
        ranks = attrs.get("ranks")
        if isinstance(ranks, dict):
            attrs["ranks"] = ranks["max"]
            attrs["ranks_min"] = ranks["min"]
            attrs["rank_sizes"] = ranks.get("sizes")
        return attrs


def checked_submission(payload: Any, *, access: Access) -> dict[str, Any]:
    """One job as POST /jobs/ takes it, checked for its types and names and for
    whether the user may submit to its team: the keywords of `services.job_submit`,
    which checks the rest. The API and the portal's job form both submit through
    here, so a refusal reads the same in both.

    Raises DRF's ValidationError (400, by field) or PermissionDenied (403)."""
    incoming = JobSubmitSerializer(data=payload)
    incoming.is_valid(raise_exception=True)
    values = dict(incoming.validated_data)
    team: Team | UnknownTeam = values["team"]
    if not may_submit(team, access):
        raise may_not_submit([team.slug])
    return values


class JobBatchSerializer(serializers.Serializer[Any]):
    jobs = JobSubmitSerializer(
        many=True,
        allow_empty=False,
        max_length=services.MAX_BATCH,
        help_text=f"1 to {services.MAX_BATCH} jobs, each as POST /jobs/ takes it.",
    )


class JobTopologySerializer(serializers.Serializer[Any]):
    topology_level = serializers.CharField(allow_blank=True, max_length=63)
    topology_required = serializers.BooleanField(default=True)


class JobLogSerializer(serializers.Serializer[Any]):
    job = serializers.IntegerField()
    attempt = serializers.IntegerField()
    rank = serializers.IntegerField()
    offset = serializers.IntegerField(help_text="Where this chunk starts in the rank's log.")
    next_offset = serializers.IntegerField(help_text="Pass as `offset` to read on (follow).")
    text = serializers.CharField(help_text="The chunk, decoded as UTF-8 (bad bytes replaced).")
    finished = serializers.BooleanField(
        help_text="The attempt has ended: nothing more will be written."
    )


class JobLogQuerySerializer(serializers.Serializer[Any]):
    rank = serializers.IntegerField(min_value=0, max_value=1_000_000, default=0)
    attempt = serializers.IntegerField(min_value=1, max_value=1_000_000, required=False)
    offset = serializers.IntegerField(min_value=0, max_value=MAX_OFFSET, required=False)
    limit = serializers.IntegerField(min_value=1, max_value=MAX_LOG_CHUNK, default=65536)
    tail = serializers.IntegerField(
        min_value=1,
        max_value=MAX_LOG_CHUNK,
        required=False,
        help_text="Answer the last `tail` bytes instead (ignored when `offset` is given).",
    )


class TrapEventSerializer(serializers.Serializer[Any]):
    """The trap's event, as documented in ARCHITECTURE.md (other keys are dropped)."""

    event = serializers.ChoiceField(choices=list(EVENT_NAMES))
    job_id = serializers.IntegerField(required=False)
    attempt = serializers.IntegerField(min_value=0)
    rank = serializers.IntegerField(min_value=0)
    at = serializers.FloatField(help_text="Unix time taken where it happened.")
    step = serializers.IntegerField(required=False, allow_null=True)
    bytes = serializers.IntegerField(required=False, allow_null=True)
    seconds = serializers.FloatField(required=False, allow_null=True)
    code = serializers.IntegerField(required=False, allow_null=True)
    reason = serializers.CharField(required=False, allow_blank=True)


class NoticeAnswerSerializer(serializers.Serializer[Any]):
    attempt = serializers.IntegerField(help_text="The attempt the token belongs to.")
    notice = serializers.BooleanField(help_text="Whether a checkpoint notice was sent.")
    sent_at = serializers.DateTimeField(allow_null=True)
    deadline = serializers.DateTimeField(
        allow_null=True, help_text="When the eviction follows if no rank has committed."
    )


class TrapEventAcceptedSerializer(serializers.Serializer[Any]):
    accepted = serializers.IntegerField(help_text="Events stored now.")
    duplicates = serializers.IntegerField(help_text="Events already known, ignored.")


class PreemptionEventSerializer(serializers.ModelSerializer[PreemptionEvent]):
    attempt_number = serializers.IntegerField(source="victim_attempt.number", read_only=True)
    team = serializers.CharField(source="job.team.slug", read_only=True)
    preemptor_team = serializers.SerializerMethodField()
    why = serializers.SerializerMethodField(
        help_text="Why the job was preempted, in the job page's words."
    )

    class Meta:
        model = PreemptionEvent
        fields = [
            "id",
            "job",
            "team",
            "victim_attempt",
            "attempt_number",
            "preemptor",
            "preemptor_team",
            "cause",
            "reason",
            "why",
            "decided_at",
            "grace_seconds",
            "deadline",
            "notice_deadline",
            "notice_sent_at",
            "notice_committed_at",
            "signal_sent_at",
            "killed_at",
            "all_exited_at",
            "checkpoint_step",
            "checkpoint_bytes",
            "checkpoint_seconds",
            "outcome",
            "lost_gpu_seconds",
            "requeued_at",
            "resume_step",
            "resumed_at",
        ]
        read_only_fields = fields

    def get_preemptor_team(self, event: PreemptionEvent) -> str | None:
        return event.preemptor.team.slug if event.preemptor is not None else None

    def get_why(self, event: PreemptionEvent) -> str:
        return describe_preemption(event)


class CheckpointSerializer(serializers.ModelSerializer[Checkpoint]):
    attempt_number = serializers.SerializerMethodField()

    class Meta:
        model = Checkpoint
        fields = [
            "id",
            "job",
            "attempt",
            "attempt_number",
            "step",
            "path",
            "bytes",
            "seconds",
            "committed_at",
        ]
        read_only_fields = fields

    def get_attempt_number(self, checkpoint: Checkpoint) -> int | None:
        return checkpoint.attempt.number if checkpoint.attempt is not None else None


class WebhookSerializer(serializers.ModelSerializer[Webhook]):
    team = NamedRelatedField(slug_field="slug", queryset=Team.objects.all())
    events = serializers.ListField(
        child=serializers.ChoiceField(choices=list(Webhook.EVENTS)),
        required=False,
        default=list,
        help_text="Notices to send; empty means all of them.",
    )
    secret = serializers.CharField(
        max_length=64,
        required=False,
        allow_blank=True,
        default="",
        write_only=True,
        help_text=(
            "Signs each post: X-Quartermaster-Signature: t=<unix time>,v1=<hex HMAC-SHA256 of "
            '"<t>.<body>">; refuse posts whose t is over 5 minutes from your clock.'
        ),
    )
    has_secret = serializers.SerializerMethodField()

    class Meta:
        model = Webhook
        fields = ["id", "team", "url", "events", "secret", "has_secret", "active", "created_at"]
        read_only_fields = ["id", "has_secret", "active", "created_at"]

    def get_has_secret(self, webhook: Webhook) -> bool:
        return bool(webhook.secret)
