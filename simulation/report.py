"""Metrics of a simulated run, integrated over simulated time, and the JSON report.

:class:`Ledger` is told every change of state at the simulated instant it happens and integrates
the time-weighted figures between changes; :meth:`Ledger.report` turns it into a :class:`Report`
whose :meth:`Report.to_dict` is the JSON document documented in ``simulation/README.md``.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The allocation goal of issue 8: with lending, at least this share of the GPUs is allocated
# whenever demand exceeds capacity.
ALLOCATION_GOAL = 0.9
# The longest waits inside the guarantee that the report names, job by job.
WAIT_EXAMPLES = 20

# A job as the ledger tracks its wait inside the guarantee: (submission time, index in the
# trace, name). The first two give its team's queue order (older first), the index keeps
# two jobs of one name apart.
JobKey = tuple[float, int, str]


def percentile(values: Sequence[float], share: float) -> float:
    """The nearest-rank percentile of ``values`` (0.0 when empty); ``share`` is in [0, 1]."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(share * len(ordered)))
    return ordered[rank - 1]


def _wait_summary(values: Iterable[float]) -> dict[str, float]:
    """How many jobs waited inside the guarantee, and the summary of their waits."""
    waits = list(values)
    return {"jobs": len(waits), **_summary(waits)}


def _summary(values: Sequence[float]) -> dict[str, float]:
    mean = sum(values) / len(values) if values else 0.0
    return {
        "mean": round(mean, 3),
        "p50": round(percentile(values, 0.5), 3),
        "p99": round(percentile(values, 0.99), 3),
        "max": round(max(values), 3) if values else 0.0,
    }


@dataclass(slots=True)
class TeamLedger:
    """What one team did and got during the run (seconds and GPU-seconds)."""

    guarantee: int
    jobs: int = 0
    jobs_completed: int = 0
    used: int = 0
    gpu_seconds_used: float = 0.0
    gpu_seconds_borrowed: float = 0.0
    gpu_seconds_lent: float = 0.0
    preemptions: int = 0
    lost_gpu_seconds: float = 0.0
    below_since: float | None = None
    seconds_below_line: float = 0.0
    longest_below_line_seconds: float = 0.0
    seconds_wanting_surplus: float = 0.0
    pending_sizes: dict[int, int] = field(default_factory=dict)
    pending_gpus: int = 0
    completion_seconds: list[float] = field(default_factory=list)
    queueing_seconds: list[float] = field(default_factory=list)
    # Pending jobs told by key, in queue order (older submission first), with their GPUs.
    queue: list[tuple[JobKey, int]] = field(default_factory=list)
    # Per job that fits inside the unused guarantee now: since when it fits.
    fits_since: dict[JobKey, float] = field(default_factory=dict)
    # Per job that ever fitted while pending: its longest such stretch, ended by its start
    # or by no longer fitting (an older job of its team requeued ahead of it).
    inside_waits: dict[JobKey, float] = field(default_factory=dict)

    def is_below_line(self) -> bool:
        """True while the team holds less than min(guarantee, admissible demand).

        Admissible demand is what the team holds plus each pending job that fits inside its unused
        guarantee; so the team is below the line exactly when it holds less than its guarantee and
        one of its pending jobs would fit in the difference.  A pending gang larger than that
        difference can only run by borrowing, which no guarantee promises.
        """
        headroom = self.guarantee - self.used
        return headroom > 0 and bool(self.pending_sizes) and min(self.pending_sizes) <= headroom

    def fitting_jobs(self) -> set[JobKey]:
        """The pending jobs that fit inside the unused guarantee, taken in queue order.

        The guarantee promises a job a start within one cycle plus the grace window from
        the moment it fits in what its team holds below the line, after its team's older
        pending jobs that fit (the engine plans a team's jobs oldest first, and a job too
        large for what is left does not hold back a smaller one behind it).
        """
        room = self.guarantee - self.used
        fitting: set[JobKey] = set()
        if room <= 0 or not self.pending_sizes:
            return fitting
        smallest = min(self.pending_sizes)
        for key, gpus in self.queue:
            if room < smallest:
                break
            if gpus <= room:
                fitting.add(key)
                room -= gpus
        return fitting

    def wants_surplus(self) -> bool:
        """True while what the team holds and waits for together exceeds its guarantee."""
        return self.pending_gpus > 0 and self.used + self.pending_gpus > self.guarantee


