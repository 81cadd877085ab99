"""REST API of jobs and their history: submit, list, cancel, per-rank logs, the
trap's events endpoint, attempts, ranks, preemptions, checkpoints and team
webhooks.

Reads go through preemption.selectors, so a job of a team the user cannot
read answers 404 whatever the endpoint; writes go through the services. The
serializers live in portal.rest.preemption_serializers; this module holds the
trap's token authentication, the filters and the viewsets.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import django_filters
from django import forms
from django.contrib.auth.models import AnonymousUser
from django.db.models import Prefetch
from django_filters.fields import IsoDateTimeField
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.authentication import BaseAuthentication
from rest_framework.decorators import action
from rest_framework.exceptions import AuthenticationFailed, NotFound, ValidationError
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response

from core.api import Pagination, deny, responses
from portal.rest.access import access_of
from portal.rest.preemption_serializers import (
    MAX_EVENTS_PER_POST,
    MAX_ID,
    AttemptSerializer,
    CheckpointSerializer,
    JobBatchSerializer,
    JobDetailSerializer,
    JobLogQuerySerializer,
    JobLogSerializer,
    JobSerializer,
    JobSubmitSerializer,
    JobTopologySerializer,
    NoticeAnswerSerializer,
    PreemptionEventSerializer,
    RankSerializer,
    TrapEventAcceptedSerializer,
    TrapEventSerializer,
    WebhookSerializer,
    checked_submission,
    may_not_submit,
    may_submit,
)
from preemption import selectors, services
from preemption.event_tokens import attempt_for_token
from preemption.ingest import EventLimitReached, IngestBusy, ingest_trap_events
from preemption.log_tail import read_rank_log_tail
from preemption.logs import read_rank_log
from preemption.models import (
    FINAL_STATES,
    Attempt,
    Checkpoint,
    Job,
    JobState,
    PreemptionEvent,
    Rank,
    Webhook,
)
from preemption.notice import NoticeAnswer, notice_answer
from preemption.runtimes.base import RuntimePermanentError
from preemption.webhooks import webhook_create, webhook_delete
from quotas.models import Team


def _job_by_id(pk: Any) -> Job | None:
    if not isinstance(pk, str) or not pk.isdigit() or int(pk) > MAX_ID:
        return None
    return Job.objects.filter(pk=int(pk)).first()


class JobEventsTokenAuthentication(BaseAuthentication):
    """The trap's credentials: `Authorization: Bearer <QM_EVENTS_TOKEN>`, the token
    of one attempt of one job, valid only on that job's events endpoint and only
    while that attempt is open. Authenticates no user: `request.auth` is the
    attempt, or for a GET (the trap's poll for a checkpoint notice, asked twice a
    second) the notice answer, which is found without reading the job's attempts
    (preemption.notice)."""

    def authenticate(self, request: Request) -> tuple[AnonymousUser, Attempt | NoticeAnswer] | None:
        header = request.META.get("HTTP_AUTHORIZATION", "").split()
        if len(header) != 2 or header[0].lower() != "bearer":
            return None
        pk = (request.parser_context or {}).get("kwargs", {}).get("pk")
        if request.method == "GET":
            if not isinstance(pk, str) or not pk.isdigit() or int(pk) > MAX_ID:
                return None
            answer = notice_answer(job_id=int(pk), token=header[1])
            return None if answer is None else (AnonymousUser(), answer)
        job = _job_by_id(pk)
        if job is None:
            return None
        attempt = attempt_for_token(job, header[1])
        if attempt is None:
            return None
        if attempt.ended_at is not None:
            raise AuthenticationFailed(
                f"This events token belongs to attempt {attempt.number} of job {job.pk}, "
                "which has ended; a token expires with its attempt."
            )
        attempt.job = job
        return AnonymousUser(), attempt


class JobEventsTokenScheme(OpenApiAuthenticationExtension):  # type: ignore[no-untyped-call]
    """Describes the trap's per-job token in the OpenAPI schema."""

    target_class = "portal.rest.preemption.JobEventsTokenAuthentication"
    name = "jobEventsToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": (
                "The attempt's own QM_EVENTS_TOKEN, valid only on that job's events endpoint "
                "while the attempt is open."
            ),
        }


