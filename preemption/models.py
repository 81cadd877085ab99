"""Jobs (gangs), their attempts and ranks, preemptions and checkpoints."""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from urllib.parse import urlsplit

from django.conf import settings
from django.db import models
from django.db.models import F, Max, OuterRef, Q, Subquery
from django.db.models.functions import Coalesce

from quotas.models import PriorityClass, ResourceFlavor, Team


class JobState(models.TextChoices):
    PENDING = "pending", "Pending"
    ADMITTED = "admitted", "Admitted"
    RUNNING = "running", "Running"
    PREEMPTING = "preempting", "Preempting"
    REQUEUED = "requeued", "Requeued"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


FINAL_STATES = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)
ACTIVE_STATES = (JobState.ADMITTED, JobState.RUNNING, JobState.PREEMPTING)
WAITING_STATES = (JobState.PENDING, JobState.REQUEUED)


class Job(models.Model):
    """A gang: `ranks` processes of `gpus_per_rank` GPUs each, admitted and
    preempted as one. Every admission is an Attempt; the checkpoint folder is
    the same for all of them, so a requeued job resumes where it stopped.

    An elastic job may also run at fewer ranks: at any size from `ranks_min` to
    `ranks`, or only at the sizes `rank_sizes` lists. Each attempt runs at one
    size (`Attempt.ranks`), which the scheduler picks; `ranks` is the largest
    asked for. A fixed-size job has no `ranks_min` and no `rank_sizes`."""

    name = models.CharField(max_length=120, blank=True)
    # No index of their own: the (team, state) and (submitter, state) indexes below
    # start with them (see Meta).
    team = models.ForeignKey(Team, on_delete=models.PROTECT, related_name="jobs", db_index=False)
    submitter = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs", db_index=False
    )
    priority_class = models.ForeignKey(PriorityClass, on_delete=models.PROTECT, related_name="jobs")
    flavor = models.ForeignKey(ResourceFlavor, on_delete=models.PROTECT, related_name="jobs")
    ranks = models.PositiveIntegerField()
    ranks_min = models.PositiveIntegerField(null=True, blank=True)
    # The only sizes an elastic job runs at, ascending, from ranks_min to ranks;
    # empty: every size in between.
    rank_sizes = models.JSONField(default=list, blank=True)
    gpus_per_rank = models.PositiveIntegerField()
    command = models.TextField()
    image = models.CharField(max_length=300, blank=True)
    env = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=16, choices=JobState.choices, default=JobState.PENDING)
    submitted_at = models.DateTimeField(auto_now_add=True, db_index=True)
    admitted_at = models.DateTimeField(null=True, blank=True)
    running_at = models.DateTimeField(null=True, blank=True)
    preempting_at = models.DateTimeField(null=True, blank=True)
    requeued_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True, db_index=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    waiting_reason = models.CharField(max_length=300, blank=True)
    # Set while the job's only possible victims are protected by their minimum
    # runtime: when the last of them may go (the engine's Waiting.protected_until).
    protected_until = models.DateTimeField(null=True, blank=True)
    failure_reason = models.CharField(max_length=300, blank=True)
    resume_step = models.PositiveIntegerField(null=True, blank=True)
    # All ranks inside one domain of this topology level (a key of QM_TOPOLOGY_LABELS,
    # "rack" say); empty: anywhere. Only preferred when ``topology_required`` is False.
    topology_level = models.CharField(max_length=63, blank=True)
    topology_required = models.BooleanField(default=True)
    checkpoint_dir = models.CharField(max_length=500, blank=True)
    max_attempts = models.PositiveIntegerField(default=5)
    # How often a job that fails on its own (a rank exits non-zero unasked) is
    # run again, as its submitter asked, and how many of those it has used.
    # Preemptions, lost ranks and the portal's own stops never use one.
    retries = models.PositiveSmallIntegerField(default=0)
    retries_used = models.PositiveSmallIntegerField(default=0)
    not_before = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-submitted_at", "-id"]
        # Every cycle rewrites the waiting reasons of the jobs whose reason changed (all
        # of them on the first cycle after a restart), so each index here is written
        # again for every such row that cannot be updated in place: a job's row has
        # only the indexes its reads need. `state` is a plain index (a db_index would
        # add a second one for LIKE, which no query uses), and the team and submitter
        # are reached through the indexes that start with them. On PostgreSQL the table
        # also leaves room in its pages (migration 0020) for those updates to stay in
        # place.
        indexes = [
            models.Index(fields=["state"], name="preemption_job_state"),
            models.Index(fields=["team", "state"]),
            models.Index(fields=["submitter", "state"]),
        ]
        constraints = [
            models.CheckConstraint(condition=Q(ranks__gte=1), name="job_ranks_positive"),
            models.CheckConstraint(
                condition=Q(ranks_min__isnull=True)
                | Q(ranks_min__gte=1, ranks_min__lt=models.F("ranks")),
                name="job_ranks_min_below_ranks",
            ),
            models.CheckConstraint(
                condition=Q(gpus_per_rank__gte=1), name="job_gpus_per_rank_positive"
            ),
            models.CheckConstraint(
                condition=Q(state__in=[choice.value for choice in JobState]), name="job_state_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.pk} {self.name}".strip()

    @property
    def gpus(self) -> int:
        return self.ranks * self.gpus_per_rank

    @property
    def elastic(self) -> bool:
        return self.ranks_min is not None

    def allowed_sizes(self) -> tuple[int, ...]:
        """Every size the job may run at, ascending; `(ranks,)` for a fixed-size job."""
        return allowed_sizes(self.ranks, self.ranks_min, self.rank_sizes)


def allowed_sizes(ranks: int, ranks_min: int | None, rank_sizes: list[int]) -> tuple[int, ...]:
    """The sizes a job of these fields may run at, ascending (see `Job`)."""
    if ranks_min is None:
        return (ranks,)
    if rank_sizes:
        return tuple(rank_sizes)
    return tuple(range(ranks_min, ranks + 1))


def new_events_key() -> str:
    """The random part of an attempt's trap events token, drawn when the attempt is created."""
    return secrets.token_hex(16)


class Attempt(models.Model):
    """One admission of a job: where its ranks were placed, how many of its GPUs
    were borrowed, and why it ended."""

    class EndReason(models.TextChoices):
        SUCCEEDED = "succeeded", "Succeeded"
        FAILED = "failed", "Failed"
        PREEMPTED = "preempted", "Preempted"
        CANCELLED = "cancelled", "Cancelled"
        GANG_GUARD = "gang-guard", "A rank died; the gang was stopped"
        # Stopped at an agreed step and relaunched at once at another size as the
        # job's next attempt (see PreemptionEvent.resize_ranks).
        RESIZED = "resized", "Resized"

    class Action(models.TextChoices):
        NONE = "", "None"
        LAUNCH = "launch", "Launch"
        NOTICE = "notice", "Checkpoint notice"
        SIGNAL = "signal", "Signal"
        KILL = "kill", "Kill"
        FORGET = "forget", "Forget"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField()
    placement = models.JSONField(default=list)
    # The gang's size in this attempt, its WORLD_SIZE: the job's `ranks`, or for an
    # elastic job the size the scheduler admitted it at. Set at admission; see
    # `world_size` for rows written without it.
    ranks = models.PositiveIntegerField(null=True, blank=True)
    borrowed_gpus = models.PositiveIntegerField(default=0)
    master_port = models.PositiveIntegerField(null=True, blank=True)
    admitted_at = models.DateTimeField()
    launched_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    end_reason = models.CharField(max_length=16, choices=EndReason.choices, blank=True)
    orphaned_ports = models.JSONField(default=list, blank=True)
    # The random part of the attempt's trap events token (see preemption.event_tokens);
    # the token itself is never stored.
    events_key = models.CharField(max_length=64, default=new_events_key, editable=False)
    # The runtime action the reconciler decided on and has not yet carried out.
    # It is recorded in the short transaction that decides it and carried out
    # after that commits; a worker claims it first (action_claimed_at), so two
    # workers never act twice, and a claim older than the reconciler's lease
    # belonged to a worker that died and may be taken over.
    action = models.CharField(max_length=8, choices=Action.choices, blank=True)
    action_claimed_at = models.DateTimeField(null=True, blank=True)
    # Temporary runtime errors of the pending action so far, the latest one,
    # and when the next try is due.
    action_tries = models.PositiveIntegerField(default=0)
    action_error = models.CharField(max_length=300, blank=True)
    action_not_before = models.DateTimeField(null=True, blank=True)
    # The control plane's latest estimate of this attempt's mean time between
    # preemptions, the reasons in words, and when it was made (see preemption.risk).
    # The ranks read it as the trap's cadence hint; the job page shows it.
    preemption_mtbp_seconds = models.FloatField(null=True, blank=True)
    preemption_risk_reasons = models.JSONField(default=list, blank=True)
    preemption_risk_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job_id", "number"]
        constraints = [
            models.UniqueConstraint(fields=["job", "number"], name="attempt_number_unique"),
            models.UniqueConstraint(
                fields=["job"], condition=Q(ended_at__isnull=True), name="attempt_one_open_per_job"
            ),
        ]
        # Every reconcile pass looks for ended attempts with a forget still to do.
        indexes = [
            models.Index(fields=["action"], condition=~Q(action=""), name="attempt_action_pending")
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} attempt {self.number}"

    @property
    def world_size(self) -> int:
        """How many ranks this attempt runs: its own size, else its job's."""
        return self.ranks if self.ranks is not None else self.job.ranks


def running_ranks() -> Coalesce:
    """For a query of jobs: how many ranks the job's open attempt runs, else its
    `ranks`. An active job's GPUs are this many ranks, not the most it asked for."""
    open_attempt = Attempt.objects.filter(job=OuterRef("pk"), ended_at__isnull=True)
    return Coalesce(
        Subquery(open_attempt.order_by().values("ranks")[:1]),
        F("ranks"),
        output_field=models.PositiveIntegerField(),
    )


def attempt_ranks(prefix: str = "") -> Coalesce:
    """For a query of attempts (or, with `prefix` "victim_attempt__" say, of rows that
    refer to one): the attempt's size, else its job's `ranks`."""
    job = "job__" if not prefix else f"{prefix}job__"
    return Coalesce(F(f"{prefix}ranks"), F(f"{job}ranks"))


def next_attempt_number(job_id: int) -> int:
    """The number of the job's next attempt: one more than its last. Attempts
    are never renumbered or deleted, so history keeps its numbers."""
    return next_attempt_numbers([job_id])[job_id]


def next_attempt_numbers(job_ids: Iterable[int]) -> dict[int, int]:
    """`next_attempt_number` of many jobs, in one query."""
    wanted = list(job_ids)
    last = dict(
        Attempt.objects.filter(job_id__in=wanted)
        .values("job_id")
        .annotate(last=Max("number"))
        .values_list("job_id", "last")
    )
    return {job_id: (last.get(job_id) or 0) + 1 for job_id in wanted}


class Rank(models.Model):
    """One process (or pod) of an attempt."""

    class State(models.TextChoices):
        STARTING = "starting", "Starting"
        RUNNING = "running", "Running"
        TERMINATING = "terminating", "Terminating"
        EXITED = "exited", "Exited"
        LOST = "lost", "Lost"

    class EndReason(models.TextChoices):
        OUT_OF_MEMORY = "out-of-memory", "Killed past its memory limit"
        DISK_LIMIT = "disk-limit", "Evicted past its ephemeral-storage limit"

    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="rank_set")
    index = models.PositiveIntegerField()
    node = models.CharField(max_length=253)
    state = models.CharField(max_length=16, choices=State.choices, default=State.STARTING)
    exit_code = models.IntegerField(null=True, blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    pod_name = models.CharField(max_length=253, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    signal_sent_at = models.DateTimeField(null=True, blank=True)
    signal_received_at = models.DateTimeField(null=True, blank=True)
    exited_at = models.DateTimeField(null=True, blank=True)
    # Why it ended where the runtime knows (RankObservation.end_reason), and the memory
    # limit it was past; preemption.reasons.rank_end_words words them.
    end_reason = models.CharField(max_length=16, choices=EndReason.choices, blank=True)
    memory_limit = models.PositiveBigIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["attempt_id", "index"]
        constraints = [
            models.UniqueConstraint(fields=["attempt", "index"], name="rank_index_unique")
        ]

    def __str__(self) -> str:
        return f"{self.attempt} rank {self.index}"


class RankLogTail(models.Model):
    """The end of one rank's log, saved when its attempt ended, for runtimes
    whose logs go away with the pods (Kubernetes). ``first_byte`` is where
    ``content`` starts in the whole log: earlier output was not kept."""

    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="log_tails")
    rank = models.PositiveIntegerField()
    first_byte = models.BigIntegerField(default=0)
    content = models.BinaryField()
    saved_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["attempt", "rank"], name="rank_log_tail_unique")
        ]

    def __str__(self) -> str:
        return f"log tail of {self.attempt} rank {self.rank}"