class Ledger:
    """Integrates allocation, demand, borrowing, lending and time below the guarantee line.

    The engine calls :meth:`advance` with the current simulated time before each change of
    state, then the method describing the change.  Held GPUs are those of running jobs and of
    victims still inside their grace window (they are not free until the victim exits).
    """

    def __init__(self, capacity: int, guarantees: Mapping[str, int]) -> None:
        self.capacity = capacity
        self.teams: dict[str, TeamLedger] = {
            team: TeamLedger(guarantee) for team, guarantee in sorted(guarantees.items())
        }
        self.surplus = max(0, capacity - sum(guarantees.values()))
        self.started_at: float | None = None
        self.now = 0.0
        self.held = 0
        self.pending_jobs = 0
        self.demand = 0
        self.gpu_seconds_held = 0.0
        self.seconds_waiting = 0.0
        self.gpu_seconds_held_waiting = 0.0
        self.seconds_oversubscribed = 0.0
        self.gpu_seconds_held_oversubscribed = 0.0
        self.seconds_oversubscribed_below_goal = 0.0
        self.last_submission_at: float | None = None
        self.gpu_seconds_held_until_last_submission = 0.0
        self.preemptions = 0
        self.lost_gpu_seconds = 0.0
        self.shrinks = 0
        self.grows = 0
        self.completion_seconds: list[float] = []
        self.queueing_seconds: list[float] = []
        self.gang_queueing_seconds: list[float] = []

    def team(self, name: str) -> TeamLedger:
        """The ledger of a team, created with a zero guarantee if the quotas did not name it."""
        ledger = self.teams.get(name)
        if ledger is None:
            ledger = self.teams[name] = TeamLedger(0)
        return ledger

    def advance(self, now: float) -> None:
        """Integrate every time-weighted figure from the last change up to ``now``."""
        if self.started_at is None:
            self.started_at = now
            self.now = now
            return
        elapsed = now - self.now
        if elapsed <= 0:
            return
        self.now = now
        held_seconds = self.held * elapsed
        self.gpu_seconds_held += held_seconds
        if self.pending_jobs:
            self.seconds_waiting += elapsed
            self.gpu_seconds_held_waiting += held_seconds
        if self.demand > self.capacity:
            self.seconds_oversubscribed += elapsed
            self.gpu_seconds_held_oversubscribed += held_seconds
            if self.held < ALLOCATION_GOAL * self.capacity:
                self.seconds_oversubscribed_below_goal += elapsed
        # Borrowed GPUs come first out of capacity nobody is guaranteed; only the rest is lent by
        # teams that leave part of their guarantee idle, each in proportion to its idle part.
        borrowed_total = 0
        idle_total = 0
        for ledger in self.teams.values():
            ledger.gpu_seconds_used += ledger.used * elapsed
            if ledger.pending_gpus and ledger.used + ledger.pending_gpus > ledger.guarantee:
                ledger.seconds_wanting_surplus += elapsed
            if ledger.used > ledger.guarantee:
                borrowed = ledger.used - ledger.guarantee
                borrowed_total += borrowed
                ledger.gpu_seconds_borrowed += borrowed * elapsed
            else:
                idle_total += ledger.guarantee - ledger.used
        lent_total = min(idle_total, max(0, borrowed_total - self.surplus))
        if lent_total > 0:
            for ledger in self.teams.values():
                if ledger.used < ledger.guarantee:
                    idle = ledger.guarantee - ledger.used
                    ledger.gpu_seconds_lent += lent_total * idle / idle_total * elapsed

    def last_submission(self) -> None:
        """The last job of the trace has just arrived (call after :meth:`advance`).

        Allocation up to this instant describes the cluster while the trace still feeds it;
        the drain that follows (the longest jobs finishing alone) would dilute the overall figure.
        """
        self.last_submission_at = self.now
        self.gpu_seconds_held_until_last_submission = self.gpu_seconds_held

    def _check_line(self, ledger: TeamLedger) -> None:
        below = ledger.is_below_line()
        if below and ledger.below_since is None:
            ledger.below_since = self.now
        elif not below and ledger.below_since is not None:
            self._close_below(ledger)
        if ledger.queue or ledger.fits_since:
            self._check_fits(ledger)

    def _check_fits(self, ledger: TeamLedger) -> None:
        """Start the inside-guarantee wait of each job that now fits, end the others'."""
        fitting = ledger.fitting_jobs()
        for key in [key for key in ledger.fits_since if key not in fitting]:
            self._close_fit(ledger, key)
        for key in fitting:
            if key not in ledger.fits_since:
                ledger.fits_since[key] = self.now

    def _close_fit(self, ledger: TeamLedger, key: JobKey) -> None:
        wait = self.now - ledger.fits_since.pop(key)
        ledger.inside_waits[key] = max(ledger.inside_waits.get(key, 0.0), wait)

    def _close_below(self, ledger: TeamLedger) -> None:
        assert ledger.below_since is not None
        stretch = self.now - ledger.below_since
        ledger.seconds_below_line += stretch
        ledger.longest_below_line_seconds = max(ledger.longest_below_line_seconds, stretch)
        ledger.below_since = None

    def job_submitted(self, team: str) -> None:
        """A job arrived (whether or not it will ever fit the cluster)."""
        self.team(team).jobs += 1

    def job_pending(
        self,
        team: str,
        gpus: int,
        *,
        requeued: bool,
        job: JobKey | None = None,
        least: int | None = None,
    ) -> None:
        """A job of ``gpus`` GPUs became pending: on arrival, or again after its preemption.

        With ``job`` its wait inside the guarantee is measured (see ``fitting_jobs``); pass
        the same key when it is admitted. ``least``: the fewest GPUs an elastic job starts
        on, what its guarantee promises it and what the line counts (default ``gpus``).
        """
        ledger = self.team(team)
        size = gpus if least is None else least
        if job is not None:
            bisect.insort(ledger.queue, (job, size))
        self.pending_jobs += 1
        if not requeued:
            self.demand += gpus
        ledger.pending_sizes[size] = ledger.pending_sizes.get(size, 0) + 1
        ledger.pending_gpus += gpus
        self._check_line(ledger)

    def job_admitted(
        self,
        team: str,
        gpus: int,
        *,
        job: JobKey | None = None,
        least: int | None = None,
        holds: int | None = None,
    ) -> None:
        """A pending job of ``gpus`` GPUs was admitted (``job`` and ``least`` as it was made
        pending with; its wait inside the guarantee ends here) and now holds ``holds`` GPUs
        (default ``gpus``; fewer for an elastic job started below its largest size)."""
        ledger = self.team(team)
        size = gpus if least is None else least
        if job is not None:
            at = bisect.bisect_left(ledger.queue, (job, size))
            del ledger.queue[at]
            if job in ledger.fits_since:
                self._close_fit(ledger, job)
        self.pending_jobs -= 1
        count = ledger.pending_sizes[size] - 1
        if count:
            ledger.pending_sizes[size] = count
        else:
            del ledger.pending_sizes[size]
        ledger.pending_gpus -= gpus
        held = gpus if holds is None else holds
        self.held += held
        ledger.used += held
        self._check_line(ledger)

    def job_resized(self, team: str, lost_gpu_seconds: float, *, shrink: bool) -> None:
        """A running elastic job was shrunk (or grown); its restart lost ``lost_gpu_seconds``."""
        ledger = self.team(team)
        if shrink:
            self.shrinks += 1
        else:
            self.grows += 1
        self.lost_gpu_seconds += lost_gpu_seconds
        ledger.lost_gpu_seconds += lost_gpu_seconds

    def gpus_resized(self, team: str, gpus: int) -> None:
        """A running job took ``gpus`` more GPUs (a grow), or gave ``-gpus`` back (the end of
        a shrink's stop)."""
        ledger = self.team(team)
        self.held += gpus
        ledger.used += gpus
        self._check_line(ledger)

    def job_preempted(self, team: str, lost_gpu_seconds: float) -> None:
        """A running job was chosen as a victim; it keeps its GPUs until it exits."""
        ledger = self.team(team)
        self.preemptions += 1
        ledger.preemptions += 1
        self.lost_gpu_seconds += lost_gpu_seconds
        ledger.lost_gpu_seconds += lost_gpu_seconds

    def gpus_released(
        self, team: str, gpus: int, *, finished: bool, demand: int | None = None
    ) -> None:
        """A job gave its ``gpus`` GPUs back: it finished (its ``demand``, default ``gpus``,
        ends), or a victim exited (and will be requeued)."""
        ledger = self.team(team)
        self.held -= gpus
        ledger.used -= gpus
        if finished:
            self.demand -= gpus if demand is None else demand
        self._check_line(ledger)

    def job_finished(
        self, team: str, completion_seconds: float, queueing_seconds: float, *, gang: bool = False
    ) -> None:
        """A job completed its work; record its completion time and total time spent pending
        (``gang``: it ran as more than one rank)."""
        ledger = self.team(team)
        ledger.jobs_completed += 1
        self.completion_seconds.append(completion_seconds)
        self.queueing_seconds.append(queueing_seconds)
        if gang:
            self.gang_queueing_seconds.append(queueing_seconds)
        ledger.completion_seconds.append(completion_seconds)
        ledger.queueing_seconds.append(queueing_seconds)

    def close(self, now: float) -> None:
        """End the run at ``now``: integrate up to it and close open stretches below the line."""
        self.advance(now)
        for ledger in self.teams.values():
            if ledger.below_since is not None:
                self._close_below(ledger)
            for key in list(ledger.fits_since):
                self._close_fit(ledger, key)

    def report(self, **run: Any) -> Report:
        """Build the report; ``run`` holds the run's settings and counters (see Report)."""
        span = self.now - (self.started_at if self.started_at is not None else self.now)

        def ratio(gpu_seconds: float, seconds: float) -> float | None:
            if seconds <= 0 or self.capacity <= 0:
                return None
            return round(gpu_seconds / (self.capacity * seconds), 4)

        teams = {
            name: {
                "guarantee": ledger.guarantee,
                "jobs": ledger.jobs,
                "jobs_completed": ledger.jobs_completed,
                "gpu_hours_used": round(ledger.gpu_seconds_used / 3600, 3),
                "gpu_hours_borrowed": round(ledger.gpu_seconds_borrowed / 3600, 3),
                "gpu_hours_lent": round(ledger.gpu_seconds_lent / 3600, 3),
                "seconds_below_guarantee_line": round(ledger.seconds_below_line, 3),
                "longest_below_guarantee_line_seconds": round(ledger.longest_below_line_seconds, 3),
                "inside_guarantee_wait_seconds": _wait_summary(ledger.inside_waits.values()),
                "seconds_wanting_surplus": round(ledger.seconds_wanting_surplus, 3),
                "preemptions": ledger.preemptions,
                "lost_gpu_hours": round(ledger.lost_gpu_seconds / 3600, 3),
                "completion_time_seconds": _summary(ledger.completion_seconds),
                "queueing_delay_seconds": _summary(ledger.queueing_seconds),
            }
            for name, ledger in self.teams.items()
        }
        waits = sorted(
            (
                (wait, team, key)
                for team, ledger in self.teams.items()
                for key, wait in ledger.inside_waits.items()
            ),
            key=lambda item: (-item[0], item[2][0], item[2][1]),
        )
        return Report(
            run=dict(run),
            simulated_seconds=round(span, 3),
            allocation={
                "overall": ratio(self.gpu_seconds_held, span),
                "until_last_submission": ratio(
                    self.gpu_seconds_held_until_last_submission,
                    (self.last_submission_at or 0.0) - (self.started_at or 0.0),
                ),
                "while_jobs_wait": ratio(self.gpu_seconds_held_waiting, self.seconds_waiting),
                "seconds_jobs_wait": round(self.seconds_waiting, 3),
                "while_demand_exceeds_capacity": ratio(
                    self.gpu_seconds_held_oversubscribed, self.seconds_oversubscribed
                ),
                "seconds_demand_exceeds_capacity": round(self.seconds_oversubscribed, 3),
                "seconds_demand_exceeds_capacity_below_goal": round(
                    self.seconds_oversubscribed_below_goal, 3
                ),
            },
            completion_time_seconds=_summary(self.completion_seconds),
            queueing_delay_seconds=_summary(self.queueing_seconds),
            gang_queueing_delay_seconds=_summary(self.gang_queueing_seconds),
            preemptions=self.preemptions,
            lost_gpu_hours=round(self.lost_gpu_seconds / 3600, 3),
            longest_below_guarantee_line_seconds=round(
                max((t.longest_below_line_seconds for t in self.teams.values()), default=0.0), 3
            ),
            teams=teams,
            longest_inside_guarantee_wait_seconds=round(waits[0][0], 3) if waits else 0.0,
            longest_inside_guarantee_waits=[
                {"job": key[2], "team": team, "submitted_at": key[0], "seconds": round(wait, 3)}
                for wait, team, key in waits[:WAIT_EXAMPLES]
            ],
            inside_guarantee_wait_by_job={f"{key[2]}#{key[1]}": wait for wait, _, key in waits},
            resizes={"shrinks": self.shrinks, "grows": self.grows}
            if "elastic_share" in run
            else None,
        )