# --- viewsets ------------------------------------------------------------------


class _Base(viewsets.GenericViewSet[Any]):
    pagination_class = Pagination
    lookup_value_regex = r"[0-9]+"
    permission_classes = [IsAuthenticated]


class UtcDateTimeField(IsoDateTimeField):
    """An ISO 8601 moment, converted to UTC here: PostgreSQL refuses offsets beyond
    ±15:59, and a moment near year 1 may not exist in UTC at all."""

    def to_python(self, value: Any) -> datetime | None:
        moment = super().to_python(value)
        if moment is None or moment.tzinfo is None:
            return moment
        try:
            return moment.astimezone(UTC)
        except OverflowError:
            raise forms.ValidationError("This moment is out of range.", code="invalid") from None


class UtcDateTimeFilter(django_filters.IsoDateTimeFilter):
    field_class = UtcDateTimeField


class JobFilter(django_filters.FilterSet):
    team = django_filters.CharFilter(field_name="team__slug", help_text="Team slug.")
    state = django_filters.ChoiceFilter(choices=JobState.choices)
    submitter = django_filters.CharFilter(field_name="submitter__username", help_text="Username.")
    flavor = django_filters.CharFilter(field_name="flavor__name", help_text="Flavor name.")
    since = UtcDateTimeFilter(
        field_name="submitted_at", lookup_expr="gte", help_text="Submitted at or after (ISO 8601)."
    )
    until = UtcDateTimeFilter(
        field_name="submitted_at", lookup_expr="lt", help_text="Submitted before (ISO 8601)."
    )

    class Meta:
        model = Job
        fields = ["team", "state", "submitter", "flavor", "since", "until"]


def _batch_errors(errors: Any) -> Any:
    """A batch's field errors with each refused job named by its place in the batch;
    DRF and the service list every job, the accepted ones as empty objects."""
    jobs = errors.get("jobs") if isinstance(errors, dict) else None
    if isinstance(jobs, list) and jobs and all(isinstance(e, dict) for e in jobs):
        return {**errors, "jobs": {str(i): e for i, e in enumerate(jobs) if e}}
    return errors


