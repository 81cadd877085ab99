"""How likely a running job is to be preempted: its mean time between preemptions (MTBP).

The trap turns this number into its regular checkpoint interval (the Young/Daly
optimum, ``sqrt(2 * save cost * MTBP)``; see gracetrap's README), so a job that is
safe checkpoints rarely and one that may lose its GPUs any minute often.

Pure logic over plain values: ``preemption.selectors.running_attempt_risks`` gathers
them from the database and the engine's plan. Each applicable cause gives an MTBP
and the shortest one is the estimate, since the job is stopped by whichever comes
first; every cause is kept in words so that the job page can say why.

Causes, from the rules in ARCHITECTURE.md:

* a class that is not preemptible is never a victim (R5): ``NEVER``;
* a preemptible job whose team stays inside its guarantee can still lose its GPUs to
  a higher priority in its own team (R7): ``CALM``;
* a team above its guarantee borrows, and borrowed GPUs are always reclaimable (R6):
  ``RECLAIM_IMMINENT`` when a team under its guarantee has waiting work that fits in
  it (the engine reclaims as soon as the victim's minimum runtime allows),
  ``BORROWING`` otherwise;
* a team above its fair share while other teams wait may give GPUs back to the
  surplus rule (R8): ``ABOVE_FAIR_SHARE``;
* the measured rate: over the window, each preemption of an attempt in the same
  team, flavor and borrowing state weighed by its GPUs, per GPU-hour those attempts
  ran. Weighing by GPUs makes it the GPU-time weighted mean of the per-job
  preemption rates, whatever the gangs' sizes, so its inverse is a job's MTBP.
  Fewer than ``MIN_MEASURED_GPU_HOURS`` say too little and are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

HOUR = 3600.0
DAY = 24 * HOUR

NEVER = 30 * DAY
CALM = 7 * DAY
BORROWING = 4 * HOUR
ABOVE_FAIR_SHARE = HOUR
RECLAIM_IMMINENT = 600.0
# No estimate goes below this: a checkpoint every few seconds would cost more than
# any preemption could.
FLOOR = 60.0
MIN_MEASURED_GPU_HOURS = 1.0
# Said of borrowed GPUs nobody asks back for; the job page words it otherwise while
# the job is being stopped or was stopped moments ago (selectors.job_cadence).
NO_OWNER_WAITS = "no owner waits for it now"


@dataclass(frozen=True, slots=True)
class Standing:
    """One team's place on one flavor: its guarantee, the GPUs it holds, its fair share."""

    guarantee: int
    usage: int
    fair_share: float

    @property
    def borrowed(self) -> int:
        return max(0, self.usage - self.guarantee)


@dataclass(frozen=True, slots=True)
class Reclaimer:
    """A team under its guarantee on the job's flavor with jobs waiting that fit in it."""

    team: str
    waiting_jobs: int


@dataclass(frozen=True, slots=True)
class MeasuredRate:
    """Preempted GPUs and the GPU-hours run over the window, for one team, flavor and
    borrowing state."""

    preempted_gpus: int
    gpu_hours: float
    window_hours: float

    @property
    def mtbp_seconds(self) -> float | None:
        """The measured MTBP, or None when too little ran or nothing was preempted."""
        if self.gpu_hours < MIN_MEASURED_GPU_HOURS or self.preempted_gpus == 0:
            return None
        return self.gpu_hours / self.preempted_gpus * HOUR


@dataclass(frozen=True, slots=True)
class RunningJob:
    """What the estimate needs to know of one running attempt."""

    team: str
    flavor: str
    preemptible: bool
    priority_class: str


@dataclass(frozen=True, slots=True)
class Risk:
    """The estimate: seconds between preemptions and the causes, the deciding one first."""

    mtbp_seconds: float
    reasons: tuple[str, ...]


def _duration(seconds: float) -> str:
    if seconds >= 2 * DAY:
        return f"{seconds / DAY:.0f} days"
    if seconds >= 2 * HOUR:
        return f"{seconds / HOUR:.3g} h"
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def estimate_mtbp(
    job: RunningJob,
    *,
    standing: Standing,
    reclaimers: tuple[Reclaimer, ...] = (),
    others_waiting: bool = False,
    measured: MeasuredRate | None = None,
) -> Risk:
    """The job's mean time between preemptions and why.

    ``reclaimers`` are other teams that could take back what the job's team borrows;
    ``others_waiting`` says whether any other team has jobs waiting for the flavor
    (what makes a move of the surplus by fair share possible).
    """
    if not job.preemptible:
        return Risk(NEVER, (f"its class {job.priority_class} is not preemptible",))
    causes: list[tuple[float, str]] = []
    if standing.borrowed > 0:
        borrowing = (
            f"team {job.team} holds {standing.usage} {job.flavor} GPUs, "
            f"{standing.borrowed} beyond its guarantee of {standing.guarantee}"
        )
        if reclaimers:
            owners = ", ".join(
                f"{r.team} ({_plural(r.waiting_jobs, 'job')} waiting)" for r in reclaimers
            )
            causes.append(
                (
                    RECLAIM_IMMINENT,
                    f"{borrowing}, and teams under their guarantee wait for it: {owners}",
                )
            )
        else:
            causes.append((BORROWING, f"{borrowing}; {NO_OWNER_WAITS}"))
    if standing.usage > standing.fair_share and others_waiting:
        causes.append(
            (
                ABOVE_FAIR_SHARE,
                f"team {job.team} is above its fair share ({standing.usage} of "
                f"{standing.fair_share:g} {job.flavor} GPUs) while other teams wait",
            )
        )
    if not causes:
        causes.append(
            (
                CALM,
                f"team {job.team} is inside its guarantee ({standing.usage} of "
                f"{standing.guarantee} {job.flavor} GPUs)",
            )
        )
    if measured is not None:
        measured_mtbp = measured.mtbp_seconds
        window = _duration(measured.window_hours * HOUR)
        ran = f"{measured.gpu_hours:.1f} GPU-hours in the last {window}"
        if measured_mtbp is not None:
            causes.append(
                (
                    measured_mtbp,
                    f"measured: {_plural(measured.preempted_gpus, 'GPU')} preempted per "
                    f"{ran} (one preemption every {_duration(measured_mtbp)})",
                )
            )
        elif measured.gpu_hours >= MIN_MEASURED_GPU_HOURS:
            causes.append((NEVER, f"measured: no preemptions in {ran}"))
    causes.sort(key=lambda cause: cause[0])
    mtbp = max(FLOOR, min(NEVER, causes[0][0]))
    return Risk(mtbp, tuple(reason for _, reason in causes))
