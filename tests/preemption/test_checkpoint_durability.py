"""Only a checkpoint on the Kubernetes checkpoint volume is offered for resume.

The runtime object is built without connecting anywhere: deciding whether a
path lies on the volume is pure, and ingestion asks the active runtime.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from preemption.ingest import ingest_trap_event
from preemption.models import Attempt, Checkpoint, Job
from preemption.runtime import runtime_problems, use_runtime
from preemption.runtimes.kubernetes import KubernetesRuntime, KubernetesRuntimeConfig
from preemption.services import job_submit
from tests import builders


@pytest.fixture
def kubernetes(settings: Any) -> Iterator[None]:
    settings.QM_RUNTIME = "kubernetes"
    settings.QM_K8S_CHECKPOINT_MOUNT_PATH = "/checkpoints"
    runtime = KubernetesRuntime(
        client.ApiClient(client.Configuration()),
        KubernetesRuntimeConfig(checkpoint_claim="qm-checkpoints"),
    )
    use_runtime(runtime)
    yield
    use_runtime(None)
    runtime.close()


def _job(world: Any) -> Job:
    return job_submit(
        submitter=world.users["researcher"],
        team=world.vision,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=1,
        command="true",
    )


def _attempt(job: Job) -> Attempt:
    """The job's running first attempt: only an open attempt's ranks report."""
    existing = Attempt.objects.filter(job=job, number=1).first()
    if existing is not None:
        return existing
    first = builders.attempt(job, number=1)
    builders.ranks(first)
    return first


def _committed(job: Job, step: int, **extra: Any) -> dict[str, Any]:
    return {
        "event": "checkpoint_committed",
        "attempt": 1,
        "rank": 0,
        "at": time.time(),
        "step": step,
        **extra,
    }


def test_jobs_on_kubernetes_checkpoint_into_the_volume(world: Any, kubernetes: None) -> None:
    job = _job(world)
    assert re.fullmatch(rf"/checkpoints/job-{job.pk}-[0-9a-f]{{12}}", job.checkpoint_dir)
    assert ingest_trap_event(attempt=_attempt(job), event=_committed(job, 7), source="post")
    checkpoint = Checkpoint.objects.get(job=job)
    assert checkpoint.path == f"{job.checkpoint_dir}/step_7.attempt_1"
    job.refresh_from_db()
    assert job.resume_step == 8


@pytest.mark.parametrize(
    "where",
    [
        "/tmp/job-1/step_9",  # the container's own filesystem
        "/checkpoints/../tmp/step_9",  # looks like the volume, is not
        "/checkpointsX/step_9",
    ],
)
def test_a_path_the_rank_names_is_never_recorded(world: Any, kubernetes: None, where: str) -> None:
    """The checkpoint is where the trap saves it, in the job's folder on the
    volume: a path in the event (a client's word) is not taken."""
    job = _job(world)
    assert ingest_trap_event(
        attempt=_attempt(job), event=_committed(job, 9, path=where), source="log"
    )
    [checkpoint] = Checkpoint.objects.filter(job=job)
    assert checkpoint.path == f"{job.checkpoint_dir}/step_9.attempt_1"
    assert where not in checkpoint.path
    # The event itself is kept: the job's history still shows what the rank said.
    assert job.trap_events.filter(event="checkpoint_committed").count() == 1


def test_a_job_submitted_outside_the_volume_resumes_from_nothing(
    world: Any, kubernetes: None
) -> None:
    job = _job(world)
    Job.objects.filter(pk=job.pk).update(checkpoint_dir=f"/var/lib/qm/job-{job.pk}")
    job.refresh_from_db()
    ingest_trap_event(attempt=_attempt(job), event=_committed(job, 3), source="post")
    assert not Checkpoint.objects.filter(job=job).exists()


def test_durability_follows_settings_without_a_runtime(world: Any, settings: Any) -> None:
    """The web process ingests events: it decides from settings alone."""
    settings.QM_RUNTIME = "kubernetes"
    settings.QM_K8S_CHECKPOINT_MOUNT_PATH = "/checkpoints"
    settings.QM_K8S_CHECKPOINT_CLAIM = ""
    job = _job(world)
    ingest_trap_event(attempt=_attempt(job), event=_committed(job, 4), source="post")
    assert not Checkpoint.objects.filter(job=job).exists()
    settings.QM_K8S_CHECKPOINT_CLAIM = "qm-checkpoints"
    ingest_trap_event(attempt=_attempt(job), event=_committed(job, 5), source="post")
    assert list(Checkpoint.objects.filter(job=job).values_list("step", flat=True)) == [5]


def test_without_a_volume_the_portal_says_why(settings: Any) -> None:
    settings.QM_RUNTIME = "kubernetes"
    settings.QM_K8S_CHECKPOINT_CLAIM = ""
    settings.PRODUCTION = True
    [problem] = runtime_problems()
    assert "refusing to start" in problem and "QM_K8S_CHECKPOINT_CLAIM" in problem
    settings.QM_K8S_CHECKPOINT_CLAIM = "qm-checkpoints"
    assert runtime_problems() == []


def test_health_check_fails_in_production_without_a_volume(db: Any, settings: Any) -> None:
    from django.test import Client

    settings.QM_RUNTIME = "kubernetes"
    settings.QM_K8S_CHECKPOINT_CLAIM = ""
    settings.PRODUCTION = True
    response = Client().get("/healthz")
    assert response.status_code == 503
    assert b"no checkpoint volume is configured" in response.content
    settings.PRODUCTION = False
    assert Client().get("/healthz").status_code == 200