@extend_schema_view(
    list=extend_schema(
        summary="Jobs you can see", responses=responses(JobSerializer(many=True), 400, 401)
    ),
    retrieve=extend_schema(
        summary="One job with its attempts and ranks",
        responses=responses(JobDetailSerializer, 401, 404),
    ),
)
class JobViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, _Base):
    filterset_class = JobFilter

    def get_queryset(self) -> Any:
        queryset = selectors.job_list(user=self.request.user)
        if self.action == "retrieve":
            queryset = selectors.jobs_with_checkpoint_step(queryset).prefetch_related(
                Prefetch(
                    "attempts",
                    queryset=selectors.with_checkpoint_step(
                        Attempt.objects.select_related(
                            "preemption__job",
                            "preemption__preemptor__team",
                            "preemption__preemptor__priority_class",
                        )
                    ).prefetch_related("rank_set"),
                )
            )
        return queryset

    def get_serializer_class(self) -> Any:
        return JobDetailSerializer if self.action == "retrieve" else JobSerializer

    def get_permissions(self) -> list[permissions.BasePermission]:
        if self.action == "events":
            return [permissions.AllowAny()]
        return [IsAuthenticated()]

    @extend_schema(
        summary="Submit a job",
        description="To a leaf team you belong to (or manage from above).",
        request=JobSubmitSerializer,
        responses=responses(JobSerializer, 400, 401, 403, status_code=201),
    )
    def create(self, request: Request) -> Response:
        access = access_of(request)
        values = checked_submission(request.data, access=access)
        job = services.job_submit(submitter=request.user, tree=access.tree, **values)
        return Response(JobSerializer(job).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        summary="Submit many jobs at once",
        description=(
            "A sweep or a job array, queued whole or not at all: every job is checked as "
            "POST /jobs/ checks one, and one refused job refuses the batch. A 400 names "
            "each refused job by its place in `jobs` (from 0) with its fields and reasons; "
            "a 403 names the teams you may not submit to. The answer lists the queued "
            "jobs in the order given."
        ),
        request=JobBatchSerializer,
        responses=responses(JobSerializer(many=True), 400, 401, 403, status_code=201),
    )
    @action(
        detail=False, methods=["post"], url_path="batch", filter_backends=[], pagination_class=None
    )
    def batch(self, request: Request) -> Response:
        incoming = JobBatchSerializer(data=request.data, context={"named_rows": {}})
        if not incoming.is_valid():
            raise ValidationError(_batch_errors(incoming.errors))
        items = [dict(item) for item in incoming.validated_data["jobs"]]
        access = access_of(request)
        refused = sorted({i["team"].slug for i in items if not may_submit(i["team"], access)})
        if refused:
            raise may_not_submit(refused)
        try:
            jobs = services.job_submit_many(
                submitter=request.user,
                requests=[services.JobRequest(**item) for item in items],
                tree=access.tree,
            )
        except services.BatchValidationError as error:
            raise ValidationError(_batch_errors({"jobs": error.per_request})) from None
        return Response(JobSerializer(jobs, many=True).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        summary="Cancel a job",
        description="A waiting job is cancelled at once; a running one is stopped gracefully.",
        request=None,
        responses=responses(JobSerializer, 400, 401, 403, 404, status_code=202),
    )
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        job = self.get_object()
        if not access_of(request).can_cancel(team_id=job.team_id, submitter_id=job.submitter_id):
            raise deny("Only the submitter, a manager of the team or an admin may cancel this job.")
        job = services.job_cancel(actor=request.user, job=job)
        return Response(JobSerializer(job).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(
        summary="Change a waiting job's topology",
        description="Where its ranks must sit (or, with topology_required false, should).",
        request=JobTopologySerializer,
        responses=responses(JobSerializer, 400, 401, 403, 404),
    )
    @action(detail=True, methods=["post"])
    def topology(self, request: Request, pk: str | None = None) -> Response:
        job = self.get_object()
        if not access_of(request).can_cancel(team_id=job.team_id, submitter_id=job.submitter_id):
            raise deny("Only the submitter, a manager of the team or an admin may change this job.")
        incoming = JobTopologySerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        job = services.job_topology_set(
            actor=request.user,
            job=job,
            level=incoming.validated_data["topology_level"],
            required=incoming.validated_data["topology_required"],
        )
        return Response(JobSerializer(job).data)

    @extend_schema(
        summary="Read a rank's log",
        description=(
            "A chunk of one rank's log. To follow it, call again with `offset` = `next_offset` "
            "until `finished` is true and the chunk is empty."
        ),
        parameters=[JobLogQuerySerializer],
        responses=responses(JobLogSerializer, 400, 401, 404),
    )
    @action(detail=True, methods=["get"], filter_backends=[], pagination_class=None)
    def logs(self, request: Request, pk: str | None = None) -> Response:

        job = self.get_object()
        query = JobLogQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        values = query.validated_data
        attempts = Attempt.objects.filter(job=job)
        if "attempt" in values:
            attempt = attempts.filter(number=values["attempt"]).first()
            if attempt is None:
                raise NotFound({"attempt": [f"Job {job.pk} has no attempt {values['attempt']}."]})
        else:
            attempt = attempts.order_by("-number").first()
            if attempt is None:
                raise NotFound(
                    {"attempt": [f"Job {job.pk} has not started yet, so it has no logs."]}
                )
        rank = values["rank"]
        size = attempt.world_size
        if rank >= size:
            raise NotFound({"rank": [f"Job {job.pk} has ranks 0 to {size - 1} (got {rank})."]})
        offset = values.get("offset")
        try:
            if offset is None and "tail" in values:
                chunk, next_offset, offset = self._tail(job, attempt.number, rank, values["tail"])
            else:
                offset = offset or 0
                chunk, next_offset = read_rank_log(
                    job=job, attempt=attempt.number, rank=rank, offset=offset, limit=values["limit"]
                )
        except RuntimePermanentError:
            # The rank has not been launched on this runtime yet: its log is empty so far.
            offset = offset or 0
            chunk, next_offset = b"", offset
        finished = attempt.ended_at is not None or job.state in FINAL_STATES
        return Response(
            {
                "job": job.pk,
                "attempt": attempt.number,
                "rank": rank,
                "offset": offset,
                "next_offset": next_offset,
                "text": chunk.decode("utf-8", errors="replace"),
                "finished": finished,
            }
        )

    @staticmethod
    def _tail(job: Job, attempt: int, rank: int, size: int) -> tuple[bytes, int, int]:
        """The last `size` bytes of the log, read from its end (never the whole log)."""
        chunk, first_byte = read_rank_log_tail(job=job, attempt=attempt, rank=rank, max_bytes=size)
        return chunk, first_byte + len(chunk), first_byte

    @extend_schema(
        methods=["POST"],
        summary="Report a trap event (called by the trap inside the job)",
        description=(
            "Authenticated by `Authorization: Bearer <QM_EVENTS_TOKEN>`, the open attempt's own "
            "token, not a user's. Takes one event or a list of them, all or nothing; events "
            "already known are ignored. A refused event changes nothing and the answer says why."
        ),
        request=TrapEventSerializer,
        responses=responses(TrapEventAcceptedSerializer, 400, 403, 429, 503, status_code=202),
        auth=[{"jobEventsToken": []}],
    )
    @extend_schema(
        methods=["GET"],
        summary="Ask for a checkpoint notice (called by the trap inside the job)",
        description=(
            "Authenticated by the open attempt's own `QM_EVENTS_TOKEN`. Says whether the "
            "control plane sent this attempt's ranks a checkpoint notice. A token of another "
            "attempt or job, an ended attempt's or none at all gets 403 and learns nothing."
        ),
        request=None,
        responses=responses(NoticeAnswerSerializer, 403),
        auth=[{"jobEventsToken": []}],
    )
    @action(
        detail=True,
        methods=["get", "post"],
        authentication_classes=[JobEventsTokenAuthentication],
        # The trap polls twice a second from every rank, and a node's ranks share
        # an address: events have their own per-rank limit (QM_TRAP_EVENTS_PER_RANK).
        throttle_classes=[],
        filter_backends=[],
        pagination_class=None,
    )
    def events(self, request: Request, pk: str | None = None) -> Response:
        if request.method == "GET":
            if not isinstance(request.auth, NoticeAnswer):
                raise deny(
                    "This endpoint needs the open attempt's events token "
                    "(Authorization: Bearer <QM_EVENTS_TOKEN>)."
                )
            return Response(NoticeAnswerSerializer(request.auth).data)
        if not isinstance(request.auth, Attempt):
            # The same answer whether or not job `pk` exists: without the job's
            # own token nothing is told about it.
            raise deny(
                "This endpoint needs the open attempt's events token "
                "(Authorization: Bearer <QM_EVENTS_TOKEN>)."
            )
        body = request.data
        events = body if isinstance(body, list) else [body]
        if not events or len(events) > MAX_EVENTS_PER_POST:
            raise serializers.ValidationError(
                {"event": [f"Send one event or a list of 1 to {MAX_EVENTS_PER_POST} events."]}
            )
        for event in events:
            if not _storable(event):
                raise serializers.ValidationError(
                    {"event": ["Text in an event must not contain NUL bytes or lone surrogates."]}
                )
        try:
            accepted, duplicates = ingest_trap_events(
                attempt=request.auth, events=events, source="post"
            )
        except EventLimitReached as exc:
            return Response({"event": [str(exc)]}, status=status.HTTP_429_TOO_MANY_REQUESTS)
        except IngestBusy as exc:
            return Response(
                {"detail": str(exc)},
                status=status.HTTP_503_SERVICE_UNAVAILABLE,
                headers={"Retry-After": "1"},
            )
        return Response(
            {"accepted": accepted, "duplicates": duplicates}, status=status.HTTP_202_ACCEPTED
        )


class IdFilter(django_filters.NumberFilter):
    """A row id: a whole number in the database's range, so a huge one is a 400, not a crash."""

    field_class = forms.IntegerField

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("min_value", 1)
        kwargs.setdefault("max_value", MAX_ID)
        super().__init__(*args, **kwargs)


def _storable(value: Any, depth: int = 0) -> bool:
    """Whether JSON can be stored as is: the database refuses NUL bytes and
    lone surrogates in text, and nesting this deep is never a real event."""
    if depth > 20:
        return False
    if isinstance(value, str):
        return "\x00" not in value and not any("\ud800" <= char <= "\udfff" for char in value)
    if isinstance(value, dict):
        return all(_storable(k, depth + 1) and _storable(v, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return all(_storable(item, depth + 1) for item in value)
    return True


class ByJobFilter(django_filters.FilterSet):
    job = IdFilter(field_name="job_id", help_text="Job id.")


class AttemptFilter(ByJobFilter):
    class Meta:
        model = Attempt
        fields = ["job"]


class RankFilter(django_filters.FilterSet):
    job = IdFilter(field_name="attempt__job_id", help_text="Job id.")
    attempt = IdFilter(field_name="attempt_id", help_text="Attempt id.")

    class Meta:
        model = Rank
        fields = ["job", "attempt"]


class PreemptionEventFilter(ByJobFilter):
    reason = django_filters.ChoiceFilter(choices=PreemptionEvent.Reason.choices)
    outcome = django_filters.ChoiceFilter(choices=PreemptionEvent.Outcome.choices)

    class Meta:
        model = PreemptionEvent
        fields = ["job", "reason", "outcome"]


class CheckpointFilter(ByJobFilter):
    class Meta:
        model = Checkpoint
        fields = ["job"]


def _read_only(name: str, serializer: Any) -> Any:
    return extend_schema_view(
        list=extend_schema(
            summary=f"{name} you can see", responses=responses(serializer(many=True), 400, 401)
        ),
        retrieve=extend_schema(
            summary=f"One of the {name.lower()}", responses=responses(serializer, 401, 404)
        ),
    )


@_read_only("Attempts", AttemptSerializer)
class AttemptViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, _Base):
    serializer_class = AttemptSerializer
    filterset_class = AttemptFilter

    def get_queryset(self) -> Any:
        return selectors.with_checkpoint_step(selectors.attempt_list(user=self.request.user))


@_read_only("Ranks", RankSerializer)
class RankViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, _Base):
    serializer_class = RankSerializer
    filterset_class = RankFilter

    def get_queryset(self) -> Any:
        return selectors.rank_list(user=self.request.user)


@_read_only("Preemption events", PreemptionEventSerializer)
class PreemptionEventViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, _Base):
    serializer_class = PreemptionEventSerializer
    filterset_class = PreemptionEventFilter

    def get_queryset(self) -> Any:
        return selectors.preemption_event_list(user=self.request.user)


