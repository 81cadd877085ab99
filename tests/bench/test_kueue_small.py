"""A small run of Kueue's scheduler performance test through the whole control plane:
the REST API, a real gunicorn portal, a Celery worker and beat over Redis, the cycle on
PostgreSQL and the mimic runtime (bench/kueue_qm.py). The figures must agree with the
config: every workload admitted once and finished, no queue above its nominal quota
plus borrowing limit, usage inside (0, 1], and inside a queue a higher priority of the
same size never admitted after a lower one that it was already waiting beside, unless
the lower one had victims chosen for it first (their GPUs are kept for it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.kueue_qm import arrival_groups, expand, load_config, run_quartermaster

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]
CONFIG = Path(__file__).with_name("kueue_small.yaml")


def test_the_small_config_runs_through_the_whole_control_plane(tmp_path: Path) -> None:
    expansion = expand(load_config(CONFIG))
    sizes = {(w.queue, w.name): (w.request, w.priority) for w in expansion.workloads}
    assert len(expansion.workloads) == 228

    figures = run_quartermaster(CONFIG, var_dir=tmp_path)

    assert figures["submission"]["errors"] == []
    # The workloads due together went in one batch request each.
    groups = arrival_groups(expansion.workloads, together=True)
    assert figures["submission"]["requests"] == len(groups) < len(expansion.workloads)
    assert figures["states"] == {"succeeded": 228}
    assert set(figures["admission"]) == {"small", "urgent", "medium", "large"}
    for name, times in figures["admission"].items():
        assert 0 <= times["p50_s"] <= times["p99_s"], name
        assert times["mean_s"] >= 0, name
    assert 0 < figures["usage"] <= 1
    assert figures["total_s"] >= max(w.arrival_s for w in expansion.workloads)
    for slug, team in figures["teams"].items():
        assert team["nominal"] == 20 and team["borrowing_limit"] == 20
        assert 0 < team["peak_gpus"] <= team["nominal"] + team["borrowing_limit"], slug

    jobs: list[dict[str, Any]] = figures["jobs"]
    longest_cycle = figures["worker_tasks"]["schedule_cycle"]["max_s"]
    for job in jobs:
        assert job["state"] == "succeeded" and job["attempts"] >= 1
        assert job["first_admitted_s"] <= job["admitted_s"]
        # A cycle stamps an admission as it writes it, after the snapshot that saw
        # the job's submission committed.
        assert job["admitted_s"] >= job["submitted_s"], job
        assert sizes[(job["queue"], job["name"])] == (
            {"small": 1, "urgent": 1, "medium": 4, "large": 15}[job["class"]],
            job["priority"],
        )
    compared = 0
    for high in jobs:
        for low in jobs:
            if (
                high["queue"] == low["queue"]
                and sizes[(high["queue"], high["name"])][0] == sizes[(low["queue"], low["name"])][0]
                and high["priority"] > low["priority"]
                # A job is visible to the cycle once its submission commits: after
                # its `submitted_at` (seconds after, for a batch on a loaded machine)
                # and before its request is answered. A cycle stamps an admission as
                # it writes it, having read the queue at most a cycle earlier.
                and high["answered_s"] + longest_cycle < low["first_admitted_s"]
                # The GPUs a victim releases are kept for the job it was preempted
                # for, whichever job arrives meanwhile: a lower one that had its
                # victims chosen first may start first.
                and not (
                    low["victims_chosen_s"] is not None
                    and low["victims_chosen_s"] <= low["first_admitted_s"]
                )
            ):
                compared += 1
                assert high["first_admitted_s"] <= low["first_admitted_s"], (high, low)
    # The config makes urgent jobs wait beside small ones; without such pairs the
    # order above would not have been tested.
    assert compared > 0