class StopQuerySet(models.QuerySet["PreemptionEvent"]):
    """Graceful stops split into preemptions and cancels.

    A person's cancel of a running job goes through the same graceful stop as
    a preemption (signal, grace window, kill at the deadline), so it is stored
    as the same kind of row with reason `manual`. It is not a preemption: every
    count, chart and list of preemptions reads `preemptions()`. Nor is a resize
    (reason `resize`), the stop of an elastic gang that is relaunched at once at
    another size and keeps its place (`resizes()`). Nor is a stop
    whose victim finished its work before the stop reached it (outcome
    `ended-first`): the scheduler decided on a job that was ending as it decided.
    """

    def preemptions(self) -> StopQuerySet:
        return self.exclude(
            reason__in=[PreemptionEvent.Reason.MANUAL, PreemptionEvent.Reason.RESIZE]
        ).exclude(outcome=PreemptionEvent.Outcome.ENDED_FIRST)

    def cancels(self) -> StopQuerySet:
        return self.filter(reason=PreemptionEvent.Reason.MANUAL)

    def resizes(self) -> StopQuerySet:
        return self.filter(reason=PreemptionEvent.Reason.RESIZE)


class PreemptionEvent(models.Model):
    """The graceful stop of one attempt: why, by whom, when it was decided, the
    deadline, what the ranks managed to checkpoint, and how it ended. A stop
    with reason `manual` is a person's cancel, not a preemption (see
    `StopQuerySet`).

    A stop with reason `resize` resizes an elastic gang: the scheduler decided to run
    it at `resize_ranks` ranks on `resize_placement` (the GPUs it keeps, and for a
    grow the free ones the plan gave it), so once its ranks have stopped at their
    agreed step the job is relaunched at once at that size as its next attempt,
    with `resize_borrowed_gpus` of them borrowed, instead of being requeued. `cause`
    says why in the engine's words ("shrunk from 8 to 4 ranks to reclaim team
    vision's guarantee for job 12", "grown from 4 to 8 ranks"); `preemptor` is the
    waiting job a shrink frees GPUs for. Until the relaunch those GPUs stay the
    job's: the scheduler's snapshot counts them as its (`preemption.snapshot`)."""

    class Reason(models.TextChoices):
        RECLAIM = "reclaim", "Reclaim"
        PRIORITY = "priority", "Priority"
        FAIR_SHARE = "fair-share", "Fair share"
        CONSOLIDATE = "consolidate", "Consolidation"
        GANG_GUARD = "gang-guard", "Gang guard"
        MANUAL = "manual", "Manual"
        # The embedded portal was stopped and stopped its local ranks with it;
        # the job is requeued and resumes from its checkpoint at the next start.
        SHUTDOWN = "shutdown", "Portal stopped"
        RESIZE = "resize", "Resize"

    class Outcome(models.TextChoices):
        GRACEFUL = "graceful", "Graceful"
        KILLED = "killed", "Killed at the deadline"
        CHECKPOINT_SKIPPED = "checkpoint-skipped", "Checkpoint skipped"
        FORCED = "forced-past-budget", "Forced past a disruption budget"
        # Every rank exited 0 before any stop reached it: the job finished its work,
        # nothing was taken from it, and it is no preemption (StopQuerySet).
        ENDED_FIRST = "ended-first", "Ended on its own before the stop reached it"

    victim_attempt = models.OneToOneField(
        Attempt, on_delete=models.CASCADE, related_name="preemption"
    )
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="preemptions")
    preemptor = models.ForeignKey(
        Job, null=True, blank=True, on_delete=models.SET_NULL, related_name="preempted_others"
    )
    cause = models.CharField(max_length=300, blank=True)
    reason = models.CharField(max_length=16, choices=Reason.choices)
    decided_at = models.DateTimeField(db_index=True)
    grace_seconds = models.FloatField()
    deadline = models.DateTimeField()
    # The checkpoint notice, for a victim whose trap speaks it and whose class has
    # a notice window: the eviction (signal_sent_at) waits until the ranks have
    # committed a checkpoint after the notice (notice_committed_at, the first
    # rank's report: a gang commits together) or until
    # notice_deadline, which is never later than the kill deadline.
    notice_deadline = models.DateTimeField(null=True, blank=True)
    notice_sent_at = models.DateTimeField(null=True, blank=True)
    notice_committed_at = models.DateTimeField(null=True, blank=True)
    signal_sent_at = models.DateTimeField(null=True, blank=True)
    killed_at = models.DateTimeField(null=True, blank=True)
    all_exited_at = models.DateTimeField(null=True, blank=True)
    checkpoint_step = models.PositiveIntegerField(null=True, blank=True)
    checkpoint_bytes = models.BigIntegerField(null=True, blank=True)
    checkpoint_seconds = models.FloatField(null=True, blank=True)
    outcome = models.CharField(max_length=20, choices=Outcome.choices, blank=True)
    lost_gpu_seconds = models.FloatField(null=True, blank=True)
    requeued_at = models.DateTimeField(null=True, blank=True)
    # The step the job was to resume from when this preemption requeued it. The
    # job's own resume_step moves on with every later checkpoint, so the story
    # of an old preemption must not read it.
    resume_step = models.PositiveIntegerField(null=True, blank=True)
    resumed_at = models.DateTimeField(null=True, blank=True)
    # A resize's target (reason `resize` only; see the class docstring).
    resize_ranks = models.PositiveIntegerField(null=True, blank=True)
    resize_placement = models.JSONField(default=list, blank=True)
    resize_borrowed_gpus = models.PositiveIntegerField(default=0)

    objects = StopQuerySet.as_manager()

    class Meta:
        ordering = ["-decided_at", "-id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(
                    reason__in=[
                        "reclaim",
                        "priority",
                        "fair-share",
                        "consolidate",
                        "gang-guard",
                        "manual",
                        "shutdown",
                        "resize",
                    ]
                ),
                name="preemption_reason_valid",
            ),
            models.CheckConstraint(
                condition=Q(deadline__gte=models.F("decided_at")),
                name="preemption_deadline_after_decision",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.reason} of {self.victim_attempt}"

    @property
    def is_cancel(self) -> bool:
        return self.reason == PreemptionEvent.Reason.MANUAL


