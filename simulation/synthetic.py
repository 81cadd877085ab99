"""Synthetic traces fitted to the published facts about shared GPU clusters.

The facts (``../shared/data/README.md``, from the Helios, Philly and PAI traces):

* most jobs use one GPU, but jobs of 8 GPUs or more use most of the GPU time;
* durations are heavy-tailed: median about 20 minutes, 1% longer than 70 hours;
* teams differ a lot: some submit tens of thousands of one-GPU jobs, others a few hundred
  multi-node ones.

Durations are log-normal with the median and 99th percentile above.  Each team has a kind
(``small``: nearly all one-GPU jobs; ``large``: multi-node gangs; ``mixed``: the overall size mix)
and a Zipf-distributed share of the submissions.  Arrivals are a Poisson stream whose rate gives the
requested offered load (GPU-seconds asked per second divided by the cluster's GPUs), so a run of
any length keeps the same pressure.

Run ``python -m simulation.synthetic --jobs 100000 --gpus 1000 --out trace.csv`` to write a
generic CSV trace.
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from simulation.traces import TraceJob, write_generic

MEDIAN_DURATION_SECONDS = 20 * 60.0
P99_DURATION_SECONDS = 70 * 3600.0
# The 99th percentile of the standard normal distribution.
Z_99 = 2.3263478740408408
DURATION_SIGMA = math.log(P99_DURATION_SECONDS / MEDIAN_DURATION_SECONDS) / Z_99
# Nothing runs longer than four weeks; the log-normal tail would otherwise produce rare jobs of
# years, which no real cluster keeps.
MAX_DURATION_SECONDS = 28 * 86400.0

# GPUs per job and their probability, by team kind.  The mixed distribution puts about 70% of jobs
# on one GPU while jobs of 8 GPUs or more carry about 60% of the GPU time.
SIZE_MIX: dict[str, tuple[tuple[int, float], ...]] = {
    "small": ((1, 0.9), (2, 0.06), (4, 0.04)),
    "mixed": ((1, 0.70), (2, 0.08), (4, 0.08), (8, 0.09), (16, 0.03), (32, 0.015), (64, 0.005)),
    "large": ((8, 0.45), (16, 0.30), (32, 0.18), (64, 0.07)),
}
TEAM_KINDS = ("small", "mixed", "large")
# The size mix of the real traces taken alone (``kind="trace"`` for every team): 93% of the
# jobs take one GPU while gangs of 8 GPUs or more hold more than half of the GPU time.
SIZE_MIX["trace"] = (
    (1, 0.93),
    (2, 0.01),
    (4, 0.01),
    (8, 0.02),
    (16, 0.014),
    (32, 0.01),
    (64, 0.006),
)


@dataclass(frozen=True, slots=True)
class SyntheticTeam:
    """A team of the synthetic trace: its kind of jobs and its share of the submissions."""

    name: str
    kind: str
    submission_share: float


def mean_duration() -> float:
    """The mean of the duration distribution (before the four-week cap)."""
    return MEDIAN_DURATION_SECONDS * math.exp(DURATION_SIGMA**2 / 2)


def mean_gpus(kind: str) -> float:
    """The mean GPUs per job of a team kind."""
    return sum(gpus * p for gpus, p in SIZE_MIX[kind]) / sum(p for _, p in SIZE_MIX[kind])


def make_teams(
    count: int, seed: int = 0, zipf_exponent: float = 1.1, kind: str | None = None
) -> list[SyntheticTeam]:
    """Make ``count`` teams with Zipf submission shares and kinds cycling small, mixed, large.

    The busiest team is a ``small`` one: it submits the most jobs, nearly all of one GPU, while
    ``large`` teams submit few jobs of many GPUs, as in the published traces. ``kind`` gives
    every team the same kind instead (``"trace"``: the real traces' size mix).
    """
    if kind is not None and kind not in SIZE_MIX:
        raise ValueError(f"unknown team kind {kind!r} (one of {', '.join(SIZE_MIX)})")
    rng = random.Random(seed)
    raw = [1.0 / (rank**zipf_exponent) for rank in range(1, count + 1)]
    total = sum(raw)
    kinds = [TEAM_KINDS[index % len(TEAM_KINDS)] for index in range(count)]
    # Keep the first (busiest) team small and shuffle the rest, so kind and size are not locked.
    tail = kinds[1:]
    rng.shuffle(tail)
    kinds = kinds[:1] + tail
    if kind is not None:
        kinds = [kind] * count
    return [
        SyntheticTeam(f"team-{index:02d}", kinds[index], raw[index] / total)
        for index in range(count)
    ]


def generate(
    jobs: int,
    capacity_gpus: int,
    *,
    teams: Sequence[SyntheticTeam] | None = None,
    load: float = 1.1,
    seed: int = 0,
    max_gpus: int | None = None,
) -> list[TraceJob]:
    """Generate ``jobs`` jobs whose offered load on ``capacity_gpus`` GPUs is about ``load``.

    ``max_gpus`` caps the size of a job (default: the cluster's capacity).  The same arguments
    always give the same trace.
    """
    rng = random.Random(seed)
    team_list = list(teams) if teams is not None else make_teams(12, seed)
    shares = [team.submission_share for team in team_list]
    cap = max_gpus if max_gpus is not None else capacity_gpus
    sizes = {
        kind: ([g for g, _ in mix if g <= cap] or [1], [p for g, p in mix if g <= cap] or [1.0])
        for kind, mix in SIZE_MIX.items()
    }
    mean_job_gpus = sum(team.submission_share * mean_gpus(team.kind) for team in team_list)
    mean_job_gpu_seconds = mean_job_gpus * mean_duration()
    # Poisson arrivals: rate * mean GPU-seconds per job = load * capacity.
    rate = load * capacity_gpus / mean_job_gpu_seconds
    log_median = math.log(MEDIAN_DURATION_SECONDS)
    now = 0.0
    trace: list[TraceJob] = []
    for index in range(jobs):
        now += rng.expovariate(rate)
        team = rng.choices(team_list, weights=shares)[0]
        choices, weights = sizes[team.kind]
        gpus = rng.choices(choices, weights=weights)[0]
        duration = min(MAX_DURATION_SECONDS, math.exp(rng.gauss(log_median, DURATION_SIGMA)))
        trace.append(TraceJob(f"syn-{index}", now, max(1.0, duration), gpus, team.name))
    return trace


def main(argv: Sequence[str] | None = None) -> int:
    """Write a synthetic generic CSV trace."""
    parser = argparse.ArgumentParser(prog="python -m simulation.synthetic", description=__doc__)
    parser.add_argument("--jobs", type=int, default=10000)
    parser.add_argument("--gpus", type=int, default=1000, help="cluster capacity the load is for")
    parser.add_argument("--teams", type=int, default=12)
    parser.add_argument("--load", type=float, default=1.1, help="offered load / capacity")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--size-mix",
        choices=("teams", "trace"),
        default="teams",
        help="teams: small, mixed and large teams; trace: every team with the real traces' mix",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    trace = generate(
        args.jobs,
        args.gpus,
        teams=make_teams(args.teams, args.seed, kind="trace" if args.size_mix == "trace" else None),
        load=args.load,
        seed=args.seed,
    )
    write_generic(args.out, trace)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
