"""Level-triggered reconcilers: compare what the database wants with what the
runtime observes right now, and move ranks and jobs forward.

Each pass over an attempt has two steps, and no runtime call (a process
launch, a signal, a Kubernetes request, a log read) is made while a
transaction is open or a row is locked:

- *decide*, in one short transaction: record what the runtime observed, move
  the job's state on, and record the runtime action the attempt needs next on
  the attempt row (launch attempt N, signal its ranks, kill them at the
  deadline, forget the finished gang);
- *act*, after that commits: claim the action with a conditional update, make
  the runtime call, and record its outcome in another short transaction.

A runtime call can take seconds. On the embedded SQLite a transaction holds
the database's only write lock from its start, so a call made inside one
would keep every other writer waiting, job submissions included.

Every step is idempotent and claims its row with a conditional update, so a
second reconcile of the same state, or two workers at once, change nothing
more: an action is carried out by the one worker that claimed it (a claim
left by a worker that died expires after ACTION_LEASE), signals are sent once
per preemption (a repeat is harmless), an attempt is finished once, and a job
is requeued once.

A temporary runtime error leaves the action in place with its count, its
message and the time of the next try (exponential backoff, shown on the job
page); a launch gives up after QM_RUNTIME_TRIES. A permanent error fails that
attempt with its reason. Neither stops the pass for the other attempts.
"""

from __future__ import annotations

import copy
import dataclasses
import fcntl
import functools
import logging
import os
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import OperationalError, close_old_connections, transaction
from django.db.models import Max, Q, QuerySet, prefetch_related_objects
from django.utils import timezone

from core.rows import update_rows
from preemption.event_tokens import attempt_events_token
from preemption.ingest import ingest_trap_event, sqlstate
from preemption.logs import save_log_tails
from preemption.models import (
    ACTIVE_STATES,
    Attempt,
    Checkpoint,
    Job,
    JobState,
    PreemptionEvent,
    Rank,
    TrapEvent,
)
from preemption.notice import announced_notice, notice_plan, record_notice_commit
from preemption.reasons import disruption_requeue_words, disruption_words, rank_end_words
from preemption.runtime import get_runtime
from preemption.runtimes import iter_log_chunks, iter_trap_events_in_chunks, processes
from preemption.runtimes.base import (
    STUCK_REASONS,
    GangId,
    GangSpec,
    RankObservation,
    RankPlacement,
    Runtime,
    RuntimePermanentError,
    RuntimeTemporaryError,
)
from preemption.runtimes.records import read_record, write_record
from preemption.wakeup import queue_cycle, send_reconcile
from preemption.webhooks import Notice, notify, notify_each

logger = logging.getLogger(__name__)

TERMINAL_PHASES = ("exited", "lost")
RANK_STATES = frozenset(Rank.State.values)


def _when(at: float | None) -> datetime | None:
    return datetime.fromtimestamp(at, tz=UTC) if at is not None else None


def events_url(job_id: int) -> str:
    return f"{settings.QM_PUBLIC_URL.rstrip('/')}/api/v1/jobs/{job_id}/events/"


def gang_spec(job: Job, attempt: Attempt, ranks: Iterable[Rank]) -> GangSpec:
    per_node: dict[str, int] = defaultdict(int)
    placements = []
    for rank in sorted(ranks, key=lambda r: r.index):
        placements.append(
            RankPlacement(rank=rank.index, node=rank.node, local_rank=per_node[rank.node])
        )
        per_node[rank.node] += 1
    env = {
        **{str(k): str(v) for k, v in (job.env or {}).items()},
        "QM_JOB_ID": str(job.pk),
        "QM_ATTEMPT": str(attempt.number),
        "QM_GRACE_SECONDS": str(job.priority_class.grace_seconds),
        "QM_CHECKPOINT_DIR": job.checkpoint_dir,
        "QM_EVENTS_URL": events_url(job.pk),
        # The attempt's own token: it expires when the attempt ends.
        "QM_EVENTS_TOKEN": attempt_events_token(attempt),
    }
    return GangSpec(
        job_id=job.pk,
        attempt=attempt.number,
        command=job.command,
        ranks=tuple(placements),
        gpus_per_rank=job.gpus_per_rank,
        grace_seconds=float(job.priority_class.grace_seconds),
        priority_class=job.priority_class.name,
        env=env,
        image=job.image or None,
        team=job.team.slug,
        flavor=job.flavor.name,
        mtbp_seconds=attempt.preemption_mtbp_seconds,
    )


def request_stop(
    *, job: Job, reason: str, cause: str, grace_seconds: float | None = None
) -> PreemptionEvent | None:
    """Record that a running job must stop gracefully (cancel, gang guard).
    The reconciler then signals every rank and enforces the deadline."""
    attempt = Attempt.objects.filter(job=job, ended_at__isnull=True).first()
    if attempt is None or PreemptionEvent.objects.filter(victim_attempt=attempt).exists():
        return None
    now = timezone.now()
    grace = float(job.priority_class.grace_seconds if grace_seconds is None else grace_seconds)
    Job.objects.filter(pk=job.pk, state__in=[JobState.ADMITTED, JobState.RUNNING]).update(
        state=JobState.PREEMPTING, preempting_at=now
    )
    return PreemptionEvent.objects.create(
        victim_attempt=attempt,
        job=job,
        reason=reason,
        cause=cause[:300],
        decided_at=now,
        grace_seconds=grace,
        deadline=now + timedelta(seconds=grace),
    )


@dataclass
class Step:
    """What the decide step found an attempt needs from the runtime next.

    `action` is one of Attempt.Action's values, or FINISH: every rank has exited and
    the attempt is to be closed (which reads the ranks' logs first)."""

    action: str
    attempt: Attempt
    event: PreemptionEvent | None = None
    spec: GangSpec | None = None
    alive: list[int] = field(default_factory=list)
    # When the runtime call began: a signal is recorded as sent at this moment,
    # since ranks receive it while the call runs and the record must not say it
    # was sent after they received it.
    called_at: datetime | None = None
    # When it returned: a launch is recorded as done at this moment, its own, not
    # when the last of the pass's launches returned (the work a victim loses counts
    # from its launch).
    returned_at: datetime | None = None
    # A kill whose gang's evictions a disruption budget still refused: the
    # preemption's outcome says it was forced past the budget.
    forced: bool = False
    # A checkpoint notice: the signal to send ("" where the runtime answers polls).
    notice_signal: str = ""

    @property
    def gang(self) -> GangId:
        return GangId(self.attempt.job_id, self.attempt.number)


T = TypeVar("T")
FINISH = "finish"
# A claim older than this belonged to a worker that died while acting: longer than
# any single runtime call may take (the local launcher's timeout, the Celery task's
# hard time limit).
ACTION_LEASE = timedelta(seconds=180)
# Launches of one pass go out side by side: each local launch waits for a
# launcher process to start, each Kubernetes launch for the API server. A runtime
# whose calls never wait says how many it wants instead (runtimes.base.CallsSideBySide).
PARALLEL_ACTIONS = 8
MAX_RETRY_SECONDS = 60.0


def reconcile_jobs(*, job_ids: list[int] | None = None, runtime: Runtime | None = None) -> int:
    """Reconcile every open attempt of active jobs (or only those of `job_ids`).
    Returns how many attempts were looked at.

    Runtime calls happen only between the short transactions, never inside one.
    A pass over every attempt while another such pass of this installation is
    still running does nothing: the next one starts a moment later anyway."""
    if job_ids is None:
        with _only_pass() as mine:
            return _reconcile(None, runtime or get_runtime()) if mine else 0
    return _reconcile(job_ids, runtime or get_runtime())


# How long the exits listener keeps looking at a job whose gang ended before the
# pass could close it (listen_for_exits), and how often meanwhile.
SETTLE_SECONDS = 2.0
SETTLE_RETRY_SECONDS = 0.1
# How often a live exits listener says so (`exits_listened`).
LISTENER_BEAT_SECONDS = 0.5


def listen_for_exits(stop: threading.Event) -> bool:
    """Until `stop` is set, reconcile each job whose ranks exit, as they exit, where
    the runtime can tell (base.ExitWatcher: the local and mimic runtimes); False at
    once where it cannot, or when the runtime refuses the watch for good (the local
    runtime's exits pipe is not its own), and the periodic passes find every end.

    The passes run here, in the listener's own process, rather than as tasks: in a
    busy cluster the worker's queue holds scheduling cycles, and an exit waiting
    behind them kept its GPUs from the next job for seconds. The runtime's watch
    runs in a thread of its own and only collects job ids, so exits announced while
    a pass runs are taken together by the next one. An exit the runtime cannot name,
    or a pass that fails, is handed to the worker as a task instead.

    A pass cannot close every attempt it is told of: a gang may end before the
    launch that started it is recorded (a short job in a large batch of launches),
    or another pass may hold its job. Such jobs are looked at again every
    SETTLE_RETRY_SECONDS for up to SETTLE_SECONDS, after which the periodic passes
    have them. While the listener is alive (its marker in QM_VAR_DIR, touched every
    LISTENER_BEAT_SECONDS) the periodic passes leave it the gangs that ended less
    than SETTLE_SECONDS ago; should it die, they take every end again within a
    couple of seconds."""
    runtime = get_runtime()
    watch = getattr(runtime, "watch_exits", None)
    if watch is None:
        return False
    announced: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
    refused, ending = threading.Event(), threading.Event()

    def watching() -> None:
        while not ending.is_set():
            try:
                watch(ending, announced.put)
            except RuntimePermanentError:
                logger.error("not listening for rank exits; periodic passes only", exc_info=True)
                refused.set()
                return
            except Exception:
                logger.warning("listening for rank exits failed; listening again", exc_info=True)
                ending.wait(1.0)

    watcher = threading.Thread(target=watching, name="exits-watch", daemon=True)
    watcher.start()
    # Jobs told of whose attempt a pass left open, and when first told of.
    unsettled: dict[int, float] = {}
    marker = _listening_marker()
    beat = 0.0
    try:
        while not stop.is_set() and not refused.is_set():
            if time.monotonic() - beat >= LISTENER_BEAT_SECONDS:
                with suppress(OSError):
                    marker.touch(mode=0o600)
                beat = time.monotonic()
            batches: list[list[int]] = []
            with suppress(queue.Empty):
                batches.append(
                    announced.get(
                        timeout=SETTLE_RETRY_SECONDS if unsettled else LISTENER_BEAT_SECONDS
                    )
                )
                while True:
                    batches.append(announced.get_nowait())
            if any(not batch for batch in batches):
                send_reconcile()
            now = time.monotonic()
            for job_id in (job_id for batch in batches for job_id in batch):
                unsettled.setdefault(job_id, now)
            if unsettled:
                _settle(unsettled, runtime, now)
    finally:
        with suppress(OSError):
            marker.unlink()
        ending.set()
        watcher.join(timeout=10)
    return not refused.is_set()


def _listening_marker() -> Path:
    return Path(settings.VAR_DIR) / "exits.listening"


