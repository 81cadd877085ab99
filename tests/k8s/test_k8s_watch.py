"""Observation from the pod watch: the same answers, without listing every pod each cycle."""

from __future__ import annotations

from collections.abc import Callable

from kubernetes import client

from preemption.runtimes.kubernetes import KubernetesRuntime
from tools.k8s.gangs import all_in, gang_spec, phases
from tools.k8s.requests import Recorder
from tools.k8s.wait import wait_for

MakeRuntime = Callable[..., KubernetesRuntime]


def _cycle(runtime: KubernetesRuntime) -> None:
    """What a reconcile cycle asks of the runtime."""
    runtime.observe(None)
    runtime.guard_victims()


def test_watched_observation_matches_a_listing_and_lists_no_pods(
    make_runtime: MakeRuntime, k8s_api: client.ApiClient
) -> None:
    listing = make_runtime()
    watching = make_runtime(watch_pods=True)
    listed, watched = Recorder(listing.api_client), Recorder(watching.api_client)

    spec = gang_spec(801, {"gpu-node-0": 8, "gpu-node-1": 8})
    gang = spec.gang
    watching.launch(spec)
    # Right after launch the watch may not have every pod yet: never "lost".
    assert "lost" not in phases(watching, gang)
    wait_for(lambda: all_in(watching, gang, "running", 16), timeout=60, what="16 running")
    wait_for(lambda: watching.observe() == listing.observe(), timeout=10, what="same view")

    def pod_lists(recorder: Recorder, cycles: int) -> int:
        before = recorder.count("", "pods", "list")
        for _ in range(cycles):
            _cycle(watching if recorder is watched else listing)
        return recorder.count("", "pods", "list") - before

    assert pod_lists(listed, 5) == 10  # two full pod listings per cycle
    assert pod_lists(watched, 5) == 0
    relists = watching.relists

    watching.signal(gang, 5)
    watching.kill(gang)
    wait_for(lambda: all_in(watching, gang, "exited", 16), timeout=30, what="16 exited")
    assert watching.observe(gang) == listing.observe(gang)
    watching.forget(gang)
    wait_for(lambda: watching.observe(gang) == [], timeout=30, what="gang forgotten")
    assert watching.relists == relists  # one listing, then only the watch