@_read_only("Checkpoints", CheckpointSerializer)
class CheckpointViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, _Base):
    serializer_class = CheckpointSerializer
    filterset_class = CheckpointFilter

    def get_queryset(self) -> Any:
        return selectors.checkpoint_list(user=self.request.user)


@extend_schema_view(
    list=extend_schema(
        summary="Webhooks of the teams you manage",
        responses=responses(WebhookSerializer(many=True), 401),
    ),
    retrieve=extend_schema(summary="One webhook", responses=responses(WebhookSerializer, 401, 404)),
    create=extend_schema(
        summary="Register a team webhook (managers of the team or above, admins)",
        responses=responses(WebhookSerializer, 400, 401, 403, status_code=201),
    ),
    destroy=extend_schema(
        summary="Remove a team webhook", responses=responses(None, 401, 403, 404, status_code=204)
    ),
)
class WebhookViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.DestroyModelMixin,
    _Base,
):
    serializer_class = WebhookSerializer

    def get_queryset(self) -> Any:
        return selectors.webhook_list(user=self.request.user)

    def perform_create(self, serializer: Any) -> None:
        values = serializer.validated_data
        team: Team = values["team"]
        if not access_of(self.request).can_manage_team(team.pk):
            raise deny(
                f"Only a manager of {team.slug} (or above it) or an admin may add its webhooks."
            )
        serializer.instance = webhook_create(
            actor=self.request.user,
            team=team,
            url=values["url"],
            events=values["events"],
            secret=values["secret"],
        )

    def perform_destroy(self, instance: Webhook) -> None:
        webhook_delete(actor=self.request.user, webhook=instance)
