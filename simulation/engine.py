"""Discrete-event replay of a trace through the real ``fairshare`` engine, in simulated time.

The simulation keeps one heap of timed events (arrivals, completions, victims' exits) and runs a
scheduling cycle on the grid ``k * cycle_seconds`` whenever something changed since the last one,
as the portal's beat does; every event that happened up to a cycle is applied before it, so one
call of :func:`fairshare.plan` decides for all of them.  A victim's exit also queues an extra
cycle at that instant, as an event does in the portal, because a reclaiming team waits on exactly
that exit.  A cycle with no pending job is skipped: the engine only admits pending jobs and only
preempts for them, so it could not decide anything.

How a job runs:

* It needs ``duration`` seconds of work.  Every ``checkpoint_interval`` seconds of work it pauses
  for ``save_seconds`` to commit a checkpoint (not after its last piece of work).
* A victim with a grace window of at least ``save_seconds`` saves at once, exits
  ``save_seconds`` later and loses nothing; otherwise the trap skips the save, the victim exits at
  once and loses the work since its last committed checkpoint.  Its GPUs stay held until it exits.
* A requeued job is pending again as soon as it exits, naming the job it was preempted for
  (``Workload.preemptor``) until that job is admitted: the engine plans that one first, as
  the portal's snapshot has it.  When admitted again it first spends ``restart_seconds``
  restoring its checkpoint (holding its GPUs, doing no work), then continues.
* A job of ``gpus`` GPUs is a gang of ranks: one rank when it fits one node, else
  ``gpus / r`` ranks of ``r`` GPUs, ``r`` the largest divisor of ``gpus`` not above the largest
  node.  Jobs that no placement of the cluster can ever hold are counted and left out.

Elastic jobs (``elastic_share``, see :func:`elastic_jobs` and :func:`elastic_shape`):

* Their work is GPU-seconds: ``duration`` is the time at the largest size, and at ``k`` of its
  ``K`` ranks a job does ``k / K`` of that work per second (linear scaling).  It still commits a
  checkpoint after every ``checkpoint_interval`` of work, which at a smaller size takes
  proportionally longer, as a checkpoint every so many steps does.
* An admission may start one at fewer ranks than it asks for (``Admission.ranks``).
* A resize of the plan (``Plan.resize``) stops the whole gang as an eviction would (it saves
  within the grace window, else loses the work since its last checkpoint) and relaunches it at
  once at the new size on the listed placement, restoring its checkpoint first: it never waits
  in the queue.  The GPUs a shrink gives up stay held until the stop is over (the victim's
  exit), as a terminating workload the engine keeps for the job the shrink is for; those a
  grow takes are held from the decision.
* Cycles also run, with nothing pending, while a gang runs below its largest size: after a
  change that freed GPUs and when its fair-share minimum runtime since its last start or
  resize ends, the moment the engine lets it grow.

Policies:

* ``fairshare``: one queue per team under a root queue holding the whole cluster, each with its
  guarantee and no borrow or lend limit: the engine lends idle guarantees and reclaims them.
* ``static``: the same queues with ``borrow_limit = lend_limit = 0``: nobody borrows or lends.
* ``fifo``: one queue for everybody, strict head of line.  The engine admits a later job when the
  head does not fit (it plans every pending workload at once), so the simulation hands it only the
  head of the line, and asks again for the next one after each admission; placement stays the
  engine's.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any

import fairshare
from simulation.jobs import (
    TOPOLOGY_LEVEL,
    SimJob,
    elastic_jobs,
    elastic_shape,
    gang_fits,
    gang_shape,
)
from simulation.report import JobKey, Ledger, Report
from simulation.traces import ClusterNode, TraceJob

POLICIES = ("fifo", "static", "fairshare")
# What a gang of more than one rank asks of the topology: nothing, all its ranks in one rack
# (it waits until one rack has room), or one rack if any has room (else any nodes).
GANG_TOPOLOGIES = ("none", "required", "preferred")
FLAVOR = "gpu"
ROOT_QUEUE = "cluster"
FIFO_QUEUE = "fifo"
PRIORITY_CLASS = "batch"

# A job preempted this many times means the plans flap (two decisions undoing each other every
# cycle); the replay stops with an error instead of running forever in simulated time.
MAX_PREEMPTIONS_PER_JOB = 1000

_ARRIVAL = 0
_FINISH = 1
_EXIT = 2
# The stop of a shrink is over: the ranks it gave up release their GPUs.
_RELEASE = 3


class SimulationError(ValueError):
    """The replay cannot go on: the engine's plans undo each other (flapping).

    A ValueError, so that callers treating bad input and a failed replay alike need one clause.
    """


@dataclass(frozen=True, slots=True)
class SimulationConfig:
    """Everything a run needs besides the trace."""

    nodes: Sequence[ClusterNode]
    guarantees: Mapping[str, int]
    policy: str = "fairshare"
    checkpoint_interval: float = 1800.0
    save_seconds: float = 30.0
    restart_seconds: float = 60.0
    cycle_seconds: float = 1.0
    grace_seconds: float = 120.0
    seed: int = 0
    # The priority class's minimum runtime per preemption reason ("priority",
    # "fair-share", "reclaim", "consolidate"); a reason left out keeps the engine's default.
    min_runtimes: Mapping[str, float] = field(default_factory=dict)
    # Decayed usage: how strongly each team's recent GPU-seconds beyond its guarantee
    # lower its share of the spare GPUs (0: weight alone), and their half-life.
    usage_strength: float = 0.0
    half_life_seconds: float = 7 * 86_400.0
    # One of GANG_TOPOLOGIES; "required" and "preferred" need nodes with a rack.
    gang_topology: str = "none"
    # The share of the multi-GPU jobs that are elastic (see elastic_jobs); 0: none, and the
    # engine's class cannot shrink anything, so that plans are exactly those of fixed gangs.
    elastic_share: float = 0.0


@dataclass(frozen=True, slots=True)
class Progress:
    """Where a run stands, handed to the progress callback about twice a second."""

    jobs_total: int
    jobs_done: int
    simulated_seconds: float
    plan_calls: int
    running: int
    pending: int
    finished: bool = False


class Simulation:
    """One replay of a trace under one policy; :meth:`run` returns its :class:`Report`."""

    def __init__(
        self,
        trace: Sequence[TraceJob],
        config: SimulationConfig,
        progress: Callable[[Progress], None] | None = None,
        plan: Callable[[Any], Any] | None = None,
    ) -> None:
        if config.policy not in POLICIES:
            raise ValueError(f"unknown policy {config.policy!r} (one of {', '.join(POLICIES)})")
        if not config.nodes:
            raise ValueError("the cluster has no node")
        if config.gang_topology not in GANG_TOPOLOGIES:
            raise ValueError(
                f"unknown gang topology {config.gang_topology!r} (one of {', '.join(GANG_TOPOLOGIES)})"
            )
        if config.gang_topology != "none" and any(
            TOPOLOGY_LEVEL not in node.topology for node in config.nodes
        ):
            raise ValueError(f"gangs that ask for one {TOPOLOGY_LEVEL} need a rack on every node")
        if config.elastic_share and config.gang_topology != "none":
            # The engine refuses an elastic gang that asks for a topology.
            raise ValueError("elastic jobs cannot ask for one rack: leave --gang-topology none")
        self.config = config
        self.progress = progress
        self._plan = plan or fairshare.plan
        self.capacity = sum(node.gpus for node in config.nodes)
        largest = max(node.gpus for node in config.nodes)
        teams = {job.team for job in trace}
        guarantees = dict(config.guarantees)
        for team in teams:
            guarantees.setdefault(team, 0)
        self.guarantees = guarantees
        self.ledger = Ledger(self.capacity, guarantees)
        self.jobs: list[SimJob] = []
        elastic = elastic_jobs(trace, config.elastic_share, config.seed)
        for index, job in enumerate(trace):
            sizes: tuple[int, ...] = ()
            if index in elastic:
                ranks, per_rank, sizes = elastic_shape(job.gpus, largest)
            else:
                ranks, per_rank = gang_shape(job.gpus, largest)
            self.jobs.append(
                SimJob(
                    index,
                    f"{index}",
                    job.name,
                    job.team,
                    job.gpus,
                    ranks,
                    per_rank,
                    job.duration,
                    job.submit_time,
                    sizes=sizes,
                )
            )
        fits_cache: dict[tuple[int, int], bool] = {}
        one_rack = config.gang_topology == "required"
        for sim_job in self.jobs:
            shape = (sim_job.ranks, sim_job.gpus_per_rank)
            if shape not in fits_cache:
                fits_cache[shape] = gang_fits(*shape, config.nodes, one_rack=one_rack)
            if not fits_cache[shape]:
                sim_job.state = "unfit"
        self.nodes = tuple(
            fairshare.Node(node.name, FLAVOR, node.gpus, topology=node.topology)
            for node in config.nodes
        )
        self.queues = self._queues()
        self.priority_classes = (
            fairshare.PriorityClass(
                name=PRIORITY_CLASS,
                value=0,
                preemption_policy="PreemptLowerPriority",
                preemptible=True,
                grace_seconds=config.grace_seconds,
                min_runtime_by_reason=config.min_runtimes,
                shrink_elastic=bool(elastic),
            ),
        )
        self.events: list[tuple[float, int, int, int, int]] = []
        self.checkpoints: list[tuple[float, int, int, int]] = []
        self._sequence = 0
        self.next_cycle = math.inf
        self.running: dict[str, Any] = {}
        # Per team: decayed GPU-seconds up to ``recent_at`` (with decayed usage only). The
        # trace starts as if every team had held exactly its guarantee for ever before: the
        # engine counts only usage beyond that as borrowing, and a team starting from nothing
        # would first have to fill a whole guarantee's worth of decayed GPU-seconds before
        # any borrowing of its counted, which in a run of a few half-lives is most of it.
        horizon = config.half_life_seconds / math.log(2)
        self.recent: dict[str, float] = (
            {team: guarantee * horizon for team, guarantee in guarantees.items()}
            if config.usage_strength
            else {}
        )
        self.recent_at = min((job.submit_time for job in trace), default=0.0)
        self.pending: dict[str, Any] = {}
        self.by_id = {job.id: job for job in self.jobs}
        # Elastic jobs running below their largest size (by index): they may grow.
        self.below_largest: set[int] = set()
        # The ranks shrinks gave up, until their stop is over: (job index, GPUs) by the
        # terminating workload's id.
        self.releasing: dict[str, tuple[int, int]] = {}
        # Requeued victims pending again, by the job each gave way to, until it starts.
        self.gave_way: dict[str, list[SimJob]] = {}
        self.elastic_count = len(elastic)
        self.plan_calls = 0
        self.plan_seconds = 0.0
        self.jobs_done = 0
        self.last_waiting: tuple[Any, ...] = ()

    # Building the engine's view.

    def _queues(self) -> tuple[Any, ...]:
        policy = self.config.policy
        if policy == "fifo":
            quota = fairshare.FlavorQuota(guarantee=self.capacity, borrow_limit=0, lend_limit=0)
            return (fairshare.Queue(FIFO_QUEUE, None, 1.0, {FLAVOR: quota}),)
        root = fairshare.Queue(
            ROOT_QUEUE,
            None,
            1.0,
            {FLAVOR: fairshare.FlavorQuota(guarantee=self.capacity)},
        )
        limit = 0 if policy == "static" else None
        teams = tuple(
            fairshare.Queue(
                team,
                ROOT_QUEUE,
                1.0,
                {
                    FLAVOR: fairshare.FlavorQuota(
                        guarantee=guarantee, borrow_limit=limit, lend_limit=limit
                    )
                },
            )
            for team, guarantee in sorted(self.guarantees.items())
        )
        return (root, *teams)

    def _queue_of(self, job: SimJob) -> str:
        return FIFO_QUEUE if self.config.policy == "fifo" else job.team

    def _topology(self, job: SimJob) -> dict[str, Any]:
        """The workload fields that ask a gang's ranks into one rack (none for one rank)."""
        wanted = self.config.gang_topology
        if wanted == "none" or job.ranks == 1:
            return {}
        return {"topology_level": TOPOLOGY_LEVEL, "topology_required": wanted == "required"}

    def _pending_workload(self, job: SimJob, preemptor: str | None = None) -> Any:
        return fairshare.Workload(
            id=job.id,
            queue=self._queue_of(job),
            priority_class=PRIORITY_CLASS,
            flavor=FLAVOR,
            ranks=job.ranks,
            gpus_per_rank=job.gpus_per_rank,
            state="pending",
            submitted_at=job.submitted_at,
            preemptor=preemptor,
            sizes=job.sizes,
            **self._topology(job),
        )

    def _placed_workload(
        self,
        job: SimJob,
        state: str,
        placement: Any,
        last_checkpoint_at: float | None,
        preemptor: str | None = None,
    ) -> Any:
        return fairshare.Workload(
            id=job.id,
            queue=self._queue_of(job),
            priority_class=PRIORITY_CLASS,
            flavor=FLAVOR,
            ranks=job.running_ranks,
            gpus_per_rank=job.gpus_per_rank,
            state=state,
            submitted_at=job.submitted_at,
            admitted_at=job.admitted_at,
            placement=placement,
            last_checkpoint_at=last_checkpoint_at,
            preemptor=preemptor,
            sizes=job.sizes,
            **self._topology(job),
        )

    # Events.

    def _push(self, at: float, kind: int, job: SimJob) -> None:
        self._sequence += 1
        heapq.heappush(self.events, (at, self._sequence, kind, job.index, job.attempt))

    def _push_release(self, at: float, job: SimJob) -> str:
        """Queue the end of a shrink's stop; the id of its terminating workload."""
        self._sequence += 1
        heapq.heappush(self.events, (at, self._sequence, _RELEASE, job.index, self._sequence))
        return f"{job.id}~{self._sequence}"

    def _cycle_after(self, now: float) -> float:
        cycle = self.config.cycle_seconds
        if cycle <= 0:
            return now
        return math.ceil(now / cycle - 1e-9) * cycle

    def _want_cycle(self, at: float) -> None:
        self.next_cycle = min(self.next_cycle, at)

    # The work model of one attempt.

    def _work_done(self, job: SimJob, now: float) -> tuple[float, float, float | None]:
        """(work done, work committed, time of the last commit in this attempt) at ``now``."""
        elapsed = max(0.0, now - job.work_from)
        interval = self.config.checkpoint_interval
        if interval <= 0:
            return min(job.duration, job.committed + elapsed * job.rate), job.committed, None
        full = int(elapsed // job.period)
        done = (
            job.committed + full * interval + job.rate * min(elapsed - full * job.period, job.step)
        )
        commits = min(full, job.checkpoints_planned)
        committed = job.committed + commits * interval
        last_commit = job.work_from + commits * job.period if commits else None
        return min(job.duration, done), committed, last_commit

    # Handling events.

    def _arrive(self, job: SimJob, now: float) -> None:
        self.ledger.job_submitted(job.team)
        if job.state == "unfit":
            return
        self._make_pending(job, now, requeued=False)

    def _make_pending(
        self, job: SimJob, now: float, *, requeued: bool, gave_way_to: str | None = None
    ) -> None:
        job.state = "pending"
        job.pending_since = now
        job.workload = self._pending_workload(job, gave_way_to)
        self.pending[job.id] = job.workload
        if gave_way_to is not None:
            self.gave_way.setdefault(gave_way_to, []).append(job)
        self.ledger.job_pending(
            job.team, job.gpus, requeued=requeued, job=self._key(job), least=job.least_gpus
        )
        self._want_cycle(self._cycle_after(now))

    @staticmethod
    def _key(job: SimJob) -> JobKey:
        """How the ledger knows a job, in its team's queue order (see report.JobKey)."""
        return (job.submitted_at, job.index, job.name)

    def _admit(self, job: SimJob, placement: Any, now: float) -> None:
        del self.pending[job.id]
        # The jobs that gave way to this one no longer wait for it to be planned first.
        for follower in self.gave_way.pop(job.id, ()):
            if follower.state == "pending" and follower.workload.preemptor == job.id:
                follower.workload = replace(follower.workload, preemptor=None)
                self.pending[follower.id] = follower.workload
        ranks = sum(count for _, count in placement)
        self.ledger.job_admitted(
            job.team,
            job.gpus,
            job=self._key(job),
            least=job.least_gpus,
            holds=ranks * job.gpus_per_rank,
        )
        job.pending_seconds += now - job.pending_since
        job.state = "running"
        self._decay_to(now)
        self._launch(job, ranks, placement, now, now)

    def _launch(self, job: SimJob, ranks: int, placement: Any, now: float, start: float) -> None:
        """Start an attempt of ``job`` at ``ranks`` ranks on ``placement``, decided at
        ``now``; its ranks run from ``start`` (a resize's relaunch, after its stop)."""
        job.attempt += 1
        job.admitted_at = now
        job.running_ranks = ranks
        if ranks == job.ranks:
            job.rate = 1.0
            self.below_largest.discard(job.index)
        else:
            job.rate = ranks / job.ranks
            self.below_largest.add(job.index)
        # A resumed job restores its checkpoint before doing any work.
        job.work_from = start + (self.config.restart_seconds if job.committed > 0 else 0.0)
        remaining = job.duration - job.committed
        interval = self.config.checkpoint_interval
        job.checkpoints_planned = max(0, math.ceil(remaining / interval) - 1) if interval > 0 else 0
        job.step = interval / job.rate
        job.period = job.step + self.config.save_seconds
        finish = (
            job.work_from
            + remaining / job.rate
            + job.checkpoints_planned * self.config.save_seconds
        )
        job.workload = self._placed_workload(job, "running", tuple(placement), None)
        self.running[job.id] = job.workload
        self._push(finish, _FINISH, job)
        if job.checkpoints_planned:
            self._sequence += 1
            heapq.heappush(
                self.checkpoints,
                (job.work_from + job.period, self._sequence, job.index, job.attempt),
            )

    def _stop(
        self, job: SimJob, grace_seconds: float, now: float
    ) -> tuple[float, float, float | None]:
        """Stop the ranks of ``job`` at ``now`` with ``grace_seconds`` to save: the work it
        loses (work seconds at its largest size), when its ranks have exited, and the time
        of its last checkpoint committed before the stop."""
        done, committed, last_commit = self._work_done(job, now)
        save = self.config.save_seconds
        if grace_seconds >= save:
            # The trap saves within the grace window: nothing is lost, the exit waits for the save.
            job.committed = done
            return 0.0, now + save, last_commit
        # Too little grace to save: the trap skips the save and exits at once.
        job.committed = committed
        return done - committed, now, last_commit

    def _preempt(
        self, job: SimJob, grace_seconds: float, now: float, preemptor: str | None = None
    ) -> None:
        lost, exit_at, last_commit = self._stop(job, grace_seconds, now)
        self.below_largest.discard(job.index)
        job.state = "terminating"
        job.preemptions += 1
        if job.preemptions >= MAX_PREEMPTIONS_PER_JOB:
            raise SimulationError(
                f"job {job.name} was preempted {job.preemptions} times by t={now:.0f} s: "
                "the engine's plans flap"
            )
        job.workload = self._placed_workload(
            job, "terminating", job.workload.placement, last_commit, preemptor
        )
        self.running[job.id] = job.workload
        self.ledger.job_preempted(job.team, lost * job.gpus)
        self._push(exit_at, _EXIT, job)

    def _finish(self, job: SimJob, now: float) -> None:
        self._decay_to(now)
        del self.running[job.id]
        job.state = "done"
        job.workload = None
        self.jobs_done += 1
        self.below_largest.discard(job.index)
        self.ledger.gpus_released(job.team, job.held_gpus, finished=True, demand=job.gpus)
        self.ledger.job_finished(
            job.team, now - job.submitted_at, job.pending_seconds, gang=job.ranks > 1
        )
        if self.pending or self.below_largest:
            self._want_cycle(self._cycle_after(now))

    def _exit(self, job: SimJob, now: float) -> None:
        self._decay_to(now)
        del self.running[job.id]
        self.ledger.gpus_released(job.team, job.held_gpus, finished=False)
        # Pending again, it names the job it gave way to, which the engine plans first.
        self._make_pending(job, now, requeued=True, gave_way_to=job.workload.preemptor)
        # The exit of a victim queues an extra cycle right away, as an event does in the portal.
        self._want_cycle(now)

    def _resize(self, job: SimJob, resize: Any, now: float) -> None:
        """Carry out a resize: stop the gang as a victim stops (without requeueing it),
        relaunch it at once at ``resize.ranks`` on ``resize.placement``."""
        old_ranks = job.running_ranks
        old_placement = dict(job.workload.placement)
        lost, stop_at, _ = self._stop(job, self.config.grace_seconds, now)
        self._decay_to(now)
        shrink = resize.ranks < old_ranks
        if shrink:
            # The ranks given up hold their GPUs until the stop is over, kept for the job
            # the shrink is for, as a victim's are.
            for node, ranks in resize.placement:
                old_placement[node] -= ranks
            freed = tuple((node, ranks) for node, ranks in old_placement.items() if ranks > 0)
            part_id = self._push_release(stop_at, job)
            self.running[part_id] = fairshare.Workload(
                id=part_id,
                queue=self._queue_of(job),
                priority_class=PRIORITY_CLASS,
                flavor=FLAVOR,
                ranks=old_ranks - resize.ranks,
                gpus_per_rank=job.gpus_per_rank,
                state="terminating",
                submitted_at=job.submitted_at,
                placement=freed,
                preemptor=resize.for_workload,
            )
            self.releasing[part_id] = (job.index, (old_ranks - resize.ranks) * job.gpus_per_rank)
        else:
            self.ledger.gpus_resized(job.team, (resize.ranks - old_ranks) * job.gpus_per_rank)
        self.ledger.job_resized(job.team, lost * job.gpus, shrink=shrink)
        job.resizes += 1
        if job.resizes >= MAX_PREEMPTIONS_PER_JOB:
            raise SimulationError(
                f"job {job.name} was resized {job.resizes} times by t={now:.0f} s: "
                "the engine's plans flap"
            )
        self._launch(job, resize.ranks, resize.placement, now, stop_at)

    def _release(self, part_id: str, now: float) -> None:
        """The stop of a shrink is over: the ranks it gave up free their GPUs."""
        self._decay_to(now)
        del self.running[part_id]
        index, gpus = self.releasing.pop(part_id)
        self.ledger.gpus_resized(self.jobs[index].team, -gpus)
        self._want_cycle(now)

    def _refresh_checkpoints(self, now: float) -> None:
        """Tell the engine about checkpoints committed since the last cycle (rule R9 uses them)."""
        heap = self.checkpoints
        while heap and heap[0][0] <= now:
            at, _, index, attempt = heapq.heappop(heap)
            job = self.jobs[index]
            if job.state != "running" or job.attempt != attempt:
                continue
            job.workload = self._placed_workload(job, "running", job.workload.placement, at)
            self.running[job.id] = job.workload
            commits = round((at - job.work_from) / job.period)
            if commits < job.checkpoints_planned:
                self._sequence += 1
                heapq.heappush(heap, (at + job.period, self._sequence, index, attempt))

    # The scheduling cycle.

    def _decay_to(self, now: float) -> None:
        """Bring every team's decayed GPU-seconds up to ``now``: the GPUs held since the
        last change count with the weight the half-life gives each second."""
        if not self.config.usage_strength:
            return
        elapsed = now - self.recent_at
        if elapsed <= 0:
            return
        half_life = self.config.half_life_seconds
        factor = 2 ** (-elapsed / half_life)
        gain = half_life / math.log(2) * (1 - factor)
        held: dict[str, int] = {}
        for workload in self.running.values():
            held[workload.queue] = held.get(workload.queue, 0) + workload.gpus
        for team in set(self.recent) | set(held):
            self.recent[team] = self.recent.get(team, 0.0) * factor + held.get(team, 0) * gain
        self.recent_at = now

    def _snapshot(self, now: float, pending: Sequence[Any]) -> Any:
        queues = self.queues
        if self.config.usage_strength:
            self._decay_to(now)
            queues = tuple(
                replace(queue, recent_usage={FLAVOR: self.recent[queue.name]})
                if queue.name in self.recent
                else queue
                for queue in queues
            )
        return fairshare.Snapshot(
            now=now,
            nodes=self.nodes,
            queues=queues,
            priority_classes=self.priority_classes,
            workloads=tuple(chain(self.running.values(), pending)),
            usage_strength=self.config.usage_strength,
            usage_half_life_seconds=self.config.half_life_seconds,
        )

    def _call_plan(self, snapshot: Any) -> Any:
        started = time.perf_counter()
        result = self._plan(snapshot)
        self.plan_seconds += time.perf_counter() - started
        self.plan_calls += 1
        return result

    def _apply(self, result: Any, now: float) -> int:
        for admission in result.admit:
            self._admit(self.by_id[admission.id], admission.placement, now)
        for preemption in result.preempt:
            job = self.by_id[preemption.id]
            if job.state == "running":
                self._preempt(job, preemption.grace_seconds, now, preemption.preemptor)
        for resize in result.resize:
            job = self.by_id[resize.workload]
            if job.state == "running":
                self._resize(job, resize, now)
        return len(result.admit) + len(result.preempt)

    def _cycle(self, now: float) -> None:
        if not self.pending and not self.below_largest:
            return
        if self.config.policy == "fifo" and self.pending:
            self._fifo_cycle(now)
            return
        self._refresh_checkpoints(now)
        snapshot = self._snapshot(now, tuple(self.pending.values()))
        result = self._call_plan(snapshot)
        self._apply(result, now)
        self._remember_waiting(result)
        if self.config.min_runtimes and self.pending:
            self._wake_when_protection_ends(snapshot, now)
        if self.below_largest:
            self._wake_when_growth_allowed(snapshot, now)

    def _wake_when_growth_allowed(self, snapshot: Any, now: float) -> None:
        # A gang below its largest size grows once its fair-share minimum runtime since its
        # last start or resize has passed; with nothing else happening, no event would
        # bring the cycle that lets it.
        minimum = fairshare.minimum_runtimes(snapshot, self.priority_classes[0])[
            fairshare.FAIR_SHARE
        ]
        ends = [
            self.jobs[index].admitted_at + minimum
            for index in self.below_largest
            if self.jobs[index].admitted_at + minimum > now
        ]
        if ends:
            self._want_cycle(self._cycle_after(min(ends)))

    def _wake_when_protection_ends(self, snapshot: Any, now: float) -> None:
        # Cycles run on events; a job that waits only because its victims have not run
        # their minimum runtime would otherwise wait for an unrelated event.
        minimums = set(fairshare.minimum_runtimes(snapshot, self.priority_classes[0]).values())
        ends = [
            workload.admitted_at + minimum
            for workload in self.running.values()
            for minimum in minimums
            if workload.admitted_at is not None and workload.admitted_at + minimum > now
        ]
        if ends:
            self._want_cycle(self._cycle_after(min(ends)))

    def _fifo_cycle(self, now: float) -> None:
        # Pending jobs are kept in arrival order (dicts keep insertion order and fifo never
        # requeues), so the first one is the head of the line.
        while self.pending:
            head = next(iter(self.pending.values()))
            result = self._call_plan(self._snapshot(now, (head,)))
            self._remember_waiting(result)
            if not any(admission.id == head.id for admission in result.admit):
                return
            self._apply(result, now)

    def _remember_waiting(self, result: Any) -> None:
        # Only the latest reasons are kept: they explain why the jobs left at the end wait.
        self.last_waiting = result.waiting

    def run(self) -> Report:
        """Replay the whole trace and return the report."""
        wall_started = time.perf_counter()
        cpu_started = time.process_time()
        for job in self.jobs:
            self._push(job.submitted_at, _ARRIVAL, job)
        arrivals_left = len(self.jobs)
        events = self.events
        last_progress = 0.0
        steps = 0
        now = 0.0
        while True:
            next_event = events[0][0] if events else math.inf
            if next_event == math.inf and self.next_cycle == math.inf:
                break
            if next_event <= self.next_cycle:
                at, _, kind, index, attempt = heapq.heappop(events)
                job = self.jobs[index]
                if kind == _FINISH and job.sizes and attempt != job.attempt:
                    # The finish an elastic job's attempt had before a resize or a preemption
                    # ended it (at a smaller size, far later than the job's real end) never
                    # comes, and must not stretch the run to the time it was due.
                    continue
                now = at
                self.ledger.advance(now)
                if kind == _RELEASE:
                    self._release(f"{job.id}~{attempt}", now)
                elif kind == _ARRIVAL:
                    self._arrive(job, now)
                    arrivals_left -= 1
                    if not arrivals_left:
                        self.ledger.last_submission()
                elif job.attempt != attempt:
                    continue
                elif kind == _FINISH and job.state == "running":
                    self._finish(job, now)
                elif kind == _EXIT and job.state == "terminating":
                    self._exit(job, now)
            else:
                now = self.next_cycle
                self.next_cycle = math.inf
                self.ledger.advance(now)
                self._cycle(now)
            steps += 1
            if self.progress is not None and steps % 512 == 0:
                wall = time.perf_counter()
                if wall - last_progress >= 0.5:
                    last_progress = wall
                    self._report_progress(now)
        end = max((self.ledger.now, now))
        self.ledger.close(end)
        if self.progress is not None:
            self._report_progress(end, finished=True)
        unfinished = [job for job in self.jobs if job.state not in ("done", "unfit")]
        reasons = {waiting.id: waiting.reason for waiting in self.last_waiting}
        stalled = {job.name: reasons.get(job.id, "never admitted") for job in unfinished[:20]}
        return self.ledger.report(
            policy=self.config.policy,
            capacity_gpus=self.capacity,
            nodes=len(self.config.nodes),
            jobs=len(self.jobs),
            jobs_completed=self.jobs_done,
            jobs_unfinished=len(unfinished),
            jobs_unfit=sum(1 for job in self.jobs if job.state == "unfit"),
            unfinished_examples=stalled,
            checkpoint_interval=self.config.checkpoint_interval,
            save_seconds=self.config.save_seconds,
            restart_seconds=self.config.restart_seconds,
            cycle_seconds=self.config.cycle_seconds,
            grace_seconds=self.config.grace_seconds,
            seed=self.config.seed,
            usage_strength=self.config.usage_strength,
            half_life_seconds=self.config.half_life_seconds,
            gang_topology=self.config.gang_topology,
            **(
                {"elastic_share": self.config.elastic_share, "elastic_jobs": self.elastic_count}
                if self.config.elastic_share
                else {}
            ),
            plan_calls=self.plan_calls,
            plan_wall_seconds=round(self.plan_seconds, 3),
            wall_seconds=round(time.perf_counter() - wall_started, 3),
            cpu_seconds=round(time.process_time() - cpu_started, 3),
        )

    def _report_progress(self, now: float, *, finished: bool = False) -> None:
        assert self.progress is not None
        self.progress(
            Progress(
                jobs_total=len(self.jobs),
                jobs_done=self.jobs_done,
                simulated_seconds=now,
                plan_calls=self.plan_calls,
                running=len(self.running),
                pending=len(self.pending),
                finished=finished,
            )
        )


def simulate(
    trace: Sequence[TraceJob],
    config: SimulationConfig,
    progress: Callable[[Progress], None] | None = None,
) -> Report:
    """Replay ``trace`` under ``config`` through :func:`fairshare.plan` and report the outcome."""
    return Simulation(trace, config, progress).run()
