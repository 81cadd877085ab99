"""Fairness of the surplus: Jain's index and shares against weight, on hand-computed cases."""

from __future__ import annotations

import pytest

from simulation.fairness import (
    jain_index,
    surplus_fairness,
    surplus_share_ratios,
    teams_wanting_surplus,
)
from simulation.report import Ledger


@pytest.mark.parametrize(
    ("values", "index"),
    [
        ([1.0, 1.0, 1.0, 1.0], 1.0),
        ([4.0, 0.0, 0.0, 0.0], 0.25),  # one of four has everything: 1/n
        ([1.0, 2.0], 9 / 10),  # (1+2)^2 / (2 * (1+4))
        ([1.0, 2.0, 3.0], 36 / 42),  # 6^2 / (3 * 14)
        ([5.0], 1.0),
        ([], 1.0),
        ([0.0, 0.0], 1.0),
    ],
)
def test_jain_index_of_known_vectors(values: list[float], index: float) -> None:
    assert jain_index(values) == pytest.approx(index)


def test_jain_index_refuses_negative_values() -> None:
    with pytest.raises(ValueError, match="0 or more"):
        jain_index([1.0, -1.0])


def test_surplus_shares_against_weight() -> None:
    # a got 30 of 40 borrowed GPU-hours with weight 1 of 2: share 0.75 over 0.5 = 1.5;
    # b 10 of 40 with weight 1 of 2 = 0.5. With weights 3:1 a's share matches its weight.
    assert surplus_share_ratios({"a": 30, "b": 10}, {"a": 1, "b": 1}) == pytest.approx(
        {"a": 1.5, "b": 0.5}
    )
    assert surplus_share_ratios({"a": 30, "b": 10}, {"a": 3, "b": 1}) == pytest.approx(
        {"a": 1.0, "b": 1.0}
    )
    # A team that borrowed nothing is 0; nobody borrowing at all is even.
    assert surplus_share_ratios({"a": 8}, {"a": 1, "c": 1}) == pytest.approx({"a": 2, "c": 0})
    assert surplus_share_ratios({}, {"a": 1, "b": 2}) == {"a": 1.0, "b": 1.0}
    with pytest.raises(ValueError, match="weights"):
        surplus_share_ratios({"a": 1}, {})


def test_surplus_fairness_of_a_report_over_the_chosen_teams() -> None:
    teams = {
        "a": {"gpu_hours_borrowed": 30.0, "seconds_wanting_surplus": 100.0},
        "b": {"gpu_hours_borrowed": 10.0, "seconds_wanting_surplus": 50.0},
        "c": {"gpu_hours_borrowed": 0.0, "seconds_wanting_surplus": 0.0},
    }
    assert teams_wanting_surplus(teams) == {"a", "b"}
    index, ratios = surplus_fairness(teams, {"a", "b"})
    assert ratios == pytest.approx({"a": 1.5, "b": 0.5})
    assert index == pytest.approx(jain_index([1.5, 0.5]))  # = 4 / (2 * 2.5) = 0.8
    assert index == pytest.approx(0.8)
    # A team of the set that the other run's report lacks counts as having borrowed nothing.
    index, ratios = surplus_fairness(teams, {"a", "d"})
    assert ratios == pytest.approx({"a": 2.0, "d": 0.0})
    assert index == pytest.approx(0.5)


def test_the_ledger_counts_time_wanting_surplus_and_gang_waits() -> None:
    # Team a (guarantee 4) holds 4 GPUs from t=0 and asks for 2 more from t=10 to t=30:
    # 20 s wanting surplus. Team b (guarantee 4) waits for 2 GPUs it could have inside its
    # guarantee: that is no surplus.
    ledger = Ledger(8, {"a": 4, "b": 4})
    ledger.advance(0)
    ledger.job_pending("a", 4, requeued=False)
    ledger.job_admitted("a", 4)
    ledger.advance(10)
    ledger.job_pending("a", 2, requeued=False)
    ledger.job_pending("b", 2, requeued=False)
    ledger.advance(30)
    ledger.job_admitted("a", 2)
    ledger.job_admitted("b", 2)
    ledger.advance(40)
    ledger.job_finished("a", 50.0, 20.0, gang=True)
    ledger.job_finished("b", 50.0, 5.0)
    ledger.close(40)
    report = ledger.report().to_dict()
    assert report["teams"]["a"]["seconds_wanting_surplus"] == pytest.approx(20)
    assert report["teams"]["b"]["seconds_wanting_surplus"] == 0
    assert report["gang_queueing_delay_seconds"]["max"] == pytest.approx(20)
    assert report["queueing_delay_seconds"]["mean"] == pytest.approx(12.5)
