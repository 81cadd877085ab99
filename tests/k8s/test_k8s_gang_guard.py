"""When something else takes one rank away, the rest of the gang is stopped at once."""

from __future__ import annotations

from collections.abc import Callable

from kubernetes import client

from preemption.runtimes.base import GangId, RankObservation
from preemption.runtimes.kubernetes import KubernetesRuntime
from preemption.runtimes.kubernetes.config import pod_name
from preemption.runtimes.kubernetes.observe import gang_guard_victims
from tools.k8s.agent_state import ANNOTATION_EXIT_ON_TERM, ANNOTATION_TERM_SECONDS, NodeSpec
from tools.k8s.gangs import all_in, gang_spec
from tools.k8s.node_agent import NodeAgent
from tools.k8s.wait import wait_for

MakeRuntime = Callable[..., KubernetesRuntime]


def rank(number: int, phase: str, *, exit_code: int | None = None, signalled: bool = False):
    return RankObservation(
        job_id=1,
        attempt=1,
        rank=number,
        node="n",
        phase=phase,
        exit_code=exit_code,
        handle=f"qm-1-1-r{number}",
        started_at=1.0,
        exited_at=None,
        signal_sent_at=2.0 if signalled else None,
    )


def test_gang_guard_rules_on_plain_observations():
    gang = GangId(1, 1)
    cases = {
        "all running": ([rank(0, "running"), rank(1, "running")], []),
        "one preempted by someone else": ([rank(0, "terminating"), rank(1, "running")], [gang]),
        "one lost with its node": ([rank(0, "lost"), rank(1, "running")], [gang]),
        "one crashed": ([rank(0, "exited", exit_code=1), rank(1, "running")], [gang]),
        "one finished cleanly first": ([rank(0, "exited", exit_code=0), rank(1, "running")], []),
        "already signalled by us": (
            [rank(0, "terminating", signalled=True), rank(1, "running", signalled=True)],
            [],
        ),
        "nobody left waiting": ([rank(0, "lost"), rank(1, "exited", exit_code=137)], []),
    }
    for name, (observations, expected) in cases.items():
        assert gang_guard_victims(observations) == expected, name
    # A preempted rank whose trap checkpointed in time exits 0: its disruption
    # condition still tells it apart from a rank that finished.
    preempted_cleanly = [rank(0, "exited", exit_code=0), rank(1, "running")]
    assert gang_guard_victims(preempted_cleanly, disrupted={(1, 1, 0)}) == [gang]


def test_kube_scheduler_preempting_one_rank_stops_the_whole_gang(
    make_runtime: MakeRuntime, k8s_api: client.ApiClient, namespace: str
):
    runtime = make_runtime(
        pod_annotations={ANNOTATION_TERM_SECONDS: "1", ANNOTATION_EXIT_ON_TERM: "0"}
    )
    core = client.CoreV1Api(k8s_api)
    spec = gang_spec(201, {"gpu-node-2": 8}, priority_class="qm-test-low")
    gang = spec.gang
    runtime.launch(spec)
    wait_for(lambda: all_in(runtime, gang, "running", 8), timeout=60)

    # A higher-priority pod that needs one GPU of the full node: kube-scheduler
    # must preempt one rank for it.
    core.create_namespaced_pod(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "urgent"},
            "spec": {
                "restartPolicy": "Never",
                "priorityClassName": "qm-test-high",
                "nodeSelector": {"kubernetes.io/hostname": "gpu-node-2"},
                "containers": [
                    {
                        "name": "urgent",
                        "image": "none",
                        "resources": {"limits": {"nvidia.com/gpu": "1"}},
                    }
                ],
            },
        },
    )
    disrupted = wait_for(lambda: runtime.disruptions(gang), timeout=30, what="a preempted rank")
    assert list(disrupted.values()) == ["PreemptionByScheduler"]
    preempted_rank = next(iter(disrupted))
    # Let the victim finish its (simulated) checkpoint and exit 0: the guard
    # must still tell it was taken away rather than done.
    wait_for(
        lambda: runtime.observe(gang)[preempted_rank].phase == "exited",
        timeout=30,
        what="the preempted rank exited",
    )
    assert runtime.observe(gang)[preempted_rank].exit_code == 0
    assert runtime.guard_victims() == [gang]

    signalled = runtime.enforce_gang_guard(lambda _: 5.0)
    assert signalled == [gang]
    # Level-triggered: once signalled, the gang is not picked again.
    assert runtime.enforce_gang_guard(lambda _: 5.0) == []
    wait_for(lambda: all_in(runtime, gang, "exited", 8), timeout=30, what="whole gang stopped")
    observed = runtime.observe(gang)
    assert [o.exit_code for o in observed] == [0] * 8
    for observation in observed:
        if observation.rank == preempted_rank:
            assert observation.handle == pod_name(gang, preempted_rank)
        else:
            assert observation.signal_sent_at is not None
    wait_for(
        lambda: core.read_namespaced_pod("urgent", namespace).spec.node_name == "gpu-node-2",
        timeout=30,
        what="the preemptor bound",
    )


def test_a_lost_node_marks_its_ranks_lost_and_the_guard_stops_the_rest(
    make_runtime: MakeRuntime, k8s_api: client.ApiClient, namespace: str, kubeconfig: str, tmp_path
):
    # A node of its own, so losing it does not disturb the shared agent's nodes.
    from kubernetes import config

    configuration = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    api = client.ApiClient(configuration)
    agent = NodeAgent(api, [NodeSpec("gpu-node-doomed", gpus=4)], work_dir=tmp_path / "agent")
    agent.start()
    try:
        runtime = make_runtime(pod_annotations={ANNOTATION_EXIT_ON_TERM: "0"})
        spec = gang_spec(202, {"gpu-node-doomed": 2, "gpu-node-3": 2})
        gang = spec.gang
        runtime.launch(spec)
        wait_for(lambda: all_in(runtime, gang, "running", 4), timeout=60)
        agent.lose_node("gpu-node-doomed")
        # The node lifecycle controller marks it NotReady after its grace period.
        wait_for(
            lambda: [o.phase for o in runtime.observe(gang)][:2] == ["lost", "lost"],
            timeout=40,
            what="ranks on the lost node seen as lost",
        )
        assert runtime.enforce_gang_guard(lambda _: 5.0) == [gang]
        wait_for(
            lambda: (
                [(o.phase, o.exit_code) for o in runtime.observe(gang)][2:]
                == [("exited", 0), ("exited", 0)]
            ),
            timeout=30,
            what="surviving ranks stopped",
        )
        runtime.kill(gang)
    finally:
        agent.stop()
        api.close()
