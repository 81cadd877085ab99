"""Benchmark of the trace replay: the goals of issue 8 and the speed of a 100,000-job run.

    .venv/bin/python bench/bench_simulation.py                 # goals, comparison and speed
    .venv/bin/python bench/bench_simulation.py --skip-speed    # goals only
    .venv/bin/python bench/bench_simulation.py --profile       # cProfile of the speed run
    .venv/bin/python bench/bench_simulation.py --skip-goals --skip-speed   # issue 16's figures
    .venv/bin/python bench/bench_simulation.py --only-elastic  # issue 47's table

Goals (on a synthetic trace fitted to ../shared/data/README.md, policy fairshare):

* GPU allocation of at least 90% whenever demand exceeds capacity: printed as the time-weighted
  allocation over those periods and the share of that time spent below 90%.
* No team with demand stays below min(guarantee, admissible demand) longer than one scheduling
  cycle plus the grace window: printed as the longest stretch against that bound.

Decayed usage (issue 16): on the openb trace with the Helios Venus quotas of one day, and on
the synthetic generator, each team's share of the surplus GPU-hours against its weight, as
Jain's index over the teams that wanted surplus in either run, with decayed usage against
today's engine (strength 0).

Topology (issue 16): on a synthetic trace with racks of ``--rack-size`` nodes, how long gangs
(more than one node) wait and the allocation, when they require one rack against placed
blind to racks.

Elastic jobs (issue 47): on the shared traces, whole-gang eviction against
``--elastic-share`` of the multi-GPU jobs elastic (simulation/elastic.py), side by side with
the ratios to the goals: the openb trace with the Helios Venus quotas of one day, arrivals
compressed by ``--elastic-openb-arrival-scale``, and each Sia workload on ``--sia-gpus`` GPUs
(the Sia paper's cluster) shared by ``--sia-teams`` teams of equal guarantee. Which jobs are
elastic is drawn from the seed, and one job's move changes every decision after it: each
Sia workload is replayed again for ``--elastic-seeds`` draws, and the spread of each
figure over them printed.

Speed: wall time of 100,000 jobs on 1,000 GPUs (125 nodes of 8), with the part spent inside
``fairshare.plan``.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import math
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulation.cli import DEFAULT_HELIOS_QUOTAS, DEFAULT_OPENB_TRACE, SHARED_DATA, progress_bar
from simulation.elastic import compare_elastic, comparison_lines, owner_waits
from simulation.engine import SimulationConfig, simulate
from simulation.fairness import surplus_fairness, teams_wanting_surplus
from simulation.report import ALLOCATION_GOAL, Report
from simulation.synthetic import generate, make_teams
from simulation.traces import (
    ClusterNode,
    TraceJob,
    derive_quotas,
    load_helios_quotas,
    load_trace,
    rack_layout,
    uniform_cluster,
)


def run(
    trace: list[TraceJob],
    gpus: int,
    policy: str,
    args: argparse.Namespace,
    progress: bool,
    *,
    nodes: list[ClusterNode] | None = None,
    guarantees: dict[str, int] | None = None,
    usage_strength: float = 0.0,
    gang_topology: str = "none",
) -> Report:
    config = SimulationConfig(
        nodes=nodes if nodes is not None else uniform_cluster(gpus // 8, 8),
        guarantees=guarantees if guarantees is not None else derive_quotas(trace, gpus),
        policy=policy,
        cycle_seconds=args.cycle_seconds,
        grace_seconds=args.grace_seconds,
        save_seconds=args.save_seconds,
        checkpoint_interval=args.checkpoint_interval,
        restart_seconds=args.restart_seconds,
        usage_strength=usage_strength,
        half_life_seconds=args.half_life,
        gang_topology=gang_topology,
    )
    return simulate(trace, config, progress_bar(sys.stderr) if progress else None)


def share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def print_report(title: str, report: Report) -> None:
    allocation = report.allocation
    run = report.run
    print(f"  {title}: {run['jobs_completed']}/{run['jobs']} jobs completed")
    print(
        f"    allocation {share(allocation['overall'])} overall, "
        f"{share(allocation['until_last_submission'])} until the last submission, "
        f"{share(allocation['while_jobs_wait'])} while jobs wait, "
        f"{share(allocation['while_demand_exceeds_capacity'])} while demand exceeds capacity "
        f"({allocation['seconds_demand_exceeds_capacity'] or 0:.0f} s)"
    )
    completion = report.completion_time_seconds
    queueing = report.queueing_delay_seconds
    print(
        f"    completion mean {completion['mean']:.0f} s, p99 {completion['p99']:.0f} s; "
        f"queueing mean {queueing['mean']:.0f} s, p99 {queueing['p99']:.0f} s; "
        f"preemptions {report.preemptions}, lost {report.lost_gpu_hours:.1f} GPU-h"
    )
    print(
        f"    {run['plan_calls']} plan calls, {run['plan_wall_seconds']:.1f} s in fairshare.plan, "
        f"{run['wall_seconds']:.1f} s wall, {run['cpu_seconds']:.1f} s CPU"
    )


def goals(args: argparse.Namespace) -> None:
    trace = generate(
        args.goal_jobs, args.gpus, teams=make_teams(args.teams, args.seed), load=args.load,
        seed=args.seed,
    )  # fmt: skip
    print(
        f"Goals: {args.goal_jobs} synthetic jobs, {args.teams} teams, offered load {args.load} "
        f"on {args.gpus} GPUs, cycle {args.cycle_seconds} s, grace {args.grace_seconds} s"
    )
    report = run(trace, args.gpus, "fairshare", args, args.progress)
    print_report("fairshare", report)
    allocation = report.allocation
    oversubscribed = allocation["seconds_demand_exceeds_capacity"] or 0.0
    below = allocation["seconds_demand_exceeds_capacity_below_goal"] or 0.0
    held = allocation["while_demand_exceeds_capacity"]
    print(
        f"  goal 1, allocation >= {ALLOCATION_GOAL:.0%} whenever demand exceeds capacity: "
        f"{share(held)} time-weighted; below {ALLOCATION_GOAL:.0%} during {below:.0f} s of "
        f"{oversubscribed:.0f} s ({(below / oversubscribed if oversubscribed else 0):.2%}) -> "
        f"{'met' if held is not None and held >= ALLOCATION_GOAL else 'NOT met'} on average"
    )
    bound = args.cycle_seconds + args.grace_seconds
    longest = report.longest_below_guarantee_line_seconds
    worst = sorted(
        report.teams.items(),
        key=lambda item: -float(item[1]["longest_below_guarantee_line_seconds"]),
    )[:3]
    print(
        f"  goal 2, no team below min(guarantee, admissible demand) longer than cycle + grace "
        f"= {bound:.0f} s: longest {longest:.1f} s -> {'met' if longest <= bound else 'NOT met'}"
    )
    for name, team in worst:
        print(
            f"    {name}: guarantee {team['guarantee']}, longest "
            f"{team['longest_below_guarantee_line_seconds']:.1f} s, total "
            f"{team['seconds_below_guarantee_line']:.0f} s below, borrowed "
            f"{team['gpu_hours_borrowed']:.0f} GPU-h, lent {team['gpu_hours_lent']:.0f} GPU-h"
        )
    if args.compare:
        for policy in ("static", "fifo"):
            print_report(policy, run(trace, args.gpus, policy, args, args.progress))


def compare_surplus(
    title: str,
    trace: list[TraceJob],
    gpus: int,
    args: argparse.Namespace,
    *,
    nodes: list[ClusterNode] | None = None,
    guarantees: dict[str, int] | None = None,
) -> None:
    reports = {
        strength: run(
            trace, gpus, "fairshare", args, args.progress, nodes=nodes, guarantees=guarantees,
            usage_strength=strength,
        )
        for strength in (0.0, args.usage_strength)
    }  # fmt: skip
    # Both runs are judged over the same teams: those that wanted surplus in either.
    wanting = set().union(*(teams_wanting_surplus(r.teams) for r in reports.values()))
    print(f"  {title}: {len(trace)} jobs on {gpus} GPUs, {len(wanting)} teams wanted surplus")
    shares: dict[float, dict[str, float]] = {}
    for strength, report in reports.items():
        index, shares[strength] = surplus_fairness(report.teams, wanting)
        borrowed = sum(float(report.teams[t]["gpu_hours_borrowed"]) for t in report.teams)
        gang = report.gang_queueing_delay_seconds
        print(
            f"    strength {strength:g}: Jain's index of surplus share / weight {index:.3f}; "
            f"{borrowed:.0f} surplus GPU-h; allocation "
            f"{share(report.allocation['until_last_submission'])} until the last submission, "
            f"{share(report.allocation['while_demand_exceeds_capacity'])} while demand exceeds "
            f"capacity; queueing mean {report.queueing_delay_seconds['mean']:.0f} s "
            f"(gangs {gang['mean']:.0f} s); preemptions {report.preemptions}; "
            f"{report.run['cpu_seconds']:.0f} s CPU"
        )
    spread = sorted(wanting, key=lambda team: -shares[0.0][team])
    print(
        "    share of surplus / weight, strength 0 -> "
        f"{args.usage_strength:g}: "
        + ", ".join(
            f"{team} {shares[0.0][team]:.2f}->{shares[args.usage_strength][team]:.2f}"
            for team in spread
        )
    )


def fairness(args: argparse.Namespace) -> None:
    print(
        f"Decayed usage: strength {args.usage_strength:g} against 0, half-life "
        f"{args.half_life:.0f} s, cycle {args.cycle_seconds} s, grace {args.grace_seconds} s"
    )
    guarantees = load_helios_quotas(DEFAULT_HELIOS_QUOTAS, args.helios_date)
    capacity = sum(guarantees.values())
    openb = [
        dataclasses.replace(job, submit_time=job.submit_time * args.openb_arrival_scale)
        for job in load_trace(DEFAULT_OPENB_TRACE, "openb", guarantees, args.seed)
    ]
    compare_surplus(
        f"openb trace, arrivals x {args.openb_arrival_scale:g}, Helios Venus quotas of "
        f"{args.helios_date}",
        openb,
        capacity,
        args,
        nodes=uniform_cluster(capacity // 8, 8),
        guarantees=guarantees,
    )
    synthetic = generate(
        args.figure_jobs, args.figure_gpus, teams=make_teams(args.teams, args.seed),
        load=args.load, seed=args.seed,
    )  # fmt: skip
    compare_surplus(
        f"synthetic trace, offered load {args.load}, guarantees by GPU time",
        synthetic,
        args.figure_gpus,
        args,
    )


def topology(args: argparse.Namespace) -> None:
    gpus = args.figure_gpus
    nodes = rack_layout(uniform_cluster(gpus // 8, 8), args.rack_size)
    trace = generate(
        args.figure_jobs, gpus, teams=make_teams(args.teams, args.seed), load=args.load,
        seed=args.seed,
    )  # fmt: skip
    gangs = sum(1 for job in trace if job.gpus > 8)
    print(
        f"Topology: {len(trace)} synthetic jobs ({gangs} gangs of more than one node) on "
        f"{gpus} GPUs in racks of {args.rack_size} nodes of 8, offered load {args.load}"
    )
    for gang_topology, title in (("none", "placed blind to racks"), ("required", "one rack")):
        report = run(trace, gpus, "fairshare", args, args.progress, nodes=nodes,
                     gang_topology=gang_topology)  # fmt: skip
        gang = report.gang_queueing_delay_seconds
        print(
            f"  gangs {title}: gang wait mean {gang['mean']:.0f} s, p50 {gang['p50']:.0f} s, "
            f"p99 {gang['p99']:.0f} s, max {gang['max']:.0f} s; all jobs' wait mean "
            f"{report.queueing_delay_seconds['mean']:.0f} s; allocation "
            f"{share(report.allocation['until_last_submission'])} until the last submission, "
            f"{share(report.allocation['while_demand_exceeds_capacity'])} while demand exceeds "
            f"capacity; preemptions {report.preemptions}; {report.run['jobs_completed']}/"
            f"{report.run['jobs']} completed, {report.run['jobs_unfit']} unfit; "
            f"{report.run['cpu_seconds']:.0f} s CPU"
        )


def elastic_table(
    title: str, trace: list[TraceJob], config: SimulationConfig, args: argparse.Namespace
) -> None:
    print(f"  {title}: {len(trace)} jobs, {sum(1 for job in trace if job.gpus > 1)} multi-GPU")
    progress = progress_bar(sys.stderr) if args.progress else None
    comparison = compare_elastic(trace, config, args.elastic_share, progress)
    for line in comparison_lines(comparison):
        print(f"    {line}")
    cpu = comparison.whole_gang.run["cpu_seconds"] + comparison.elastic.run["cpu_seconds"]
    print(f"    {cpu:.1f} s CPU for both runs")


def elastic_over_seeds(
    trace: list[TraceJob], config: SimulationConfig, seeds: int, share: float
) -> None:
    """The Sia workload ``trace`` replayed for ``seeds`` draws of its elastic jobs: the
    spread of the goals' figures over them."""
    completion: list[float] = []
    owners: list[float] = []
    below: list[float] = []
    whole_gang_below = 0.0
    for seed in range(seeds):
        comparison = compare_elastic(trace, dataclasses.replace(config, seed=seed), share)
        base, elastic_run = comparison.whole_gang, comparison.elastic
        completion.append(
            elastic_run.completion_time_seconds["mean"] / base.completion_time_seconds["mean"]
        )
        waited = owner_waits(elastic_run)["mean"]
        owners.append(owner_waits(base)["mean"] / waited if waited else math.inf)
        below.append(elastic_run.longest_below_guarantee_line_seconds)
        whole_gang_below = base.longest_below_guarantee_line_seconds
    bound = config.cycle_seconds + config.grace_seconds
    print(
        f"    over {seeds} draws of the elastic jobs (seeds 0-{seeds - 1}): mean completion "
        f"{statistics.mean(completion):.2f}x whole-gang's (max {max(completion):.2f}x, above "
        f"0.8x in {sum(c > 0.8 for c in completion)}); owners wait "
        f"{statistics.mean(owners):.2f}x less on mean (under 2x in "
        f"{sum(o < 2 for o in owners)}); longest below line median "
        f"{statistics.median(below):.0f} s, max {max(below):.0f} s, over the bound of "
        f"{bound:g} s in {sum(b > bound for b in below)} (whole-gang {whole_gang_below:.0f} s)"
    )