class Checkpoint(models.Model):
    """A checkpoint a job's ranks committed, as reported by the trap."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="checkpoints")
    attempt = models.ForeignKey(
        Attempt, null=True, blank=True, on_delete=models.SET_NULL, related_name="checkpoints"
    )
    step = models.PositiveIntegerField()
    path = models.CharField(max_length=500, blank=True)
    bytes = models.BigIntegerField(default=0)
    seconds = models.FloatField(default=0.0)
    committed_at = models.DateTimeField()

    class Meta:
        ordering = ["-committed_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["job", "attempt", "step"], name="checkpoint_unique_step"
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} step {self.step}"


class Webhook(models.Model):
    """A team's URL that receives preempted, requeued, resized, failed and finished notices."""

    EVENTS = ("preempted", "requeued", "resized", "failed", "finished")

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="webhooks")
    url = models.URLField(max_length=500)
    secret = models.CharField(max_length=64, blank=True)
    events = models.JSONField(default=list)
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.team.slug} -> {self.origin}"

    @property
    def origin(self) -> str:
        """Scheme and host, the most of the URL that logs and labels show: a
        webhook URL may carry a credential in its path."""
        try:
            parts = urlsplit(self.url)
        except ValueError:
            return "(malformed URL)"
        return f"{parts.scheme}://{parts.hostname or '?'}"


