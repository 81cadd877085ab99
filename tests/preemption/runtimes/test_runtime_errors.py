"""Every runtime raises only the protocol's two errors: the exceptions of the
libraries it uses (the operating system's, the Kubernetes client's, urllib3's)
arrive translated, with the original as the cause. And the gang guard is a
capability a runtime declares, not a method the reconciler probes for."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import urllib3
from kubernetes import client

from preemption.runtimes import (
    GangId,
    GangSpec,
    LocalRuntime,
    NodeInventory,
    RankPlacement,
    RuntimeTemporaryError,
)
from preemption.runtimes.kubernetes import KubernetesRuntime
from preemption.runtimes.records import RANK_LOG

GANG = GangId(7, 1)
SPEC = GangSpec(
    job_id=7,
    attempt=1,
    command="true",
    ranks=(RankPlacement(rank=0, node="node-0", local_rank=0),),
    gpus_per_rank=1,
    grace_seconds=5.0,
    priority_class="batch",
    env={},
)


def test_an_os_error_of_the_local_runtime_is_temporary(tmp_path: Path) -> None:
    runtime = LocalRuntime(root=tmp_path, inventory=[NodeInventory("node-0", "h100", 8)])
    # Something other than a log file where the rank's log belongs.
    (runtime.gang_dir(GANG) / "0" / RANK_LOG).mkdir(parents=True)
    with pytest.raises(RuntimeTemporaryError, match="read_log: IsADirectoryError") as caught:
        runtime.read_log(GANG, 0)
    assert isinstance(caught.value.__cause__, IsADirectoryError)
    assert runtime.gang_guard is None


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_unreachable_api_server_is_a_temporary_error_on_every_call() -> None:
    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{_closed_port()}"
    configuration.retries = 0
    runtime = KubernetesRuntime(client.ApiClient(configuration))
    try:
        assert runtime.gang_guard is runtime
        calls = {
            "launch": lambda: runtime.launch(SPEC),
            "signal": lambda: runtime.signal(GANG, 5.0),
            "kill": lambda: runtime.kill(GANG),
            "observe": lambda: runtime.observe(None),
            "nodes": runtime.nodes,
            "read_log": lambda: runtime.read_log(GANG, 0),
            "forget": lambda: runtime.forget(GANG),
            "guard_victims": runtime.guard_victims,
        }
        for name, call in calls.items():
            with pytest.raises(RuntimeTemporaryError) as caught:
                call()
            cause = caught.value.__cause__
            assert isinstance(cause, urllib3.exceptions.HTTPError | OSError), (name, cause)
    finally:
        runtime.close()