def exits_listened() -> bool:
    """Whether an exits listener of this installation's machine is alive: it touches
    its marker at least every LISTENER_BEAT_SECONDS."""
    try:
        return time.time() - _listening_marker().stat().st_mtime < 4 * LISTENER_BEAT_SECONDS
    except OSError:
        return False


def _launch_hold_marker() -> Path:
    return Path(settings.VAR_DIR) / "launches.held"


def hold_launches(held: bool) -> None:
    """Hold every launch of this installation's machine while this process lives, or
    release the hold.

    The embedded portal holds them while it stops: it tells the ranks to stop as soon
    as it is asked to, while its worker still finishes its tasks, and a gang that
    exits on that signal is requeued by the worker's passes; launching it again then
    would only have it stopped a second time. An attempt whose launch is held keeps
    its recorded launch, which the next start's reconcile carries out. The marker
    names the holding process (pid and creation time), so a hold whose process died
    without releasing it holds nothing.
    """
    marker = _launch_hold_marker()
    if not held:
        marker.unlink(missing_ok=True)
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    me = os.getpid()
    write_record(marker, {"pid": me, "created_at": processes.created_at(me)})


def launches_held() -> bool:
    """Whether a live process holds this machine's launches (`hold_launches`)."""
    try:
        holder = read_record(_launch_hold_marker())
        return holder is not None and processes.is_alive(
            int(holder["pid"]), float(holder["created_at"])
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _ended_since(observations: list[RankObservation], moment: float) -> bool:
    """Whether every rank observed has exited, the last of them after `moment`."""
    return bool(observations) and all(
        obs.phase == "exited" and obs.exited_at is not None and obs.exited_at > moment
        for obs in observations
    )


def _settle(unsettled: dict[int, float], runtime: Runtime, now: float) -> None:
    """One pass of the exits listener over the jobs told of; those whose attempt it
    left open stay in `unsettled` until SETTLE_SECONDS after they were told of."""
    looked = sorted(unsettled)
    close_old_connections()
    try:
        reconcile_jobs(job_ids=looked, runtime=runtime)
        still_open = set(
            Attempt.objects.filter(job_id__in=looked, ended_at__isnull=True).values_list(
                "job_id", flat=True
            )
        )
    except Exception:
        logger.warning("reconciling jobs %s failed; the worker will", looked, exc_info=True)
        send_reconcile(looked)
        unsettled.clear()
        return
    for job_id in looked:
        if job_id not in still_open or now - unsettled[job_id] > SETTLE_SECONDS:
            del unsettled[job_id]


def launch_admitted(job_ids: list[int], runtime: Runtime | None = None) -> None:
    """Launch the attempts a scheduling cycle has just admitted.

    The cycle records each with the launch as its action, in the transaction that
    admits it, so there is nothing to observe or decide yet: this goes straight to
    the act step. An attempt stopped since (a cancel) or already claimed is left to
    the next pass, and a launch cut short is carried out by the next pass's decide
    step, as any recorded action is."""
    attempts = (
        Attempt.objects.filter(
            job_id__in=job_ids,
            job__state=JobState.ADMITTED,
            ended_at__isnull=True,
            launched_at__isnull=True,
            action=Attempt.Action.LAUNCH,
            preemption__isnull=True,
        )
        .select_related("job", "job__team", "job__priority_class", "job__flavor")
        .prefetch_related("rank_set")
        .order_by("job_id")
    )
    steps = [
        Step(
            Attempt.Action.LAUNCH,
            attempt,
            spec=gang_spec(attempt.job, attempt, attempt.rank_set.all()),
        )
        for attempt in attempts
    ]
    if steps:
        act(steps, runtime or get_runtime())


@contextmanager
def _only_pass() -> Iterator[bool]:
    folder = Path(settings.VAR_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "reconcile.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _reconcile(job_ids: list[int] | None, runtime: Runtime) -> int:
    _forget_finished(job_ids, runtime)
    open_attempts = _open_attempts(job_ids)
    if not open_attempts:
        return 0
    observed: dict[tuple[int, int], list[RankObservation]] = defaultdict(list)
    try:
        if job_ids is not None and len(open_attempts) <= 4:
            for row in open_attempts:
                for obs in runtime.observe(GangId(row.job_id, row.number)):
                    observed[(obs.job_id, obs.attempt)].append(obs)
        else:
            for obs in runtime.observe(None):
                observed[(obs.job_id, obs.attempt)].append(obs)
    except (RuntimeTemporaryError, RuntimePermanentError):
        logger.warning("runtime observation failed; retrying next cycle", exc_info=True)
        return 0
    # Runtimes that can tell a rank was taken away (kube-scheduler preemption,
    # node loss) even when it exited 0 name those gangs themselves.
    taken: set[tuple[int, int]] = set()
    guard = runtime.gang_guard
    if guard is not None:
        try:
            taken = {(gang.job_id, gang.attempt) for gang in guard.guard_victims()}
        except (RuntimeTemporaryError, RuntimePermanentError):
            logger.warning("gang-guard observation failed; retrying next cycle", exc_info=True)
    # An exits listener closes the gangs that end; a pass over every job leaves it
    # those that ended a moment ago, rather than meeting it on their rows.
    left_since = time.time() - SETTLE_SECONDS if job_ids is None and exits_listened() else None
    to_decide = []
    for row in open_attempts:
        key = (row.job_id, row.number)
        observations = observed.get(key, [])
        if _steady(row, observations, key in taken):
            continue
        if left_since is not None and _ended_since(observations, left_since):
            continue
        to_decide.append(row.pk)
    if not to_decide:
        return len(open_attempts)
    attempts = (
        Attempt.objects.filter(
            pk__in=to_decide, ended_at__isnull=True, job__state__in=ACTIVE_STATES
        )
        .select_related("job", "job__team", "job__priority_class", "job__flavor", "preemption")
        # Without their ranks: the decisions read them afresh under lock (_lock_rows),
        # and only a victim whose logs are due reads them before (_read_victims_logs).
        # In the order of their jobs' ids, the order in which the scheduling cycle locks
        # jobs too: two transactions that lock the same jobs in one order cannot deadlock.
        .order_by("job_id", "id")
    )
    # Gangs the runtime shows nothing of although they were launched are observed
    # once more first: the pass's observation may predate their launch.
    pending: list[tuple[Attempt, list[RankObservation], bool]] = []
    for attempt in attempts:
        key = (attempt.job_id, attempt.number)
        observations = observed.get(key, [])
        if not observations and attempt.launched_at is not None:
            try:
                observations = runtime.observe(GangId(*key))
            except (RuntimeTemporaryError, RuntimePermanentError):
                logger.warning("observing %s failed; retrying next cycle", attempt, exc_info=True)
                continue
        pending.append((attempt, observations, key in taken))
    delivery = notice_delivery(runtime)
    if delivery is not None:
        _read_victims_logs([attempt for attempt, _, _ in pending], runtime)
    # One short transaction decides for every attempt, each in a savepoint of its
    # own: on SQLite each transaction waits its turn for the write lock.
    steps: list[Step] = []
    launched = {attempt.pk: attempt.launched_at for attempt, _, _ in pending}
    try:
        with transaction.atomic():
            locked = [attempt for attempt, _, _ in pending]
            rows = _lock_rows(locked)
            kept = {attempt.pk for attempt in locked}
            plain = [
                (attempt, observations)
                for attempt, observations, was_taken in pending
                if attempt.pk in kept and _plain(attempt, observations, rows, was_taken)
            ]
            plain_steps = _decide_plain(plain, rows)
            if plain_steps is not None:
                steps += plain_steps
                kept -= {attempt.pk for attempt, _ in plain}
            stopping = [
                (attempt, observations)
                for attempt, observations, _ in pending
                if attempt.pk in kept and _stopping(attempt, observations, rows)
            ]
            stopped = _decide_stops(stopping, rows, delivery)
            if stopped is not None:
                steps += stopped.steps
                kept -= stopped.decided
            for attempt, observations, was_taken in pending:
                if attempt.pk not in kept:
                    continue
                step = _guarded(
                    attempt,
                    functools.partial(
                        _decide,
                        attempt,
                        observations,
                        launched_at=launched[attempt.pk],
                        taken=was_taken,
                        delivery=delivery,
                        rows=rows,
                    ),
                    # A launch already recorded writes nothing: a savepoint would
                    # only cost two statements per admitted job.
                    savepoint=not _launch_recorded(attempt, rows),
                )
                if step is not None:
                    steps.append(step)
    except OperationalError as error:
        if sqlstate(error) not in LOCK_CONFLICTS:
            raise
        # The pass's locks met another writer's in the opposite order and the
        # database chose this pass to undo: nothing of it was kept, and the next
        # pass decides again. The project's own writers lock a job before its
        # ranks (the cycle, this pass, a checkpoint's ingestion); this is the
        # safety net for any that does not.
        logger.warning("the reconcile pass met a lock conflict; retrying next pass: %s", error)
        return 0
    act(steps, runtime)
    return len(open_attempts)


# A deadlock the database broke by undoing this transaction, and a lock not granted.
LOCK_CONFLICTS = {"40P01", "55P03"}


def notice_delivery(runtime: Runtime) -> str | None:
    """How the runtime delivers a checkpoint notice ("signal" or "poll"), or None."""
    delivery = getattr(runtime, "notice_delivery", None)
    return delivery if delivery in ("signal", "poll") else None


# When each victim's logs were last read while its eviction waited (monotonic clock).
_victim_logs_read: dict[int, float] = {}
# Each victim's logs are read at most this often: most events arrive by POST anyway,
# and a Kubernetes log read is an API call per rank.
VICTIM_LOG_SECONDS = 1.0


def _read_victims_logs(attempts: list[Attempt], runtime: Runtime) -> None:
    """A victim that may get, or got, a checkpoint notice: what its trap announced
    and committed decides when it is evicted, and an event whose POST was lost is
    still in the log."""
    now = time.monotonic()
    waiting = [attempt for attempt in attempts if _awaits_eviction(attempt)]
    last = {a.pk: _victim_logs_read[a.pk] for a in waiting if a.pk in _victim_logs_read}
    _victim_logs_read.clear()
    _victim_logs_read.update(last)
    due = [
        attempt
        for attempt in waiting
        if now - _victim_logs_read.get(attempt.pk, float("-inf")) >= VICTIM_LOG_SECONDS
    ]
    prefetch_related_objects(due, "rank_set")
    for attempt in due:
        _victim_logs_read[attempt.pk] = now
        _guarded(
            attempt,
            functools.partial(ingest_logs, attempt.job, attempt, attempt.rank_set.all(), runtime),
        )


def _awaits_eviction(attempt: Attempt) -> bool:
    """A launched attempt picked as a victim whose eviction has not been sent."""
    try:
        event = attempt.preemption
    except PreemptionEvent.DoesNotExist:
        return False
    return attempt.launched_at is not None and event.signal_sent_at is None


def _guarded(attempt: Attempt, work: Callable[[], T], *, savepoint: bool = False) -> T | None:
    """One attempt's trouble is logged and never stops the pass for the others;
    with `savepoint`, its writes so far are undone and the others' kept.

    Two kinds of trouble are not one attempt's and end the pass: the task's time
    limit, and an error that left the enclosing transaction unusable (every later
    query in it would fail); the next pass starts afresh."""
    try:
        if savepoint:
            with transaction.atomic():
                return work()
        return work()
    except SoftTimeLimitExceeded:
        raise
    except (RuntimeTemporaryError, RuntimePermanentError):
        logger.warning("runtime error on %s; retrying next cycle", attempt, exc_info=True)
    except Exception:
        if transaction.get_connection().needs_rollback:
            raise
        logger.exception("reconciling %s failed; retrying next cycle", attempt)
    return None


# --- decide -----------------------------------------------------------------------


@dataclass
class _Rows:
    """What the decide step reads of the attempts it decides for, read for all of
    them at once under the pass's locks: each attempt's ranks by index, and its stop."""

    ranks: dict[int, dict[int, Rank]]
    events: dict[int, PreemptionEvent]


ATTEMPT_FIELDS = ("launched_at", "ended_at", "action", "action_claimed_at", "action_tries")
JOB_FIELDS = ("state", "cancel_requested_at", "env")


def _lock_rows(attempts: list[Attempt]) -> _Rows:
    """Lock the attempts' jobs and ranks and read them afresh, in a fixed number of
    queries however many attempts: the job rows first, in the order of their ids,
    as the scheduling cycle locks them before anything of theirs, then the ranks.
    FOR NO KEY UPDATE on the jobs still lets trap events that refer to a job be
    written (their foreign key takes a KEY SHARE lock), which a full row lock would
    block while ingestion holds the ranks this pass waits for.

    A job another transaction holds is skipped, not waited for (SKIP LOCKED): its
    holder is moving it on right now (another pass closing it, the cycle recording
    its stop, ingestion storing its checkpoint), and the next pass decides it on what
    that one wrote. Waiting would only hold this pass's own jobs meanwhile; in a busy
    cluster the exits listener and the worker's periodic pass met on every job that
    had just ended. Only the attempts whose jobs were locked are kept in `attempts`.

    The attempts and their jobs are refreshed in place; the ranks and stops are
    returned."""
    if not attempts:
        return _Rows({}, {})
    jobs = {
        row["pk"]: row
        for row in Job.objects.select_for_update(no_key=True, skip_locked=True)
        .filter(pk__in={attempt.job_id for attempt in attempts})
        .order_by("pk")
        .values("pk", *JOB_FIELDS)
    }
    attempts[:] = [attempt for attempt in attempts if attempt.job_id in jobs]
    if not attempts:
        return _Rows({}, {})
    ranks: dict[int, dict[int, Rank]] = defaultdict(dict)
    for rank in (
        Rank.objects.select_for_update()
        .filter(attempt__in=attempts)
        .order_by("attempt_id", "index")
    ):
        ranks[rank.attempt_id][rank.index] = rank
    fresh = {
        row["pk"]: row
        for row in Attempt.objects.filter(pk__in=[a.pk for a in attempts]).values(
            "pk", *ATTEMPT_FIELDS
        )
    }
    for attempt in attempts:
        for name in ATTEMPT_FIELDS:
            setattr(attempt, name, fresh[attempt.pk][name])
        for name in JOB_FIELDS:
            setattr(attempt.job, name, jobs[attempt.job_id][name])
    events = {
        event.victim_attempt_id: event
        for event in PreemptionEvent.objects.filter(victim_attempt__in=attempts)
    }
    return _Rows(ranks, events)


def _plain(
    attempt: Attempt,
    observations: list[RankObservation],
    rows: _Rows,
    taken: bool,
) -> bool:
    """Whether the attempt moved on the common way, on its own: its launch recorded,
    every one of its ranks seen, running or exited 0, nothing asked of it (no stop,
    no action under way), its job admitted or running. For such an attempt `_decide`
    records what the ranks did, marks the job running, and finishes the attempt
    once every rank has exited; `_decide_plain` does it for all of them at once.

    The launch may have been recorded only after this pass observed the runtime:
    ranks seen running or exited ran, so the launch came before the observation. A
    short job in a large batch of launches often ends before the batch is recorded."""
    ranks = rows.ranks.get(attempt.pk, {})
    return (
        not taken
        and attempt.ended_at is None
        and attempt.launched_at is not None
        and not attempt.action
        and attempt.action_claimed_at is None
        and attempt.pk not in rows.events
        and attempt.job.state in (JobState.ADMITTED, JobState.RUNNING)
        and bool(ranks)
        and sorted(obs.rank for obs in observations) == sorted(ranks)
        and all(
            obs.phase == "running" or (obs.phase == "exited" and obs.exit_code == 0)
            for obs in observations
        )
    )


def _decide_plain(
    plain: list[tuple[Attempt, list[RankObservation]]], rows: _Rows
) -> list[Step] | None:
    """Decide for the attempts that moved on the common way (`_plain`) as `_decide`
    does for each, in a fixed number of queries however many: one write of their
    ranks, one of their jobs still marked admitted, and a finish step for each whose
    ranks all exited. In a busy cluster a pass sees hundreds of gangs that have just
    started or ended; a savepoint and a write each held their jobs' rows for as long,
    and the exits listener, which skips a row another pass holds, closed their ends
    only at a later pass. None when that failed: nothing of it is kept, and the
    caller decides for them one by one, so one attempt's trouble stays its own."""
    if not plain:
        return []
    now = timezone.now()
    written = _ObservedRanks()
    for attempt, observations in plain:
        written.add(rows.ranks[attempt.pk], observations)
    admitted = [attempt.job_id for attempt, _ in plain if attempt.job.state == JobState.ADMITTED]
    try:
        with transaction.atomic():
            written.write()
            if admitted:
                Job.objects.filter(pk__in=admitted, state=JobState.ADMITTED).update(
                    state=JobState.RUNNING, running_at=now
                )
    except SoftTimeLimitExceeded:
        raise
    except Exception:
        if transaction.get_connection().needs_rollback:
            raise
        logger.exception("recording %d plain changes together failed; one by one", len(plain))
        return None
    return [
        Step(FINISH, attempt)
        for attempt, observations in plain
        if all(obs.phase == "exited" for obs in observations)
    ]


class _ObservedRanks:
    """The ranks whose recorded state an observation changed, as copies with the
    changes applied, written together in one statement (`write`). The copies leave
    the ranks read under lock as the database has them, so that the one-by-one
    decisions after a failed batch still see them so."""

    def __init__(self) -> None:
        self.ranks: list[Rank] = []
        self.fields: set[str] = set()

    def add(self, ranks: dict[int, Rank], observations: list[RankObservation]) -> dict[int, str]:
        """Take the changes `observations` make to `ranks`; each rank's state after them."""
        states = {index: rank.state for index, rank in ranks.items()}
        for obs in observations:
            changes = _rank_changes(ranks[obs.rank], obs)
            if changes:
                rank = copy.copy(ranks[obs.rank])
                for name, value in changes.items():
                    setattr(rank, name, value)
                self.ranks.append(rank)
                self.fields.update(changes)
                states[obs.rank] = rank.state
        return states

    def extend(self, other: _ObservedRanks) -> None:
        self.ranks += other.ranks
        self.fields |= other.fields

    def write(self) -> None:
        if self.ranks:
            update_rows(self.ranks, sorted(self.fields))


def _launch_recorded(attempt: Attempt, rows: _Rows) -> bool:
    """Whether the attempt only waits for the launch its admission recorded: `_decide`
    then writes nothing, and hands the launch on to the act step."""
    return (
        attempt.ended_at is None
        and attempt.launched_at is None
        and attempt.action == Attempt.Action.LAUNCH
        and attempt.pk not in rows.events
    )


def _stopping(attempt: Attempt, observations: list[RankObservation], rows: _Rows) -> bool:
    """Whether the attempt is being stopped the common way: a launched gang with a
    stop recorded (a preemption, a cancel), every one of its ranks seen, and no
    action of it claimed by a worker. For such an attempt `_decide` records what the
    ranks did and moves the stop on (signal, kill at the deadline, finish once every
    rank exited); `_decide_stops` does it for all of them at once. A cycle that
    preempts two thousand jobs leaves as many such attempts to the next pass."""
    ranks = rows.ranks.get(attempt.pk, {})
    return (
        attempt.ended_at is None
        and attempt.launched_at is not None
        and attempt.action_claimed_at is None
        and attempt.pk in rows.events
        and bool(ranks)
        and sorted(obs.rank for obs in observations) == sorted(ranks)
    )


@dataclass
class _Decided:
    """What deciding a group of attempts together gave: the steps to act on, and the
    attempts it decided (the rest are decided one by one)."""

    steps: list[Step]
    decided: set[int]


def _decide_stops(
    stopping: list[tuple[Attempt, list[RankObservation]]], rows: _Rows, delivery: str | None
) -> _Decided | None:
    """Decide for the attempts being stopped the common way (`_stopping`) as `_decide`
    does for each, in a fixed number of queries however many: one write of their
    ranks, one of their jobs still marked admitted, and one of the actions they now
    need per kind of action. An attempt whose stop waits on a checkpoint notice is
    left out, to `_decide`. None when the writes failed: nothing of them is kept,
    and the caller decides for them one by one, so one attempt's trouble stays its
    own."""
    if not stopping:
        return _Decided([], set())
    now = timezone.now()
    written = _ObservedRanks()
    steps: list[Step] = []
    decided: set[int] = set()
    running: list[int] = []
    for attempt, observations in stopping:
        event = rows.events[attempt.pk]
        ranks = rows.ranks[attempt.pk]
        states = _ObservedRanks()
        phases = states.add(ranks, observations)
        alive = [i for i, phase in phases.items() if phase not in TERMINAL_PHASES]
        if (
            alive
            and event.signal_sent_at is None
            and not _evicted_without_notice(attempt, event, delivery, now)
        ):
            continue
        decided.add(attempt.pk)
        written.extend(states)
        if attempt.job.state == JobState.ADMITTED and (
            not alive or all(phase != "starting" for phase in phases.values())
        ):
            running.append(attempt.job_id)
        if not alive:
            steps.append(Step(FINISH, attempt, event))
        elif event.signal_sent_at is None:
            action = (
                Attempt.Action.KILL
                if now >= event.deadline
                and attempt.action == Attempt.Action.SIGNAL
                and attempt.action_tries > 0
                else Attempt.Action.SIGNAL
            )
            steps.append(Step(action, attempt, event, alive=alive))
        elif now >= event.deadline:
            steps.append(Step(Attempt.Action.KILL, attempt, event, alive=alive))
    intended: dict[str, list[int]] = defaultdict(list)
    for step in steps:
        if step.action != FINISH and step.attempt.action != step.action:
            intended[step.action].append(step.attempt.pk)
    try:
        with transaction.atomic():
            written.write()
            if running:
                Job.objects.filter(pk__in=running, state=JobState.ADMITTED).update(
                    state=JobState.RUNNING, running_at=now
                )
            for action, pks in intended.items():
                Attempt.objects.filter(pk__in=pks, ended_at__isnull=True).update(
                    action=action,
                    action_claimed_at=None,
                    action_tries=0,
                    action_error="",
                    action_not_before=None,
                )
    except SoftTimeLimitExceeded:
        raise
    except Exception:
        if transaction.get_connection().needs_rollback:
            raise
        logger.exception("recording %d stops together failed; one by one", len(decided))
        return None
    for step in steps:
        if step.action != FINISH and step.attempt.action != step.action:
            step.attempt.action, step.attempt.action_tries = step.action, 0
    return _Decided(steps, decided)


def _evicted_without_notice(
    attempt: Attempt, event: PreemptionEvent, delivery: str | None, now: datetime
) -> bool:
    """Whether a stop whose signal has not been sent goes ahead with no checkpoint
    notice first, as `_notice_first` judges it: none is planned for this victim, or
    the notice's window has passed, or the deadline has come with the signal tried."""
    if (
        now >= event.deadline
        and attempt.action == Attempt.Action.SIGNAL
        and attempt.action_tries > 0
    ):
        return True
    if event.notice_deadline is not None:
        return now >= event.notice_deadline
    return notice_plan(event=event, attempt=attempt, delivery=delivery, now=now) is None


def _decide(
    attempt: Attempt,
    observations: list[RankObservation],
    *,
    launched_at: datetime | None,
    taken: bool,
    rows: _Rows,
    delivery: str | None = None,
) -> Step | None:
    """Record what the runtime observed, move the job on, and record the runtime
    action the attempt needs next. Runs inside the pass's decide transaction, after
    `_lock_rows` locked and read `rows`.

    `launched_at` is the attempt's as read before the runtime was observed."""
    job = attempt.job
    now = timezone.now()
    ranks = rows.ranks.get(attempt.pk, {})
    if attempt.ended_at is not None:
        return None
    if attempt.action_claimed_at is not None and attempt.action_claimed_at > now - ACTION_LEASE:
        # Another worker is carrying out this attempt's action right now.
        return None
    event = rows.events.get(attempt.pk)

    if attempt.launched_at is None and event is None:
        # Not launched yet, or a launch that failed half-way and left some of its
        # ranks behind for the runtime to show: the next launch completes it.
        spec = gang_spec(job, attempt, ranks.values())
        return _intend(Step(Attempt.Action.LAUNCH, attempt, spec=spec))
    if not observations:
        if attempt.launched_at is None:
            # Stopped before it ever started: nothing to signal.
            return Step(FINISH, attempt, event)
        if attempt.launched_at != launched_at:
            # Launched by another worker after this pass observed the runtime.
            return None
        # The runtime forgot a gang it launched: its ranks are lost.
        observations = [
            RankObservation(
                job.pk,
                attempt.number,
                r.index,
                r.node,
                "lost",
                None,
                "",
                None,
                now.timestamp(),
                None,
            )
            for r in ranks.values()
        ]
    _record_observations(ranks, observations)
    phases = {index: rank.state for index, rank in ranks.items()}
    alive = [i for i, phase in phases.items() if phase not in TERMINAL_PHASES]

    if (job.state == JobState.ADMITTED and not alive) or (
        job.state == JobState.ADMITTED and all(p != "starting" for p in phases.values())
    ):
        Job.objects.filter(pk=job.pk, state=JobState.ADMITTED).update(
            state=JobState.RUNNING, running_at=now
        )

    if event is None and alive:
        stuck = _stuck_at_start(attempt, observations, now)
        if stuck:
            event = request_stop(job=job, reason="gang-guard", cause=stuck, grace_seconds=0)
            if event is not None:
                notify(
                    job_id=job.pk,
                    event="preempted",
                    payload={"reason": "gang-guard", "cause": event.cause},
                )

    if event is None:
        broken = [
            r
            for r in ranks.values()
            if r.state == "lost" or (r.state == "exited" and r.exit_code not in (0, None))
        ]
        if (broken or taken) and alive:
            first = broken[0] if broken else None
            if first is None:
                cause = "a rank was taken away by the cluster"
            elif first.state == "lost":
                cause = f"rank {first.index} was lost"
            else:
                cause = rank_end_words(first)
            event = request_stop(job=job, reason="gang-guard", cause=f"gang guard: {cause}")
            if event is not None:
                notify(
                    job_id=job.pk,
                    event="preempted",
                    payload={"reason": "gang-guard", "cause": event.cause},
                )

    if event is not None and alive:
        if event.signal_sent_at is None:
            if (
                now >= event.deadline
                and attempt.action == Attempt.Action.SIGNAL
                and attempt.action_tries > 0
            ):
                # The signal has not got through by the deadline (a
                # PodDisruptionBudget refusing the evictions): the deadline wins,
                # as it does for a rank that ignores SIGTERM.
                return _intend(Step(Attempt.Action.KILL, attempt, event, alive=alive))
            held, notice = _notice_first(attempt, event, alive, delivery, now)
            if held:
                return notice
            return _intend(Step(Attempt.Action.SIGNAL, attempt, event, alive=alive))
        if now >= event.deadline:
            return _intend(Step(Attempt.Action.KILL, attempt, event, alive=alive))
        return None
    if not alive:
        return Step(FINISH, attempt, event)
    return None


def _notice_first(
    attempt: Attempt,
    event: PreemptionEvent,
    alive: list[int],
    delivery: str | None,
    now: datetime,
) -> tuple[bool, Step | None]:
    """Whether the eviction still waits for the checkpoint notice, and the notice
    to deliver now if any (see preemption.notice). The eviction goes ahead when
    the victim gets no notice, when its ranks committed a checkpoint that
    answered it (the first rank's report, see `notice_committed_at`), or at the
    notice deadline."""
    if event.notice_deadline is None:
        plan = notice_plan(event=event, attempt=attempt, delivery=delivery, now=now)
        if plan is None:
            return False, None
        PreemptionEvent.objects.filter(pk=event.pk, notice_deadline__isnull=True).update(
            notice_deadline=plan.deadline
        )
        event.notice_deadline = plan.deadline
        step = Step(Attempt.Action.NOTICE, attempt, event, alive=alive, notice_signal=plan.signal)
        return True, _intend(step)
    if now >= event.notice_deadline:
        return False, None
    if event.notice_sent_at is None:
        # Not delivered yet: a temporary runtime error is tried again until the deadline.
        signal = announced_notice(attempt, delivery)
        if signal is None:
            return False, None
        step = Step(Attempt.Action.NOTICE, attempt, event, alive=alive, notice_signal=signal)
        return True, _intend(step)
    if event.notice_committed_at is not None:
        return False, None  # recorded by the events endpoint as the commit came in
    if record_notice_commit(event, attempt) is None:
        return True, None
    return False, None


def _intend(step: Step) -> Step:
    """Record the action on the attempt; a new action starts its tries afresh."""
    if step.attempt.action != step.action:
        Attempt.objects.filter(pk=step.attempt.pk, ended_at__isnull=True).update(
            action=step.action,
            action_claimed_at=None,
            action_tries=0,
            action_error="",
            action_not_before=None,
        )
        step.attempt.action, step.attempt.action_tries = step.action, 0
    return step


# --- act --------------------------------------------------------------------------


def act(steps: list[Step], runtime: Runtime) -> None:
    """Carry out what the decide step recorded, with no transaction open.

    Each action is claimed first, so a second worker with the same decision does
    nothing; the runtime calls of one pass go out side by side, and their
    outcomes are recorded together in one short transaction."""
    _carry_out([step for step in steps if step.action != FINISH], runtime)
    finishing = [step for step in steps if step.action == FINISH]
    if finishing:
        _finish(finishing, runtime)


def _carry_out(steps: list[Step], runtime: Runtime) -> None:
    if any(step.action == Attempt.Action.LAUNCH for step in steps) and launches_held():
        steps = [step for step in steps if step.action != Attempt.Action.LAUNCH]
    if not steps:
        return
    with transaction.atomic():
        claim, claimed = _claim(steps)
    calls = [functools.partial(_call, step, runtime) for step in claimed]
    side_by_side = min(getattr(runtime, "calls_side_by_side", PARALLEL_ACTIONS), len(calls))
    if side_by_side > 1:
        with ThreadPoolExecutor(max_workers=side_by_side) as pool:
            errors = list(pool.map(lambda call: call(), calls))
    else:
        errors = [call() for call in calls]
    outcomes = list(zip(claimed, errors, strict=True))
    with transaction.atomic():
        # The common outcome, a launch or a forget that went through, is recorded
        # for all of them at once; anything else attempt by attempt.
        plain = _record_plain_outcomes([step for step, error in outcomes if error is None], claim)
        for step, error in outcomes:
            if step.attempt.pk not in plain:
                _guarded(
                    step.attempt,
                    functools.partial(_record_outcome, step, claim, error),
                    savepoint=True,
                )


def _claim(steps: list[Step]) -> tuple[datetime, list[Step]]:
    """Claim the steps' actions, one conditional update per kind of action however
    many attempts: the claim time and the steps claimed. An attempt whose action
    changed, or that another worker claimed (and whose lease has not run out), is
    left out. The rows are locked in the order of their jobs' ids first, the order
    in which the decide step and the scheduling cycle take their locks."""
    now = timezone.now()
    by_action: dict[str, dict[int, Step]] = defaultdict(dict)
    for step in steps:
        by_action[step.action].setdefault(step.attempt.pk, step)
    claimed: list[Step] = []
    for action, group in by_action.items():
        claimable = Attempt.objects.filter(pk__in=group, action=action).filter(
            Q(action_claimed_at__isnull=True) | Q(action_claimed_at__lt=now - ACTION_LEASE),
            Q(action_not_before__isnull=True) | Q(action_not_before__lte=now),
        )
        if action == Attempt.Action.LAUNCH:
            claimable = claimable.filter(launched_at__isnull=True, ended_at__isnull=True)
        mine = list(
            claimable.select_for_update().order_by("job_id", "pk").values_list("pk", flat=True)
        )
        if mine:
            Attempt.objects.filter(pk__in=mine).update(action_claimed_at=now)
        claimed += [group[pk] for pk in mine]
    return now, claimed


DONE = {
    "action": Attempt.Action.NONE,
    "action_claimed_at": None,
    "action_tries": 0,
    "action_error": "",
    "action_not_before": None,
}


def _record_plain_outcomes(steps: list[Step], claim: datetime) -> set[int]:
    """Record the calls that went through, a fixed number of statements however
    many; the ids of the attempts recorded (those whose claim is still this pass's).
    What `_record_outcome` records for each: the action done, a launch's time, a
    signal's or a notice's on its preemption (and a signal's on the ranks it was
    sent to), a kill's. A cycle that preempts two thousand jobs has as many signals
    to record at the next pass.

    Each launch keeps the moment its own call returned. Those times are written in
    one statement (core.rows.update_rows): as a CASE with a WHEN per attempt, Django
    spent about 1 ms per launch building it, a third of a launch batch's time on
    the benchmark against Kueue, and a short job that ended meanwhile could not be
    closed before its launch was recorded (`_plain`)."""
    now = timezone.now()
    recorded: set[int] = set()
    for action in PLAIN_OUTCOMES:
        group = {step.attempt.pk: step for step in steps if step.action == action}
        if not group:
            continue
        mine = Attempt.objects.filter(pk__in=group, action_claimed_at=claim)
        locked = list(
            mine.select_for_update().order_by("job_id", "pk").values_list("pk", flat=True)
        )
        if not locked:
            continue
        if action == Attempt.Action.LAUNCH:
            # A launch is claimed only while none is recorded (`_claim`), and only its
            # claim's holder records one: these rows, held since the line above, have
            # none yet.
            attempts = []
            for pk in locked:
                attempt = group[pk].attempt
                for name, value in DONE.items():
                    setattr(attempt, name, value)
                attempt.launched_at = group[pk].returned_at or now
                attempts.append(attempt)
            update_rows(attempts, [*DONE, "launched_at"])
        else:
            Attempt.objects.filter(pk__in=locked).update(**DONE)
            done = [group[pk] for pk in locked]
            if action == Attempt.Action.SIGNAL:
                _signals_sent(done, now)
            elif action == Attempt.Action.NOTICE:
                _sent_at_once(done, "notice_sent_at", now)
            elif action == Attempt.Action.KILL:
                _kills_done(done, now)
        recorded.update(locked)
    return recorded


PLAIN_OUTCOMES = (
    Attempt.Action.LAUNCH,
    Attempt.Action.NOTICE,
    Attempt.Action.SIGNAL,
    Attempt.Action.KILL,
    Attempt.Action.FORGET,
)


def _stops(steps: list[Step]) -> dict[int, Step]:
    """The steps by the id of the preemption they carry out."""
    by_event: dict[int, Step] = {}
    for step in steps:
        assert step.event is not None
        by_event[step.event.pk] = step
    return by_event


def _sent_at_once(steps: list[Step], name: str, now: datetime) -> None:
    """Write on each step's preemption, where it has none yet, the moment its call
    began (`name`: signal_sent_at or notice_sent_at), one statement for them all."""
    by_event = _stops(steps)
    unsent = (
        PreemptionEvent.objects.select_for_update()
        .filter(pk__in=by_event, **{f"{name}__isnull": True})
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    update_rows(
        [PreemptionEvent(pk=pk, **{name: by_event[pk].called_at or now}) for pk in unsent], [name]
    )


def _signals_sent(steps: list[Step], now: datetime) -> None:
    """`_signal_sent` for every step at once: on the ranks it was sent to and on its
    preemption, where none was recorded before. Ranks first, as the trap's events
    take them (`preemption.ingest`: the rank's row, then its preemption): in the
    other order a pass and a rank's report could each hold what the other waits for."""
    by_attempt = {step.attempt.pk: step for step in steps}
    alive = {pk: set(step.alive) for pk, step in by_attempt.items()}
    unsent = (
        Rank.objects.select_for_update()
        .filter(attempt_id__in=by_attempt, signal_sent_at__isnull=True)
        .order_by("attempt_id", "index")
        .values_list("pk", "attempt_id", "index")
    )
    update_rows(
        [
            Rank(pk=pk, signal_sent_at=by_attempt[attempt_id].called_at or now)
            for pk, attempt_id, index in unsent
            if index in alive[attempt_id]
        ],
        ["signal_sent_at"],
    )
    _sent_at_once(steps, "signal_sent_at", now)


def _kills_done(steps: list[Step], now: datetime) -> None:
    """Record each step's kill on its preemption, where none was recorded before,
    and that a disruption budget was overridden where it was (`Step.forced`)."""
    by_event = _stops(steps)
    for forced in (False, True):
        events = [pk for pk, step in by_event.items() if step.forced == forced]
        if not events:
            continue
        killed: dict[str, Any] = {"killed_at": now}
        if forced:
            killed["outcome"] = PreemptionEvent.Outcome.FORCED
        PreemptionEvent.objects.filter(pk__in=events, killed_at__isnull=True).update(**killed)


def _call(step: Step, runtime: Runtime) -> Exception | None:
    """Make the runtime call; returns its error, translated, or None.

    Runs in a pool thread: it touches the runtime only, never the database."""
    step.called_at = timezone.now()
    try:
        if step.action == Attempt.Action.LAUNCH:
            assert step.spec is not None
            runtime.launch(step.spec)
            step.returned_at = timezone.now()
        elif step.action == Attempt.Action.NOTICE:
            deliver = getattr(runtime, "notice", None)
            if deliver is not None:
                deliver(step.gang, step.notice_signal)
        elif step.action == Attempt.Action.SIGNAL:
            assert step.event is not None
            remaining = max(0.0, (step.event.deadline - timezone.now()).total_seconds())
            runtime.signal(step.gang, remaining)
        elif step.action == Attempt.Action.KILL:
            if step.event is not None and step.event.signal_sent_at is None:
                step.forced = _eviction_refused(runtime, step.gang)
            runtime.kill(step.gang)
        elif step.action == Attempt.Action.FORGET:
            runtime.forget(step.gang)
    except (RuntimeTemporaryError, RuntimePermanentError) as error:
        return error
    except Exception as error:
        # A runtime that let a library's exception through: treat it as one that
        # may pass, so it is retried and counted rather than lost.
        logger.exception("%s of %s raised an untranslated error", step.action, step.gang)
        return RuntimeTemporaryError(f"{type(error).__name__}: {error}")
    return None


def _record_outcome(step: Step, claim: datetime, error: Exception | None) -> None:
    """Record what the runtime call did, in one short transaction."""
    mine = Attempt.objects.filter(pk=step.attempt.pk, action_claimed_at=claim)
    done = DONE
    now = timezone.now()
    with transaction.atomic():
        if isinstance(error, RuntimeTemporaryError):
            tries = step.attempt.action_tries + 1
            message = str(error)[:300]
            if step.action == Attempt.Action.LAUNCH and tries >= settings.QM_RUNTIME_TRIES:
                if mine.update(**done) == 1:
                    _fail_launch(
                        step.attempt.job,
                        step.attempt,
                        f"launch gave up after {tries} tries: {message}",
                        now,
                    )
                return
            if step.action == Attempt.Action.FORGET and tries >= settings.QM_RUNTIME_TRIES:
                # The attempt has ended; only the runtime's bookkeeping stays behind.
                mine.update(**{**done, "action_error": f"forget gave up: {message}"[:300]})
                return
            backoff = min(settings.QM_RUNTIME_RETRY_SECONDS * 2 ** (tries - 1), MAX_RETRY_SECONDS)
            logger.warning(
                "%s of %s failed (try %d), retrying in %.0f s: %s",
                step.action,
                step.gang,
                tries,
                backoff,
                message,
            )
            mine.update(
                action_claimed_at=None,
                action_tries=tries,
                action_error=message,
                action_not_before=now + timedelta(seconds=backoff),
            )
            return
        if isinstance(error, RuntimePermanentError):
            _permanent(step, mine, done, str(error), now)
            return
        if mine.update(**done) != 1:
            return
        if step.action == Attempt.Action.LAUNCH:
            Attempt.objects.filter(pk=step.attempt.pk, launched_at__isnull=True).update(
                launched_at=step.returned_at or now
            )
        elif step.action == Attempt.Action.NOTICE:
            assert step.event is not None
            PreemptionEvent.objects.filter(pk=step.event.pk, notice_sent_at__isnull=True).update(
                notice_sent_at=step.called_at or now
            )
        elif step.action == Attempt.Action.SIGNAL:
            assert step.event is not None
            _signal_sent(step, step.called_at or now)
        elif step.action == Attempt.Action.KILL:
            assert step.event is not None
            killed: dict[str, Any] = {"killed_at": now}
            if step.forced:
                killed["outcome"] = PreemptionEvent.Outcome.FORCED
            PreemptionEvent.objects.filter(pk=step.event.pk, killed_at__isnull=True).update(
                **killed
            )


def _signal_sent(step: Step, sent: datetime) -> None:
    """The signal's time on the ranks it was sent to, then on its preemption (the
    order of `_signals_sent`)."""
    assert step.event is not None
    Rank.objects.filter(
        attempt=step.attempt, signal_sent_at__isnull=True, index__in=step.alive
    ).update(signal_sent_at=sent)
    PreemptionEvent.objects.filter(pk=step.event.pk, signal_sent_at__isnull=True).update(
        signal_sent_at=sent
    )


def _permanent(
    step: Step, mine: QuerySet[Attempt], done: dict[str, Any], message: str, now: datetime
) -> None:
    """A call that can never succeed as asked fails that attempt with its reason,
    except a signal, which the deadline's kill follows as for a rank that ignores
    it, and a forget, whose gang has already ended."""
    logger.warning("%s of %s failed for good: %s", step.action, step.gang, message)
    if step.action == Attempt.Action.SIGNAL:
        if mine.update(**{**done, "action_error": f"signal failed: {message}"[:300]}) == 1:
            _signal_sent(step, step.called_at or now)
        return
    if step.action == Attempt.Action.FORGET:
        mine.update(**{**done, "action_error": f"forget failed: {message}"[:300]})
        return
    if step.action == Attempt.Action.NOTICE:
        # A courtesy that cannot be delivered: the eviction follows at once.
        if mine.update(**{**done, "action_error": f"notice failed: {message}"[:300]}) == 1:
            assert step.event is not None
            PreemptionEvent.objects.filter(pk=step.event.pk, notice_sent_at__isnull=True).update(
                notice_deadline=now
            )
        return
    if mine.update(**done) != 1:
        return
    if step.action != Attempt.Action.LAUNCH:
        message = f"stopping the gang failed: {message}"
    _fail_launch(step.attempt.job, step.attempt, message, now)


def _forget_finished(job_ids: list[int] | None, runtime: Runtime) -> None:
    """Forget the gangs of finished attempts whose forget failed for a while."""
    now = timezone.now()
    attempts = Attempt.objects.filter(
        Q(action_claimed_at__isnull=True) | Q(action_claimed_at__lt=now - ACTION_LEASE),
        Q(action_not_before__isnull=True) | Q(action_not_before__lte=now),
        ended_at__isnull=False,
        action=Attempt.Action.FORGET,
    ).select_related("job")
    if job_ids is not None:
        attempts = attempts.filter(job_id__in=job_ids)
    steps = [Step(Attempt.Action.FORGET, attempt) for attempt in attempts[:100]]
    if steps:
        act(steps, runtime)


def _stuck_at_start(attempt: Attempt, observations: list[RankObservation], now: datetime) -> str:
    """Why the attempt must fail: a rank waiting on something that will not come
    (an image it cannot pull, a node that cannot take it) past the start timeout."""
    if attempt.launched_at is None:
        return ""
    waited = (now - attempt.launched_at).total_seconds()
    if waited < settings.QM_START_TIMEOUT_SECONDS:
        return ""
    for obs in sorted(observations, key=lambda o: o.rank):
        if obs.phase == "starting" and obs.waiting_reason in STUCK_REASONS:
            return (
                f"rank {obs.rank} could not start: {obs.waiting_reason} for over "
                f"{settings.QM_START_TIMEOUT_SECONDS:g} s"
            )
    return ""


def _eviction_refused(runtime: Runtime, gang: GangId) -> bool:
    """Whether a disruption budget still refuses the gang's evictions at its
    deadline. The signal may have been tried by another worker process, whose
    runtime alone remembers the refusal, so a runtime that can be refused and
    remembers nothing is asked once more, with no grace left."""
    blocked = getattr(runtime, "eviction_blocked", None)
    if blocked is None:
        return False
    if blocked(gang):
        return True
    try:
        runtime.signal(gang, 0.0)
    except RuntimeTemporaryError:
        return bool(blocked(gang))
    except RuntimePermanentError:
        return False
    return False


def _record_observations(ranks: dict[int, Rank], observations: list[RankObservation]) -> None:
    """Write what changed, and only that."""
    for obs in observations:
        rank = ranks.get(obs.rank)
        if rank is None:
            continue
        changes = _rank_changes(rank, obs)
        if changes:
            for name, value in changes.items():
                setattr(rank, name, value)
            rank.save(update_fields=list(changes))


def _rank_changes(rank: Rank | RankRow, obs: RankObservation) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    state = obs.phase if obs.phase in RANK_STATES else "lost"
    if rank.state != state and rank.state not in TERMINAL_PHASES:
        changes["state"] = state
    if obs.exit_code is not None and rank.exit_code != obs.exit_code:
        changes["exit_code"] = obs.exit_code
    if obs.handle:
        if obs.handle.isdigit():
            if rank.pid != int(obs.handle):
                changes["pid"] = int(obs.handle)
        elif rank.pod_name != obs.handle:
            changes["pod_name"] = obs.handle
    if obs.started_at is not None and rank.started_at is None:
        changes["started_at"] = _when(obs.started_at)
    if obs.exited_at is not None and rank.exited_at is None:
        changes["exited_at"] = _when(obs.exited_at)
    if obs.signal_sent_at is not None and rank.signal_sent_at is None:
        changes["signal_sent_at"] = _when(obs.signal_sent_at)
    if obs.end_reason in Rank.EndReason.values and rank.end_reason != obs.end_reason:
        changes["end_reason"] = obs.end_reason
        changes["memory_limit"] = obs.memory_limit
    return changes


@dataclass(frozen=True, slots=True)
class RankRow:
    """What a pass compares of a rank with the runtime's observation of it."""

    state: str
    exit_code: int | None
    pid: int | None
    pod_name: str
    started_at: datetime | None
    exited_at: datetime | None
    signal_sent_at: datetime | None
    end_reason: str
    memory_limit: int | None


@dataclass(slots=True)
class OpenAttempt:
    """What a pass needs of an open attempt to tell whether it is steady."""

    pk: int
    job_id: int
    number: int
    launched: bool
    action: str
    job_state: str
    stopping: bool
    ranks: dict[int, RankRow] = field(default_factory=dict)


def _open_attempts(job_ids: list[int] | None) -> list[OpenAttempt]:
    """The open attempts of active jobs (of `job_ids` only, if given), read as
    plain rows: most are steady on most passes, and a pass four times a second
    over a few hundred running jobs spent most of its time building their
    attempts, jobs, teams and ranks as model objects. Those it must decide on
    are read again, whole, after this read (`_reconcile`)."""
    attempts = Attempt.objects.filter(ended_at__isnull=True, job__state__in=ACTIVE_STATES)
    if job_ids is not None:
        attempts = attempts.filter(job_id__in=job_ids)
    rows = {
        pk: OpenAttempt(pk, job_id, number, launched, action, job_state, stopping)
        for pk, job_id, number, launched, action, job_state, stopping in attempts.values_list(
            "pk",
            "job_id",
            "number",
            Q(launched_at__isnull=False),
            "action",
            "job__state",
            Q(preemption__isnull=False),
        )
    }
    if not rows:
        return []
    ranks = Rank.objects.filter(attempt__in=attempts).values_list(
        "attempt_id", "index", *(f.name for f in dataclasses.fields(RankRow))
    )
    for attempt_id, index, *fields in ranks:
        row = rows.get(attempt_id)
        if row is not None:
            row.ranks[index] = RankRow(*fields)
    return sorted(rows.values(), key=lambda row: (row.job_id, row.pk))


def _steady(row: OpenAttempt, observations: list[RankObservation], taken: bool) -> bool:
    """True when the decide step would change nothing: a launched gang of a
    running job, no stop asked, every rank running as last recorded. Most open
    attempts are so on most passes, and on SQLite each decide transaction
    takes the database's write lock, so these skip it."""
    if taken or not row.launched or row.action or row.job_state != JobState.RUNNING or row.stopping:
        return False
    ranks = row.ranks
    return len(observations) == len(ranks) and all(
        obs.phase == "running" and obs.rank in ranks and not _rank_changes(ranks[obs.rank], obs)
        for obs in observations
    )


def ingest_logs(job: Job, attempt: Attempt, ranks: Iterable[Rank], runtime: Runtime) -> int:
    """Read every rank's QM_EVENT lines so no event is lost when its POST was.

    Each log is streamed a chunk at a time and its events ingested as they are
    found, so a log of any length costs one chunk and one line of memory; a log
    that cannot be read to its end keeps the events found before."""

    added = 0
    gang = GangId(job.pk, attempt.number)
    for rank in ranks:
        try:
            for event in iter_trap_events_in_chunks(iter_log_chunks(runtime, gang, rank.index)):
                try:
                    added += ingest_trap_event(attempt=attempt, event=event, source="log")
                except Exception as exc:
                    logger.warning("ignoring a refused trap event in %s: %s", rank, exc)
        except (RuntimeTemporaryError, RuntimePermanentError, OSError):
            logger.warning("could not read the log of %s", rank, exc_info=True)
    return added


def _fail_launch(job: Job, attempt: Attempt, message: str, now: datetime) -> None:
    Attempt.objects.filter(pk=attempt.pk, ended_at__isnull=True).update(
        ended_at=now, end_reason=Attempt.EndReason.FAILED
    )
    Job.objects.filter(pk=job.pk).update(
        state=JobState.FAILED, finished_at=now, failure_reason=message[:300]
    )
    notify(job_id=job.pk, event="failed", payload={"reason": message[:300]})


def _finish(steps: list[Step], runtime: Runtime) -> None:
    """Every rank has exited, or the attempt was stopped before it started: read
    the ranks' logs and the ports each gang left behind with no transaction
    open, close the attempts in one short transaction, then forget the gangs."""
    held = _held_ports([step for step in steps if step.attempt.launched_at is not None], runtime)
    recorded = _recorded_ranks([step.attempt for step in steps])
    closing: list[tuple[Step, list[Rank], list[int]]] = []
    for step in steps:
        ranks = recorded.get(step.attempt.pk, [])
        if _guarded(step.attempt, functools.partial(_ingest_ends, step, ranks, runtime)):
            closing.append((step, ranks, held.get(step.gang, [])))
    closed: list[tuple[Step, list[Rank]]] = []
    disrupted = _disruptions([item for item in closing if item[0].event is None], runtime)
    with transaction.atomic():
        # Gangs that ended on their own with every rank exiting 0, the common end,
        # are closed together in a fixed number of queries; the rest one by one.
        succeeded = [
            item
            for item in closing
            if item[0].event is None
            and not _broken(item[1])
            and item[0].attempt.pk not in disrupted
        ]
        together = _close_succeeded_together(succeeded, timezone.now())
        batched: set[int] = set()
        if together is not None:
            # A stop decided since this pass read the attempts leaves them to the
            # one-by-one close, which judges whether it reached them.
            batched = {step.attempt.pk for step, _, _ in succeeded} - together.stopped
        for step, ranks, orphaned in closing:
            attempt = step.attempt
            if attempt.pk in batched:
                assert together is not None
                if attempt.pk in together.closed:
                    attempt.action, attempt.action_tries = Attempt.Action.FORGET, 0
                    closed.append((Step(Attempt.Action.FORGET, attempt), ranks))
                continue
            close = functools.partial(
                _finish_attempt,
                attempt.job,
                attempt,
                ranks,
                step.event,
                orphaned,
                timezone.now(),
                disruption=disrupted.get(attempt.pk, ""),
            )
            if _guarded(attempt, close, savepoint=True):
                attempt.action, attempt.action_tries = Attempt.Action.FORGET, 0
                closed.append((Step(Attempt.Action.FORGET, attempt), ranks))
    # Runtimes whose logs go away with the gang (Kubernetes) keep each rank's
    # last lines first: log reads are runtime calls, so no transaction is open.
    for step, ranks in closed:
        _guarded(step.attempt, functools.partial(save_log_tails, step.attempt, ranks, runtime))
    _carry_out([step for step, _ in closed], runtime)


def _disruptions(
    closing: list[tuple[Step, list[Rank], list[int]]], runtime: Runtime
) -> dict[int, str]:
    """The ended attempts, of those with no stop on record, that something outside
    the control plane stopped, with why in words (`disruption_words`): a rank the
    runtime saw taken away (a drain's eviction, which carries no mark of ours), or a
    rank whose trap reported a signal that the control plane never sent (a host's
    shutdown, a person's kill). Such a gang may end with every rank exiting 0, its
    trap having checkpointed on that signal, but its work is not done. One query,
    read after the ranks' trap events were ingested, plus what the runtime's gang
    guard kept from its last observation."""
    if not closing:
        return {}
    received: dict[int, list[int]] = defaultdict(list)
    for attempt_id, index in Rank.objects.filter(
        attempt_id__in=[step.attempt.pk for step, _, _ in closing],
        signal_received_at__isnull=False,
        signal_sent_at__isnull=True,
    ).values_list("attempt_id", "index"):
        received[attempt_id].append(index)
    guard = runtime.gang_guard
    words: dict[int, str] = {}
    for step, ranks, _ in closing:
        taken: dict[int, str] = {}
        if guard is not None and step.attempt.launched_at is not None:
            taken = guard.taken_ranks(step.gang)
        # A rank the control plane signalled was stopped by it; one evicted past a
        # limit of its own (its memory, its disk) ended by its own doing.
        excused = {
            rank.index for rank in ranks if rank.signal_sent_at is not None or rank.end_reason
        }
        taken = {index: why for index, why in taken.items() if index not in excused}
        if taken or received.get(step.attempt.pk):
            words[step.attempt.pk] = disruption_words(
                nodes={rank.index: rank.node for rank in ranks},
                taken=taken,
                received=received.get(step.attempt.pk, []),
            )
    return words


def _held_ports(steps: list[Step], runtime: Runtime) -> dict[GangId, list[int]]:
    """The ports each launched gang still holds, asked of the runtime in one call
    (none known when the runtime cannot tell)."""
    if not steps:
        return {}
    try:
        return runtime.released_ports([step.gang for step in steps])
    except (RuntimeTemporaryError, RuntimePermanentError):
        logger.warning("reading the ports of ended gangs failed", exc_info=True)
        return {}


def _recorded_ranks(attempts: list[Attempt]) -> dict[int, list[Rank]]:
    """Each attempt's ranks as last recorded, in the order of their indexes, in one query."""
    ranks: dict[int, list[Rank]] = defaultdict(list)
    for rank in Rank.objects.filter(attempt__in=attempts).order_by("attempt_id", "index"):
        ranks[rank.attempt_id].append(rank)
    return ranks


def _ingest_ends(step: Step, ranks: list[Rank], runtime: Runtime) -> bool:
    """Ingest the trap events in the ended ranks' logs; True once done."""
    ingest_logs(step.attempt.job, step.attempt, ranks, runtime)
    return True


def _broken(ranks: list[Rank]) -> bool:
    """Whether a rank was lost or exited non-zero."""
    return any(rank.state == "lost" or rank.exit_code not in (0, None) for rank in ranks)


@dataclass(frozen=True)
class ClosedTogether:
    """What `_close_succeeded_together` did: the attempts it closed, and those it
    left alone because a stop of theirs was decided after the pass read them."""

    closed: set[int]
    stopped: set[int]


def _close_succeeded_together(
    items: list[tuple[Step, list[Rank], list[int]]], now: datetime
) -> ClosedTogether | None:
    """Close attempts whose every rank exited 0 with no stop asked, as
    `_finish_attempt` closes each, in a fixed number of queries however many:
    the attempts this pass closed (not those another worker closed first).
    None when that failed: nothing of it is kept, and the caller closes them one
    by one, so one attempt's trouble stays its own."""
    if not items:
        return ClosedTogether(set(), set())
    try:
        with transaction.atomic():
            return _close_succeeded(items, now)
    except SoftTimeLimitExceeded:
        raise
    except Exception:
        if transaction.get_connection().needs_rollback:
            raise
        logger.exception("closing %d ended attempts together failed; one by one", len(items))
        return None


def _close_succeeded(
    items: list[tuple[Step, list[Rank], list[int]]], now: datetime
) -> ClosedTogether:
    by_attempt = {step.attempt.pk: (step, ranks, orphaned) for step, ranks, orphaned in items}
    job_ids = sorted({step.attempt.job_id for step, _, _ in items})
    # The jobs' rows first, in the order of their ids, as the decide step and the
    # scheduling cycle lock them; then the attempts still open. A job another
    # transaction holds is left to it and to the next pass, as in `_lock_rows`.
    resume_steps = dict(
        Job.objects.select_for_update(no_key=True, skip_locked=True)
        .filter(pk__in=job_ids)
        .order_by("pk")
        .values_list("pk", "resume_step")
    )
    still_open = list(
        Attempt.objects.select_for_update()
        .filter(pk__in=by_attempt, job_id__in=list(resume_steps), ended_at__isnull=True)
        .order_by("job_id", "pk")
        .values_list("pk", flat=True)
    )
    # The scheduling cycle records a stop with its job's row locked: with the rows
    # held, every stop decided since the pass read these attempts is seen here.
    stopped = set(
        PreemptionEvent.objects.filter(victim_attempt_id__in=still_open).values_list(
            "victim_attempt_id", flat=True
        )
    )
    still_open = [pk for pk in still_open if pk not in stopped]
    if not still_open:
        return ClosedTogether(set(), stopped)
    last_steps = dict(
        Checkpoint.objects.filter(job_id__in=job_ids)
        .order_by()
        .values("job_id")
        .annotate(step=Max("step"))
        .values_list("job_id", "step")
    )
    by_orphaned: dict[tuple[int, ...], list[int]] = defaultdict(list)
    by_resume_step: dict[int | None, list[int]] = defaultdict(list)
    notices = []
    for pk in still_open:
        step, ranks, orphaned = by_attempt[pk]
        job_id = step.attempt.job_id
        by_orphaned[tuple(orphaned)].append(pk)
        last = last_steps.get(job_id)
        by_resume_step[last + 1 if last is not None else resume_steps.get(job_id)].append(job_id)
        codes = [rank.exit_code for rank in ranks]
        notices.append(
            Notice(
                job_id=job_id, event="finished", payload={"state": "succeeded", "exit_codes": codes}
            )
        )
    for orphaned, pks in by_orphaned.items():
        Attempt.objects.filter(pk__in=pks).update(
            **{**DONE, "action": Attempt.Action.FORGET},
            ended_at=now,
            end_reason=Attempt.EndReason.SUCCEEDED,
            orphaned_ports=list(orphaned),
        )
    for resume_step, jobs in by_resume_step.items():
        Job.objects.filter(pk__in=jobs).update(
            resume_step=resume_step, state=JobState.SUCCEEDED, finished_at=now
        )
    notify_each(notices)
    queue_cycle()
    return ClosedTogether(set(still_open), stopped)


def _finish_attempt(
    job: Job,
    attempt: Attempt,
    ranks: list[Rank],
    event: PreemptionEvent | None,
    orphaned: list[int],
    now: datetime,
    *,
    disruption: str = "",
) -> bool:
    """Free the GPUs and decide what becomes of the job; the gang is to be
    forgotten next. False when another worker closed the attempt first.

    `disruption` says why, where something outside the control plane stopped the
    gang (`_disruptions`): with no stop of the control plane's own, the job is then
    requeued from its checkpoint as preempted by the cluster, whatever its ranks'
    exit codes, and no retry of its own is counted."""
    codes = [rank.exit_code for rank in ranks]
    exited_at = max((rank.exited_at for rank in ranks if rank.exited_at), default=now)
    failed = _broken(ranks)
    # The job's row first, as the scheduling cycle locks it to record a stop: a stop
    # decided since this pass read the attempt is seen below, and one decided later
    # finds the job ended.
    job.refresh_from_db(from_queryset=Job.objects.select_for_update(no_key=True))
    last_step = Checkpoint.objects.filter(job=job).aggregate(step=Max("step"))["step"]
    resume_step = (last_step + 1) if last_step is not None else job.resume_step
    if event is not None:
        event.refresh_from_db()
    else:
        event = PreemptionEvent.objects.filter(victim_attempt=attempt).first()
        if event is not None:
            # Whether that stop was tried since is on the attempt's row.
            attempt.refresh_from_db()
    ended_first = event is not None and _ended_before_the_stop(attempt, ranks, event)

    if event is not None and not ended_first:
        reason = event.reason
        end_reason = {
            "manual": Attempt.EndReason.CANCELLED,
            "gang-guard": Attempt.EndReason.GANG_GUARD,
        }.get(reason, Attempt.EndReason.PREEMPTED)
        if job.cancel_requested_at is not None:
            end_reason = Attempt.EndReason.CANCELLED
    elif disruption:
        end_reason = (
            Attempt.EndReason.CANCELLED
            if job.cancel_requested_at is not None
            else Attempt.EndReason.PREEMPTED
        )
    elif failed:
        end_reason = Attempt.EndReason.FAILED
    else:
        end_reason = Attempt.EndReason.SUCCEEDED

    claimed = Attempt.objects.filter(pk=attempt.pk, ended_at__isnull=True).update(
        ended_at=now,
        end_reason=end_reason,
        orphaned_ports=orphaned,
        action=Attempt.Action.FORGET,
        action_claimed_at=None,
        action_tries=0,
        action_error="",
        action_not_before=None,
    )
    if claimed != 1:
        return False
    if event is not None:
        _close_event(event, attempt, job, exited_at, resume_step, ended_first=ended_first)

    update: dict[str, Any] = {"resume_step": resume_step}
    if end_reason == Attempt.EndReason.SUCCEEDED:
        update.update(state=JobState.SUCCEEDED, finished_at=now)
        notice = ("finished", {"state": "succeeded", "exit_codes": codes})
    elif end_reason == Attempt.EndReason.CANCELLED:
        update.update(state=JobState.CANCELLED, finished_at=now)
        notice = ("finished", {"state": "cancelled", "exit_codes": codes})
    elif end_reason == Attempt.EndReason.PREEMPTED and event is None:
        # Stopped by the cluster, not by the control plane: requeued as a preemption.
        update.update(
            state=JobState.REQUEUED,
            requeued_at=now,
            waiting_reason=disruption_requeue_words(
                disruption, checkpoint_step=last_step, resume_step=resume_step
            )[:300],
        )
        notice = (
            "requeued",
            {"resume_step": resume_step, "reason": "disrupted", "cause": disruption},
        )
    elif end_reason == Attempt.EndReason.PREEMPTED:
        update.update(
            state=JobState.REQUEUED,
            requeued_at=now,
            waiting_reason=(
                shutdown_requeue_words(checkpoint_step=last_step, resume_step=resume_step)
                if event is not None and event.reason == PreemptionEvent.Reason.SHUTDOWN
                else "requeued after preemption; waiting for GPUs"
            ),
        )
        notice = ("requeued", {"resume_step": resume_step, "reason": event.reason if event else ""})
    else:
        # A failed rank. A failure of the job's own (a rank exited non-zero
        # although nobody stopped it) is retried only as often as its submitter
        # asked; a lost rank is the cluster's doing and is retried with backoff
        # until the attempts run out.
        attempts = Attempt.objects.filter(job=job).count()
        broken = next((r for r in ranks if r.state == "lost" or r.exit_code not in (0, None)), None)
        why = (event.cause if event is not None else "") or (
            rank_end_words(broken) if broken else "a rank failed"
        )
        own = _failed_on_its_own(ranks)
        if own and job.retries_used >= job.retries:
            given_up = (
                f"gave up after {job.retries} retr{'y' if job.retries == 1 else 'ies'}"
                if job.retries
                else "not retried: the job asked for no retries"
            )
            update.update(
                state=JobState.FAILED, finished_at=now, failure_reason=f"{why}; {given_up}"[:300]
            )
            notice = ("failed", {"reason": update["failure_reason"], "exit_codes": codes})
        elif attempts >= job.max_attempts:
            update.update(
                state=JobState.FAILED,
                finished_at=now,
                failure_reason=f"{why}; gave up after {attempts} attempts"[:300],
            )
            notice = ("failed", {"reason": update["failure_reason"], "exit_codes": codes})
        else:
            backoff = settings.QM_RETRY_BACKOFF_SECONDS * (2 ** (attempts - 1))
            counted = (
                f"retry {job.retries_used + 1} of {job.retries}"
                if own
                else f"attempt {attempts + 1} of {job.max_attempts}"
            )
            if own:
                update["retries_used"] = job.retries_used + 1
            update.update(
                state=JobState.REQUEUED,
                requeued_at=now,
                not_before=now + timedelta(seconds=backoff),
                waiting_reason=f"{why}; retrying in {backoff:.0f} s ({counted})"[:300],
            )
            notice = ("requeued", {"reason": why, "resume_step": resume_step})
    Job.objects.filter(pk=job.pk).update(**update)
    notify(job_id=job.pk, event=notice[0], payload=notice[1])
    queue_cycle()
    return True


def shutdown_requeue_words(*, checkpoint_step: int | None, resume_step: int | None) -> str:
    """Why a job stopped by the portal's shutdown waits, and where it resumes."""
    if checkpoint_step is not None:
        where = f"checkpoint at step {checkpoint_step}, resumes at step {resume_step}"
    elif resume_step is not None:
        where = f"resumes at step {resume_step}"
    else:
        where = "no checkpoint, so it starts over"
    return f"stopped when the portal shut down; {where}"


def _failed_on_its_own(ranks: list[Rank]) -> bool:
    """True when a rank exited non-zero before anyone asked it to stop, and no
    rank was lost: the job's own failure, not the cluster's or the portal's.
    A rank the reconciler signalled (a preemption, a cancel, the gang guard
    stopping the rest, the deadline's kill) does not count, whatever its code."""
    if any(rank.state == "lost" for rank in ranks):
        return False
    return any(
        rank.state == "exited" and rank.exit_code not in (0, None) and rank.signal_sent_at is None
        for rank in ranks
    )


def _ended_before_the_stop(attempt: Attempt, ranks: list[Rank], event: PreemptionEvent) -> bool:
    """Whether the gang finished its work before its stop reached it: every rank
    exited 0 and nothing was ever sent, nor tried, to stop them. A signal is
    recorded as sent from the moment its call began; a call that failed may still
    have reached some ranks, whose trap then stops the others at an agreed step, so
    a stop that was tried at all (its action claimed or counted) rules this out. A
    checkpoint notice stops nothing.

    Judged by what was sent, not by exit times: a Kubernetes container's end is
    known to the second, which could place a rank's graceful exit before the signal
    that caused it."""
    stop_tried = attempt.action in (Attempt.Action.SIGNAL, Attempt.Action.KILL) and (
        attempt.action_tries > 0 or attempt.action_claimed_at is not None
    )
    return (
        bool(ranks)
        and not stop_tried
        and event.signal_sent_at is None
        and event.killed_at is None
        and all(rank.state == "exited" and rank.exit_code == 0 for rank in ranks)
    )


def _close_event(
    event: PreemptionEvent,
    attempt: Attempt,
    job: Job,
    exited_at: datetime,
    resume_step: int | None,
    *,
    ended_first: bool = False,
) -> None:
    if ended_first:
        PreemptionEvent.objects.filter(pk=event.pk).update(
            outcome=PreemptionEvent.Outcome.ENDED_FIRST,
            all_exited_at=exited_at,
            lost_gpu_seconds=0.0,
            requeued_at=None,
            resume_step=None,
        )
        return
    skipped = TrapEvent.objects.filter(
        job=job, attempt=attempt.number, event="checkpoint_skipped"
    ).exists()
    if event.outcome == PreemptionEvent.Outcome.FORCED:
        outcome = PreemptionEvent.Outcome.FORCED
    elif event.killed_at is not None:
        outcome = PreemptionEvent.Outcome.KILLED
    elif skipped:
        outcome = PreemptionEvent.Outcome.CHECKPOINT_SKIPPED
    else:
        outcome = PreemptionEvent.Outcome.GRACEFUL
    last = (
        Checkpoint.objects.filter(job=job, attempt=attempt, committed_at__lte=exited_at)
        .order_by("-committed_at")
        .values_list("committed_at", flat=True)
        .first()
    )
    if last is not None and last >= event.decided_at:
        lost = 0.0
    else:
        base = last or attempt.launched_at or attempt.admitted_at
        lost = max(0.0, (exited_at - base).total_seconds()) * job.gpus
    requeue = (
        # Every stop but a person's own brings the job back.
        event.reason != PreemptionEvent.Reason.MANUAL and job.cancel_requested_at is None
    )
    PreemptionEvent.objects.filter(pk=event.pk).update(
        outcome=outcome,
        all_exited_at=exited_at,
        lost_gpu_seconds=lost,
        requeued_at=timezone.now() if requeue else None,
        resume_step=resume_step if requeue else None,
    )


@dataclass(frozen=True)
class ShutdownReport:
    """What stopping the runtime's ranks with the portal did, and where each job
    requeued by it resumes (its `resume_step`; None to start over)."""

    jobs: int
    ranks: int
    killed: int
    resumes: dict[int, int | None] = field(default_factory=dict)


def _live_ranks(runtime: Runtime) -> dict[GangId, list[RankObservation]]:
    live: dict[GangId, list[RankObservation]] = defaultdict(list)
    for obs in runtime.observe(None):
        if obs.phase not in TERMINAL_PHASES:
            live[GangId(obs.job_id, obs.attempt)].append(obs)
    return dict(live)


def live_rank_count(*, runtime: Runtime | None = None) -> tuple[int, int]:
    """(jobs, ranks) the runtime runs now."""
    live = _live_ranks(runtime or get_runtime())
    return len(live), sum(len(ranks) for ranks in live.values())


# How often the shutdown's close looks again at jobs still stopping, and how long apart.
# `RankShutdown._close_stopped`: passes until the stopped jobs are closed, for at most
# this long (a loaded machine's keepers may record their ranks' ends late).
CLOSE_PASSES_SECONDS = 30.0
CLOSE_PASS_SECONDS = 0.25


class RankShutdown:
    """Stopping every rank the runtime runs because the portal that owns them stops.

    Two steps, so that the ranks hear of the stop at once while the worker still
    finishes its tasks: a supervisor that kills the portal a few seconds after its
    SIGTERM (container runtimes and service managers do) then still leaves ranks
    that were told and checkpoint and exit on their own.

    - `signal_live` records a `shutdown` stop on each live gang's open attempt (so
      the next start requeues the job to resume from its checkpoint instead of
      taking the ranks' clean exit for success) and sends every gang the signal at
      once;
    - `finish`, called once the worker and beat have exited and nothing launches any
      more, does the same for a gang launched meanwhile, waits for each gang's grace
      (counted from its own signal), kills what is left, closes the stopped attempts
      (`_close_stopped`), and reports.
    """

    def __init__(self, *, grace_seconds: float, runtime: Runtime | None = None) -> None:
        self.grace_seconds = grace_seconds
        self.runtime = runtime or get_runtime()
        # Each gang signalled: its rank count then, and when its grace ends (monotonic).
        self.signalled: dict[GangId, tuple[int, float]] = {}

    def signal_live(self) -> tuple[int, int]:
        """Record a stop on every live gang not signalled yet and signal each;
        (jobs, ranks) signalled by this call."""
        live = {
            gang: ranks
            for gang, ranks in _live_ranks(self.runtime).items()
            if gang not in self.signalled
        }
        now = timezone.now()
        for gang in live:
            attempt = Attempt.objects.filter(
                job_id=gang.job_id, number=gang.attempt, ended_at__isnull=True
            ).first()
            if attempt is None:
                continue
            job = Job.objects.select_related("priority_class").get(pk=gang.job_id)
            request_stop(
                job=job,
                reason=PreemptionEvent.Reason.SHUTDOWN,
                cause=(
                    "the portal was stopped; the job resumes from its checkpoint at the next start"
                ),
                grace_seconds=self.grace_seconds,
            )
            PreemptionEvent.objects.filter(
                victim_attempt=attempt, signal_sent_at__isnull=True
            ).update(signal_sent_at=now)
            Rank.objects.filter(attempt=attempt, signal_sent_at__isnull=True).update(
                signal_sent_at=now
            )
        for gang, ranks in live.items():
            self.runtime.signal(gang, self.grace_seconds)
            self.signalled[gang] = (len(ranks), time.monotonic() + self.grace_seconds)
        return len(live), sum(len(ranks) for ranks in live.values())

    def finish(self, *, poll_seconds: float = 0.25) -> ShutdownReport:
        """Signal the gangs launched since `signal_live`, then wait for every gang
        signalled to exit, killing each that outlives its grace."""
        self.signal_live()
        killed: dict[GangId, int] = {}
        while True:
            left = [
                (gang, len(ranks))
                for gang, ranks in _live_ranks(self.runtime).items()
                if gang in self.signalled and gang not in killed
            ]
            if not left:
                break
            now = time.monotonic()
            for gang, ranks in left:
                if self.signalled[gang][1] > now:
                    continue
                self.runtime.kill(gang)
                killed[gang] = ranks
                PreemptionEvent.objects.filter(
                    victim_attempt__job_id=gang.job_id,
                    victim_attempt__number=gang.attempt,
                    killed_at__isnull=True,
                ).update(killed_at=timezone.now())
            if any(gang not in killed for gang, _ in left):
                # Some gang is still within its grace.
                time.sleep(poll_seconds)
        return ShutdownReport(
            jobs=len({gang.job_id for gang in self.signalled}),
            ranks=sum(ranks for ranks, _ in self.signalled.values()),
            killed=sum(killed.values()),
            resumes=self._close_stopped(),
        )

    def _close_stopped(self) -> dict[int, int | None]:
        """Close the attempts of the gangs stopped, as the next start's reconcile
        would, and return where each job requeued resumes.

        The ranks checkpoint on the signal after the web server has gone, so their
        trap's reports by POST are lost and only their logs say which step they
        committed; the pass reads those logs before it decides where the job resumes.
        Left to the next start, the job read as still stopping, from the checkpoint
        before, for as long as the portal was down. Should the pass fail, the next
        start's does the same."""
        job_ids = sorted({gang.job_id for gang in self.signalled})
        if not job_ids:
            return {}
        # A pass may leave a job stopping for a moment yet (a rank's end is recorded
        # by its keeper just after the rank is gone); passes for a bounded time.
        deadline = time.monotonic() + CLOSE_PASSES_SECONDS
        while time.monotonic() < deadline:
            try:
                reconcile_jobs(job_ids=job_ids, runtime=self.runtime)
            except Exception:
                logger.warning(
                    "closing the stopped jobs %s failed; the next start closes them",
                    job_ids,
                    exc_info=True,
                )
                break
            if not Job.objects.filter(pk__in=job_ids, state=JobState.PREEMPTING).exists():
                break
            time.sleep(CLOSE_PASS_SECONDS)
        return dict(
            Job.objects.filter(pk__in=job_ids, state=JobState.REQUEUED)
            .order_by("pk")
            .values_list("pk", "resume_step")
        )


def runtime_shutdown(
    *, grace_seconds: float, runtime: Runtime | None = None, poll_seconds: float = 0.25
) -> ShutdownReport:
    """`RankShutdown`'s two steps at once, where nothing else runs meanwhile."""
    shutdown = RankShutdown(grace_seconds=grace_seconds, runtime=runtime)
    shutdown.signal_live()
    return shutdown.finish(poll_seconds=poll_seconds)