class WebhookDelivery(models.Model):
    """One notice to one webhook, retried with backoff until delivered or given up."""

    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries")
    event = models.CharField(max_length=16)
    payload = models.JSONField()
    created_at = models.DateTimeField(auto_now_add=True)
    tries = models.PositiveIntegerField(default=0)
    next_try_at = models.DateTimeField(db_index=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    given_up_at = models.DateTimeField(null=True, blank=True)
    last_error = models.CharField(max_length=300, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "webhook deliveries"

    def __str__(self) -> str:
        return (
            f"{self.event} to {self.webhook_id} ({'delivered' if self.delivered_at else 'pending'})"
        )


class TrapEvent(models.Model):
    """One event a rank's trap reported, by POST or from its log.

    The fingerprint is a hash of the event's JSON, so the same event arriving
    both ways is stored once.
    """

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="trap_events")
    attempt = models.PositiveIntegerField()
    rank = models.PositiveIntegerField()
    event = models.CharField(max_length=32)
    at = models.FloatField()
    step = models.PositiveIntegerField(null=True, blank=True)
    payload = models.JSONField()
    fingerprint = models.CharField(max_length=64, unique=True)
    source = models.CharField(max_length=8, choices=[("post", "POST"), ("log", "log")])
    received_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["at", "id"]
        indexes = [models.Index(fields=["job", "attempt", "event"])]

    def __str__(self) -> str:
        return f"job {self.job_id}/{self.attempt} rank {self.rank} {self.event}"
