"""Rank logs on Kubernetes: the end of each is kept after the pods are gone,
and no read can make a process hold a whole log."""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone
from kubernetes import client

from preemption.logs import read_rank_log
from preemption.models import Attempt, Job, JobState, Rank, RankLogTail
from preemption.reconcile import reconcile_jobs
from preemption.runtime import use_runtime
from preemption.runtimes.base import GangId, RuntimePermanentError
from preemption.runtimes.kubernetes import KubernetesRuntime
from preemption.services import job_submit
from quotas.models import PriorityClass
from tests.conftest import PASSWORD
from tools.k8s.agent_state import ANNOTATION_RUN
from tools.k8s.gangs import all_in, gang_spec, kept_log
from tools.k8s.wait import wait_for

MakeRuntime = Callable[..., KubernetesRuntime]
# About 600 kB of output between a first and a last line, then a failure.
NOISY = (
    "printf 'first line\\n'; head -c 600000 /dev/zero | tr '\\0' x; "
    "printf '\\nthe end of rank %s\\n' \"$RANK\"; exit 3"
)


def test_a_failed_ranks_log_is_readable_after_its_pods_are_gone(
    world: Any,
    make_runtime: MakeRuntime,
    k8s_api: client.ApiClient,
    namespace: str,
    settings: Any,
) -> None:
    settings.QM_LOG_TAIL_BYTES = 256 * 1024
    runtime = make_runtime(pod_annotations={ANNOTATION_RUN: "process"})
    low = PriorityClass.objects.create(name="qm-test-low", value=100, preemption_policy="Never")
    # The team may use it: every top-level team has a list of its classes.
    world.org.priority_classes.add(low)
    job = job_submit(
        submitter=world.users["researcher"],
        team=world.vision,
        flavor=world.h100,
        ranks=2,
        gpus_per_rank=1,
        command=NOISY,
        priority_class=low,
        max_attempts=1,
    )
    attempt = Attempt.objects.create(job=job, number=1, admitted_at=timezone.now())
    Rank.objects.bulk_create(Rank(attempt=attempt, index=i, node="gpu-node-2") for i in range(2))
    Job.objects.filter(pk=job.pk).update(state=JobState.ADMITTED)

    deadline = time.monotonic() + 90
    while Attempt.objects.get(pk=attempt.pk).ended_at is None:
        assert time.monotonic() < deadline, "the attempt never ended"
        reconcile_jobs(runtime=runtime)
        time.sleep(0.3)
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    core = client.CoreV1Api(k8s_api)
    wait_for(lambda: core.list_namespaced_pod(namespace).items == [], timeout=30, what="pods gone")
    assert runtime.read_log(GangId(job.pk, 1), 1) == b""  # the cluster has nothing left

    tail = RankLogTail.objects.get(attempt=attempt, rank=1)
    assert len(tail.content) == 256 * 1024
    assert (
        tail.first_byte
        == len(b"first line\n") + 600000 + len(b"\nthe end of rank 1\n") - 256 * 1024
    )
    chunk, next_offset = read_rank_log(job=job, attempt=1, rank=1, offset=0, limit=1 << 20)
    text = chunk.decode()
    assert text.startswith(f"[the first {tail.first_byte} bytes of this log were not kept]\n")
    assert text.endswith("x\nthe end of rank 1\n") and "first line" not in text
    assert next_offset == tail.first_byte + 256 * 1024

    # The researcher reads it in the browser; an outsider gets nothing.
    use_runtime(runtime)
    try:
        browser = Client()
        assert browser.login(username="researcher", password=PASSWORD)
        url = f"/jobs/{job.pk}/attempts/1/ranks/1/log/"
        last = browser.get(url, {"raw": 1, "offset": next_offset - 100})
        assert last.status_code == 200
        assert last.content.decode().endswith("the end of rank 1\n")
        outsider = Client()
        assert outsider.login(username="other_researcher", password=PASSWORD)
        assert outsider.get(url, {"raw": 1}).status_code == 404
    finally:
        use_runtime(None)


def test_live_log_reads_are_bounded(make_runtime: MakeRuntime, settings: Any) -> None:
    runtime = make_runtime(pod_annotations={ANNOTATION_RUN: "process"}, log_scan_bytes=4 << 20)
    size = 3_000_000
    spec = gang_spec(
        601, {"gpu-node-3": 1}, command=f"head -c {size} /dev/zero | tr '\\0' y; echo; sleep 600"
    )
    runtime.launch(spec)
    gang = spec.gang
    wait_for(lambda: all_in(runtime, gang, "running", 1), timeout=60, what="rank running")
    wait_for(
        lambda: runtime.read_log(gang, 0, size, 1) == b"\n", timeout=60, what="the log written"
    )
    tracemalloc.start()
    try:
        chunk = runtime.read_log(gang, 0, 2_500_000, 1024)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert chunk == b"y" * 1024
    # Streamed, not loaded: far less than the 2.5 MB skipped.
    assert peak < 512 * 1024, peak
    with pytest.raises(RuntimePermanentError, match="read up to byte 4194304 only"):
        runtime.read_log(gang, 0, 10**12, 1024)
    with pytest.raises(RuntimePermanentError, match="bad log range"):
        runtime.read_log(gang, 0, -1, 1024)
    tail, first_byte = runtime.read_log_tail(gang, 0, 1000)
    assert tail == b"y" * 999 + b"\n" and first_byte == size + 1 - 1000
    runtime.kill(gang)


def test_a_signalled_ranks_log_is_followed_until_its_process_ends(
    make_runtime: MakeRuntime, k8s_api: client.ApiClient, namespace: str
) -> None:
    """The node agent answers a follow as a kubelet does, holding it open until the
    container ends: the end the runtime keeps of a stopped rank's log is its last line,
    written as the rank wound down, not the log as it was when the stop was asked."""
    runtime = make_runtime(pod_annotations={ANNOTATION_RUN: "process"})
    command = (
        "trap 'sleep 1; echo \"wound down rank $RANK\"; exit 0' TERM; "
        'echo "started rank $RANK"; while :; do sleep 0.1; done'
    )
    spec = gang_spec(241, {"gpu-node-2": 2}, command=command, grace_seconds=10)
    gang = spec.gang
    runtime.launch(spec)
    wait_for(lambda: all_in(runtime, gang, "running", 2), timeout=30, what="ranks running")
    wait_for(lambda: b"started" in runtime.read_log(gang, 1), timeout=30, what="rank 1 started")
    runtime.signal(gang, 10)
    wait_for(lambda: all_in(runtime, gang, "exited", 2), timeout=30, what="ranks exited")
    core = client.CoreV1Api(k8s_api)
    for rank in (0, 1):
        kept = wait_for(
            lambda r=rank: kept_log(core, namespace, gang, r), timeout=15, what="the kept end"
        )
        assert kept.endswith(f"wound down rank {rank}\n".encode()), kept
    runtime.forget(gang)
