"""How evenly a run divided the spare GPUs: shares of surplus against weight, Jain's index.

The surplus is what teams hold beyond their guarantees (``teams.*.gpu_hours_borrowed`` of
the report). A team's share of it is compared with its share of the weight among the teams
that wanted surplus at all during the run (``teams.*.seconds_wanting_surplus`` above
zero): a team that never asked for more than its guarantee neither got nor was denied any,
and counting it would lower the index of every policy alike.

Jain's fairness index of x_1..x_n is (sum x)^2 / (n * sum x^2): 1 when every x is equal,
1/n when one team has everything. Applied to share-of-surplus / share-of-weight it is 1
exactly when the surplus went by weight.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index of ``values`` (not negative); 1.0 for none or all zero."""
    numbers = list(values)
    if any(value < 0 for value in numbers):
        raise ValueError("Jain's index is defined for values of 0 or more")
    squares = sum(value * value for value in numbers)
    if not numbers or squares == 0:
        return 1.0
    return sum(numbers) ** 2 / (len(numbers) * squares)


def surplus_share_ratios(
    borrowed: Mapping[str, float], weights: Mapping[str, float]
) -> dict[str, float]:
    """Per team of ``weights``: its share of the borrowed GPU-hours over its share of the weight.

    A team missing from ``borrowed`` borrowed nothing. With nothing borrowed at all every
    team's ratio is 1.0 (nobody got more than another).
    """
    total_weight = sum(weights.values())
    if total_weight <= 0:
        raise ValueError("the weights must add up to more than 0")
    total_borrowed = sum(borrowed.get(team, 0.0) for team in weights)
    if total_borrowed <= 0:
        return dict.fromkeys(weights, 1.0)
    return {
        team: (borrowed.get(team, 0.0) / total_borrowed) / (weight / total_weight)
        for team, weight in weights.items()
    }


def teams_wanting_surplus(report_teams: Mapping[str, Mapping[str, Any]]) -> set[str]:
    """The teams of a report that wanted more than their guarantee at some time."""
    return {
        name
        for name, team in report_teams.items()
        if float(team.get("seconds_wanting_surplus", 0.0)) > 0
    }


def surplus_fairness(
    report_teams: Mapping[str, Mapping[str, Any]],
    teams: Iterable[str],
    weights: Mapping[str, float] | None = None,
) -> tuple[float, dict[str, float]]:
    """Jain's index of the surplus shares of ``teams`` in a report's ``teams``, and the shares.

    ``weights`` default to 1 per team (the simulator's queues all weigh 1). Pass the same
    ``teams`` for two runs that are compared, so that both are judged over the same set.
    """
    chosen = sorted(teams)
    weight_of = {team: (weights or {}).get(team, 1.0) for team in chosen}
    borrowed = {
        team: float(report_teams[team]["gpu_hours_borrowed"]) if team in report_teams else 0.0
        for team in chosen
    }
    ratios = surplus_share_ratios(borrowed, weight_of)
    return jain_index(ratios.values()), ratios
