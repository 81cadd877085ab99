"""The JSON scenario format and the command line, run as real processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fairshare import ScenarioError, plan, plan_to_dict, snapshot_from_dict, snapshot_to_dict

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "fairshare" / "examples"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fairshare", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def readme_commands() -> list[str]:
    text = (ROOT / "fairshare" / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_readme_commands_run_as_written() -> None:
    commands = readme_commands()
    assert len(commands) == 2
    for command in commands:
        assert command.startswith(".venv/bin/python -m fairshare ")
        done = subprocess.run(
            command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, done.stderr
        json.loads(done.stdout)


def test_plan_command_prints_the_plan() -> None:
    done = run_cli("plan", str(EXAMPLES / "two-teams.json"))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["preempt"] == [
        {"id": "train-2", "reason": "reclaim", "preemptor": "serve-1", "grace_seconds": 30.0}
    ]
    assert out["waiting"] == [
        {"id": "serve-1", "reason": "waiting for 8 GPUs being released by job train-2"}
    ]
    assert out["admit"] == []
    assert out["queues"]["product"]["h100"] == {
        "guarantee": 8,
        "usage": 0,
        "fair_share": 8.0,
        "borrowed": 0,
        "lent": 8,
    }


def test_diff_command_prints_the_consequences() -> None:
    done = run_cli("diff", str(EXAMPLES / "two-teams.json"), str(EXAMPLES / "lower-guarantee.json"))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["released"] == ["train-2"]
    assert out["reclaimed"] == []
    assert out["fair_share"]["product"]["h100"]["before"] == 8.0
    assert out["fair_share"]["product"]["h100"]["after"] < 8.0


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.pop("now"), "now"),
        (lambda d: d["nodes"][0].pop("gpus"), "nodes[0].gpus"),
        (lambda d: d["workloads"][0].update(queue="research"), "workloads[0].queue"),
        (lambda d: d["workloads"][0]["placement"][0].update(node="n9"), "workloads[0].placement"),
        (lambda d: d["workloads"][2].update(ranks="two"), "workloads[2].ranks"),
        (
            lambda d: d["priority_classes"][0].update(preemption_policy="Sometimes"),
            "priority_classes[0].preemption_policy",
        ),
        (lambda d: d["queues"][1].update(parent="nowhere"), "queues[1].parent"),
        (
            lambda d: d["priority_classes"][0].update(shrink_elastic="yes"),
            "priority_classes[0].shrink_elastic",
        ),
    ],
)
def test_malformed_scenario_exits_non_zero_naming_the_field(
    tmp_path: Path, mutate: object, field: str
) -> None:
    document = json.loads((EXAMPLES / "two-teams.json").read_text())
    mutate(document)  # type: ignore[operator]
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(document))
    done = run_cli("plan", str(path))
    assert done.returncode == 2
    assert field in done.stderr
    assert done.stdout == ""


def test_unknown_fields_ignored_and_defaults_applied() -> None:
    document = json.loads((EXAMPLES / "two-teams.json").read_text())
    document["colour"] = "blue"
    document["workloads"][2]["note"] = "ignored"
    snapshot = snapshot_from_dict(document)
    research = next(q for q in snapshot.queues if q.name == "research")
    assert research.weight == 1.0
    assert research.quota("h100").borrow_limit is None
    classes = {c.name: c for c in snapshot.priority_classes}
    assert classes["batch"].min_runtime_seconds == 0.0
    assert snapshot.workloads[0].last_checkpoint_at is None


def test_scenario_round_trip_gives_the_same_plan() -> None:
    document = json.loads((EXAMPLES / "two-teams.json").read_text())
    snapshot = snapshot_from_dict(document)
    again = snapshot_from_dict(json.loads(json.dumps(snapshot_to_dict(snapshot))))
    assert again == snapshot
    assert plan_to_dict(plan(again)) == plan_to_dict(plan(snapshot))


def test_a_resize_is_written_out_and_a_class_that_allows_it_read_back() -> None:
    """With batch allowed to resize elastic work, train-2 gives serve-1 one of its two
    ranks rather than leave whole: the plan says so under ``resize``, and the class's
    ``shrink_elastic`` survives a round trip. A plan that resizes nothing has no
    ``resize`` at all."""
    document = json.loads((EXAMPLES / "two-teams.json").read_text())
    assert "resize" not in plan_to_dict(plan(snapshot_from_dict(document)))
    document["priority_classes"][0]["shrink_elastic"] = True
    document["workloads"][1]["sizes"] = [1, 2]
    document["workloads"][2]["gpus_per_rank"] = 4
    snapshot = snapshot_from_dict(document)
    out = plan_to_dict(plan(snapshot))
    assert out["resize"] == [
        {
            "workload": "train-2",
            "ranks": 1,
            "placement": [{"node": "n1", "ranks": 1}],
            "reason": "shrunk from 2 to 1 ranks to reclaim team product's guarantee for job serve-1",
            "for_workload": "serve-1",
        }
    ]
    assert out["preempt"] == []
    assert out["waiting"] == [
        {"id": "serve-1", "reason": "waiting for 4 GPUs being released by job train-2"}
    ]
    again = snapshot_from_dict(json.loads(json.dumps(snapshot_to_dict(snapshot))))
    assert again == snapshot
    assert snapshot_to_dict(snapshot)["priority_classes"][0]["shrink_elastic"] is True


def test_integral_floats_accepted_fractions_refused() -> None:
    document = json.loads((EXAMPLES / "two-teams.json").read_text())
    document["nodes"][0]["gpus"] = 8.0
    assert snapshot_from_dict(document).nodes[0].gpus == 8
    document["nodes"][0]["gpus"] = 7.5
    with pytest.raises(ScenarioError, match=r"nodes\[0\]\.gpus"):
        snapshot_from_dict(document)


def test_a_preemptor_is_read_for_a_terminating_workload_and_refused_for_another() -> None:
    document = json.loads((EXAMPLES / "two-teams.json").read_text())
    running = next(w for w in document["workloads"] if w["state"] == "running")
    running["preemptor"] = "someone"
    with pytest.raises(ScenarioError, match=r"preemptor: only a terminating workload"):
        snapshot_from_dict(document)
    running["state"] = "terminating"
    snapshot = snapshot_from_dict(document)
    [read] = [w for w in snapshot.workloads if w.id == running["id"]]
    assert read.preemptor == "someone"
    assert (
        snapshot_to_dict(snapshot)["workloads"][
            [w.id for w in snapshot.workloads].index(running["id"])
        ]["preemptor"]
        == "someone"
    )


def test_an_elastic_workload_reads_its_sizes_and_writes_them_back() -> None:
    document = json.loads((EXAMPLES / "two-teams.json").read_text())
    document["workloads"][2].update(ranks=8, gpus_per_rank=1, sizes=[2, 4, 8])
    snapshot = snapshot_from_dict(document)
    assert snapshot.workloads[2].sizes == (2, 4, 8)
    assert snapshot_to_dict(snapshot)["workloads"][2]["sizes"] == [2, 4, 8]
    assert "sizes" not in snapshot_to_dict(snapshot)["workloads"][0]


@pytest.mark.parametrize(
    ("sizes", "words"),
    [
        ([4, 2, 8], "must be ascending rank counts"),
        ([0, 8], "sizes[0]: must be at least 1"),
        ([2, 4], "must include the workload's 8 ranks"),
        ([2, 4.5, 8], "sizes[1]: expected an integer"),
        ("2:8", "sizes: expected a list"),
    ],
)
def test_malformed_sizes_are_refused_naming_the_field(sizes: object, words: str) -> None:
    document = json.loads((EXAMPLES / "two-teams.json").read_text())
    document["workloads"][2].update(ranks=8, gpus_per_rank=1, sizes=sizes)
    with pytest.raises(ScenarioError, match=re.escape("workloads[2].") + ".*" + re.escape(words)):
        snapshot_from_dict(document)