@dataclass(frozen=True, slots=True)
class Report:
    """The outcome of one simulated run; :meth:`to_dict` gives the documented JSON names."""

    run: dict[str, Any]
    simulated_seconds: float
    allocation: dict[str, float | None]
    completion_time_seconds: dict[str, float]
    queueing_delay_seconds: dict[str, float]
    preemptions: int
    lost_gpu_hours: float
    longest_below_guarantee_line_seconds: float
    teams: dict[str, dict[str, Any]]
    # Queueing delay of the jobs that ran as more than one rank (the gangs topology concerns).
    gang_queueing_delay_seconds: dict[str, float] = field(default_factory=lambda: _summary(()))
    # Each job's longest wait from the moment it fitted inside its team's unused guarantee
    # until it started (see TeamLedger.fitting_jobs): the longest, the longest few job by
    # job, and every job's (``name#index``; not in the JSON, whose per-team summaries carry
    # the max and p99).
    longest_inside_guarantee_wait_seconds: float = 0.0
    longest_inside_guarantee_waits: list[dict[str, Any]] = field(default_factory=list)
    inside_guarantee_wait_by_job: dict[str, float] = field(default_factory=dict)
    # Shrinks and grows of elastic jobs; None (and left out of the JSON and the summary)
    # in a run without elastic jobs, whose report stays as it was before they existed.
    resizes: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-able data (names documented in simulation/README.md)."""
        elastic = {} if self.resizes is None else {"resizes": self.resizes}
        return {
            "run": self.run,
            "simulated_seconds": self.simulated_seconds,
            "allocation": self.allocation,
            "completion_time_seconds": self.completion_time_seconds,
            "queueing_delay_seconds": self.queueing_delay_seconds,
            "gang_queueing_delay_seconds": self.gang_queueing_delay_seconds,
            "preemptions": self.preemptions,
            **elastic,
            "lost_gpu_hours": self.lost_gpu_hours,
            "longest_below_guarantee_line_seconds": self.longest_below_guarantee_line_seconds,
            "longest_inside_guarantee_wait_seconds": self.longest_inside_guarantee_wait_seconds,
            "longest_inside_guarantee_waits": self.longest_inside_guarantee_waits,
            "teams": self.teams,
        }

    def write_json(self, path: Path) -> None:
        """Write the report as indented JSON."""
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")

    def summary_lines(self) -> list[str]:
        """A few readable lines for the terminal."""
        allocation = self.allocation
        completion = self.completion_time_seconds
        queueing = self.queueing_delay_seconds

        def share(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.1%}"

        lines = [
            f"policy {self.run.get('policy')}: {self.run.get('jobs_completed')} of "
            f"{self.run.get('jobs')} jobs completed in {self.simulated_seconds / 3600:.1f} "
            f"simulated hours",
            f"GPU allocation {share(allocation['overall'])} overall, "
            f"{share(allocation['until_last_submission'])} until the last submission, "
            f"{share(allocation['while_jobs_wait'])} while jobs wait, "
            f"{share(allocation['while_demand_exceeds_capacity'])} while demand exceeds capacity",
            f"completion time mean {completion['mean']:.0f} s, p99 {completion['p99']:.0f} s; "
            f"queueing delay mean {queueing['mean']:.0f} s, p99 {queueing['p99']:.0f} s",
            f"preemptions {self.preemptions}, lost {self.lost_gpu_hours:.1f} GPU-hours; longest "
            f"stretch of a team below its guarantee line "
            f"{self.longest_below_guarantee_line_seconds:.1f} s",
            f"wait of a job inside its team's unused guarantee until it starts: longest "
            f"{self.longest_inside_guarantee_wait_seconds:.1f} s; per team (jobs, p99, max): "
            + ", ".join(
                f"{name} {wait['jobs']}, {wait['p99']:.1f} s, {wait['max']:.1f} s"
                for name, team in self.teams.items()
                if (wait := team["inside_guarantee_wait_seconds"])["jobs"]
            ),
        ]
        if self.resizes is not None:
            lines.append(
                f"elastic jobs {self.run.get('elastic_jobs')} (share "
                f"{self.run.get('elastic_share')} of the multi-GPU jobs): "
                f"{self.resizes['shrinks']} shrinks, {self.resizes['grows']} grows"
            )
        return lines