def elastic(args: argparse.Namespace) -> None:
    print(
        f"Elastic jobs: whole-gang eviction against {args.elastic_share:g} of the multi-GPU jobs "
        f"elastic (half their ranks to all), cycle {args.cycle_seconds} s, grace "
        f"{args.grace_seconds} s, save {args.save_seconds} s"
    )

    def config(nodes: list[ClusterNode], guarantees: dict[str, int]) -> SimulationConfig:
        return SimulationConfig(
            nodes=nodes,
            guarantees=guarantees,
            cycle_seconds=args.cycle_seconds,
            grace_seconds=args.grace_seconds,
            save_seconds=args.save_seconds,
            checkpoint_interval=args.checkpoint_interval,
            restart_seconds=args.restart_seconds,
            seed=args.seed,
        )

    helios = load_helios_quotas(DEFAULT_HELIOS_QUOTAS, args.helios_date)
    capacity = sum(helios.values())
    if not args.skip_elastic_openb:
        openb = [
            dataclasses.replace(job, submit_time=job.submit_time * args.elastic_openb_arrival_scale)
            for job in load_trace(DEFAULT_OPENB_TRACE, "openb", helios, args.seed)
        ]
        elastic_table(
            f"openb trace, arrivals x {args.elastic_openb_arrival_scale:g}, Helios Venus quotas "
            f"of {args.helios_date} on {capacity} GPUs",
            openb,
            config(uniform_cluster(capacity // 8, 8), helios),
            args,
        )
    teams = {f"team-{i}": args.sia_gpus // args.sia_teams for i in range(args.sia_teams)}
    for number in (1, 2, 3):
        path = SHARED_DATA / f"sia_saturn_workload-{number}.csv"
        elastic_table(
            f"Sia workload {number}, {args.sia_teams} teams of {args.sia_gpus // args.sia_teams} "
            f"GPUs on {args.sia_gpus}",
            load_trace(path, "sia", teams, args.seed),
            config(uniform_cluster(args.sia_gpus // 8, 8), teams),
            args,
        )
        if args.elastic_seeds > 1:
            elastic_over_seeds(
                load_trace(path, "sia", teams, args.seed),
                config(uniform_cluster(args.sia_gpus // 8, 8), teams),
                args.elastic_seeds,
                args.elastic_share,
            )


def speed(args: argparse.Namespace) -> None:
    trace = generate(
        args.speed_jobs, args.gpus, teams=make_teams(args.teams, args.seed), load=args.load,
        seed=args.seed,
    )  # fmt: skip
    print(
        f"Speed: {args.speed_jobs} synthetic jobs on {args.gpus} GPUs, policy fairshare, "
        f"cycle {args.cycle_seconds} s"
    )
    profiler = cProfile.Profile() if args.profile else None
    started = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    report = run(trace, args.gpus, "fairshare", args, args.progress)
    if profiler is not None:
        profiler.disable()
    wall = time.perf_counter() - started
    print_report("fairshare", report)
    plan_seconds = float(report.run["plan_wall_seconds"])
    calls = int(report.run["plan_calls"]) or 1
    print(
        f"  wall {wall:.1f} s ({wall / 60:.1f} min) for {args.speed_jobs} jobs: "
        f"{args.speed_jobs / wall:.0f} jobs/s; fairshare.plan {plan_seconds:.1f} s "
        f"({plan_seconds / wall:.0%} of wall, {1000 * plan_seconds / calls:.2f} ms per call); "
        f"simulator itself {wall - plan_seconds:.1f} s; CPU time {report.run['cpu_seconds']:.1f} s "
        f"(wall exceeds CPU when the machine is shared)"
    )
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", type=int, default=1000)
    parser.add_argument("--teams", type=int, default=12)
    parser.add_argument("--load", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--goal-jobs", type=int, default=20000)
    parser.add_argument("--speed-jobs", type=int, default=100000)
    parser.add_argument("--cycle-seconds", type=float, default=10.0)
    parser.add_argument("--grace-seconds", type=float, default=120.0)
    parser.add_argument("--save-seconds", type=float, default=30.0)
    parser.add_argument("--checkpoint-interval", type=float, default=1800.0)
    parser.add_argument("--restart-seconds", type=float, default=60.0)
    parser.add_argument("--usage-strength", type=float, default=1.0)
    parser.add_argument("--half-life", type=float, default=7 * 86_400.0)
    parser.add_argument("--helios-date", default="2020-04-01")
    parser.add_argument("--openb-arrival-scale", type=float, default=0.005)
    parser.add_argument("--figure-jobs", type=int, default=10000)
    parser.add_argument("--figure-gpus", type=int, default=512)
    parser.add_argument("--rack-size", type=int, default=8, help="nodes per rack")
    parser.add_argument("--elastic-share", type=float, default=0.5)
    parser.add_argument("--elastic-openb-arrival-scale", type=float, default=0.0005)
    parser.add_argument("--sia-gpus", type=int, default=64)
    parser.add_argument("--sia-teams", type=int, default=4)
    parser.add_argument(
        "--elastic-seeds",
        type=int,
        default=16,
        help="draws of the elastic jobs each Sia workload is replayed for (1: the table alone)",
    )
    parser.add_argument("--skip-goals", action="store_true")
    parser.add_argument("--skip-fairness", action="store_true")
    parser.add_argument("--skip-topology", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-elastic", action="store_true")
    parser.add_argument("--only-elastic", action="store_true", help="issue 47's table alone")
    parser.add_argument(
        "--skip-elastic-openb",
        action="store_true",
        help="the Sia workloads alone (openb's two runs take minutes, more without the "
        "compiled engine)",
    )
    parser.add_argument("--compare", action="store_true", help="also run static and fifo")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    args = parser.parse_args()
    if args.only_elastic:
        elastic(args)
        return 0
    if not args.skip_goals:
        goals(args)
    if not args.skip_fairness:
        fairness(args)
    if not args.skip_topology:
        topology(args)
    if not args.skip_elastic:
        elastic(args)
    if not args.skip_speed:
        speed(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
