"""Each rank of the local runtime sees only the GPUs of its placement.

The runtime gives each rank concrete GPU indices on its node, none held by another live
gang there, records them in the gang's record and hands them to the rank as
CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES (gpu_slots.py). Proven with real rank
processes that print what they were given.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from preemption.runtimes import (
    GangId,
    GangSpec,
    LocalRuntime,
    RankPlacement,
    RuntimeTemporaryError,
    parse_inventory,
)
from preemption.runtimes.gpu_slots import GpuShortage, assign_gpus
from preemption.runtimes.records import GANG_FILE, read_record
from preemption.runtimes.runner import RunnerAccount
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(90)

INVENTORY = "node-a:h100-80gb:8,node-b:h100-80gb:4"

# Each rank prints the GPUs it was given, then stays until the test ends it, so that
# its gang stays live while later gangs launch.
SHOW_GPUS = (
    'echo "cuda=$CUDA_VISIBLE_DEVICES nvidia=$NVIDIA_VISIBLE_DEVICES"; '
    'if [ "${STAY:-1}" = 1 ]; then exec sleep 60; fi'
)


def gang(
    job_id: int,
    *,
    ranks: int = 1,
    gpus_per_rank: int = 4,
    node: str = "node-a",
    team: str = "vision",
    stay: bool = True,
) -> GangSpec:
    """A gang of ``ranks`` ranks of ``gpus_per_rank`` GPUs, all on ``node``."""
    return GangSpec(
        job_id=job_id,
        attempt=1,
        command=SHOW_GPUS,
        ranks=tuple(RankPlacement(rank=rank, node=node, local_rank=rank) for rank in range(ranks)),
        gpus_per_rank=gpus_per_rank,
        grace_seconds=5.0,
        priority_class="ai-batch-preemptible",
        env={"QM_JOB_ID": str(job_id), "QM_ATTEMPT": "1", "STAY": "1" if stay else "0"},
        team=team,
        flavor="h100-80gb",
    )


@pytest.fixture
def runtime(runner_tmp_path: Path, runner_account: RunnerAccount) -> Iterator[LocalRuntime]:
    local = LocalRuntime(
        runner_tmp_path / "runs", parse_inventory(INVENTORY), runner=runner_account
    )
    yield local
    for launched in {GangId(o.job_id, o.attempt) for o in local.observe()}:
        local.kill(launched)
        wait_until(
            lambda launched=launched: not local.gang_processes(launched),  # type: ignore[misc]
            what="teardown",
        )


def shown_gpus(runtime: LocalRuntime, spec: GangSpec) -> list[tuple[str, str]]:
    """What each rank of the gang printed: (CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES)."""
    pattern = re.compile(rb"cuda=(\S*) nvidia=(\S*)\n")

    def printed() -> bool:
        return all(pattern.search(runtime.read_log(spec.gang, rank.rank)) for rank in spec.ranks)

    wait_until(printed, what=f"every rank of {spec.gang} to print its GPUs")
    shown = []
    for rank in sorted(spec.ranks, key=lambda placement: placement.rank):
        found = pattern.search(runtime.read_log(spec.gang, rank.rank))
        assert found is not None
        shown.append((found.group(1).decode(), found.group(2).decode()))
    return shown


def indices(shown: tuple[str, str]) -> set[int]:
    cuda, nvidia = shown
    assert cuda == nvidia, shown
    return {int(index) for index in cuda.split(",")} if cuda else set()


def recorded(runtime: LocalRuntime, spec: GangSpec) -> list[list[int]]:
    record = read_record(runtime.gang_dir(spec.gang) / GANG_FILE)
    assert record is not None
    gpu_indices: list[list[int]] = record["gpu_indices"]
    return gpu_indices


def wait_exited(runtime: LocalRuntime, spec: GangSpec) -> None:
    wait_until(
        lambda: all(o.phase == "exited" for o in runtime.observe(spec.gang)),
        what=f"every rank of {spec.gang} to exit",
    )


def test_two_teams_on_one_node_see_disjoint_halves_of_its_gpus(runtime: LocalRuntime) -> None:
    vision, speech = gang(1, team="vision"), gang(2, team="speech")
    runtime.launch(vision)
    runtime.launch(speech)

    [vision_gpus] = [indices(shown) for shown in shown_gpus(runtime, vision)]
    [speech_gpus] = [indices(shown) for shown in shown_gpus(runtime, speech)]
    assert len(vision_gpus) == 4 and len(speech_gpus) == 4
    assert not vision_gpus & speech_gpus
    assert vision_gpus | speech_gpus == set(range(8))
    assert recorded(runtime, vision) == [sorted(vision_gpus)]
    assert recorded(runtime, speech) == [sorted(speech_gpus)]


def test_a_launch_after_a_gang_exited_reuses_its_gpus(runtime: LocalRuntime) -> None:
    # The first gang stays until the second has its GPUs and is then ended: a first
    # gang that left on its own could be over before the second launched (a loaded
    # machine), which then took the same GPUs.
    first, second = gang(1), gang(2)
    runtime.launch(first)
    runtime.launch(second)
    [first_gpus] = [indices(shown) for shown in shown_gpus(runtime, first)]
    [second_gpus] = [indices(shown) for shown in shown_gpus(runtime, second)]
    assert not first_gpus & second_gpus
    runtime.kill(first.gang)
    wait_exited(runtime, first)

    third = gang(3)
    runtime.launch(third)

    [third_gpus] = [indices(shown) for shown in shown_gpus(runtime, third)]
    assert third_gpus == first_gpus
    assert not third_gpus & second_gpus


def test_concurrent_launches_never_share_a_gpu(
    runtime: LocalRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every launch pauses between reading what live gangs hold and writing its own
    # record: without the node's lock, all four would read a free node and take the
    # same GPUs.
    held_gpus = LocalRuntime._held_gpus

    def slow_held_gpus(self: LocalRuntime, nodes: set[str]) -> dict[str, set[int]]:
        held = held_gpus(self, nodes)
        threading.Event().wait(0.2)
        return held

    monkeypatch.setattr(LocalRuntime, "_held_gpus", slow_held_gpus)
    specs = [gang(job_id, gpus_per_rank=2) for job_id in range(1, 5)]
    start = threading.Barrier(len(specs))
    failures: list[BaseException] = []

    def launch(spec: GangSpec) -> None:
        start.wait()
        try:
            runtime.launch(spec)
        except BaseException as error:  # reported by the assertion below
            failures.append(error)

    threads = [threading.Thread(target=launch, args=(spec,)) for spec in specs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert failures == []
    given = [indices(shown) for spec in specs for shown in shown_gpus(runtime, spec)]
    assert sorted(len(gpus) for gpus in given) == [2, 2, 2, 2]
    assert set().union(*given) == set(range(8)), given


def test_the_ranks_of_one_gang_on_one_node_get_disjoint_gpus(runtime: LocalRuntime) -> None:
    spec = gang(1, ranks=2, gpus_per_rank=2, node="node-b")

    runtime.launch(spec)

    assert shown_gpus(runtime, spec) == [("0,1", "0,1"), ("2,3", "2,3")]
    assert recorded(runtime, spec) == [[0, 1], [2, 3]]


def test_a_restarted_runtime_keeps_the_allocation_it_reads_from_the_records(
    runtime: LocalRuntime,
) -> None:
    first = gang(1, gpus_per_rank=6)
    runtime.launch(first)
    [first_gpus] = [indices(shown) for shown in shown_gpus(runtime, first)]

    restarted = LocalRuntime(runtime.root, parse_inventory(INVENTORY), runner=runtime.runner)
    second = gang(2, gpus_per_rank=2)
    restarted.launch(second)

    [second_gpus] = [indices(shown) for shown in shown_gpus(restarted, second)]
    assert first_gpus == set(range(6))
    assert second_gpus == {6, 7}


def test_a_launch_without_free_gpus_is_refused_naming_the_node(runtime: LocalRuntime) -> None:
    runtime.launch(gang(1, gpus_per_rank=6))
    refused = gang(2, gpus_per_rank=4)

    # Refused for now: the launch is tried again (with backoff, a bounded number of
    # times) in case the gang holding them is ending.
    with pytest.raises(RuntimeTemporaryError, match="node node-a has 2 of its 8 GPUs free"):
        runtime.launch(refused)

    # Nothing of the refused gang exists: no record, no rank, no entry in the index.
    gang_dir = runtime.gang_dir(refused.gang)
    assert not (gang_dir / GANG_FILE).exists()
    assert not [path for path in gang_dir.iterdir() if path.name.isdigit()]
    assert [o.job_id for o in runtime.observe()] == [1]


def test_a_rank_of_no_gpus_sees_none(runtime: LocalRuntime) -> None:
    spec = gang(1, gpus_per_rank=0, stay=False)

    runtime.launch(spec)

    assert shown_gpus(runtime, spec) == [("", "")]


def _placements(*nodes: str) -> tuple[RankPlacement, ...]:
    """Ranks 0, 1, ... on the nodes given, numbered per node in order."""
    seen: dict[str, int] = {}
    placements = []
    for rank, node in enumerate(nodes):
        placements.append(RankPlacement(rank=rank, node=node, local_rank=seen.get(node, 0)))
        seen[node] = seen.get(node, 0) + 1
    return tuple(placements)


@pytest.mark.parametrize(
    ("placements", "gpus_per_rank", "held", "expected"),
    [
        pytest.param(_placements("a"), 2, {}, [[0, 1]], id="lowest-first"),
        pytest.param(_placements("a", "a"), 2, {"a": {0, 2}}, [[1, 3], [4, 5]], id="skips-held"),
        pytest.param(
            _placements("a", "b", "a"), 1, {"b": {0}}, [[0], [1], [1]], id="per-node-numbering"
        ),
        pytest.param(
            _placements("a"), 0, {"a": set(range(8))}, [[]], id="no-gpus-fits-a-full-node"
        ),
    ],
)
def test_assign_gpus(
    placements: tuple[RankPlacement, ...],
    gpus_per_rank: int,
    held: dict[str, set[int]],
    expected: list[list[int]],
) -> None:
    assert assign_gpus(placements, gpus_per_rank, {"a": 8, "b": 4}, held) == expected


def test_assign_gpus_names_the_node_short_of_gpus() -> None:
    with pytest.raises(GpuShortage, match=r"node b has 3 of its 4 GPUs free, .* need 4"):
        assign_gpus(_placements("a", "b", "b"), 2, {"a": 8, "b": 4}, {"b": {3}})
