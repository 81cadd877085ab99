"""Builders of job history for the page tests: jobs in every state, attempts,
ranks, preemptions with their timelines, checkpoints, trap events,
utilization samples and drill runs, created in bulk so a test can grow the
history from 10 to 1,000 jobs cheaply."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.test import Client, override_settings
from django.utils import timezone

from preemption.models import Attempt, Checkpoint, Job, JobState, PreemptionEvent, Rank, TrapEvent
from quotas.models import Quota, Team
from quotas.services import scheduling_policy_update
from telemetry.models import DrillRun, UtilizationSample
from tests import builders
from tests.conftest import World, world_built_once

STATES = [
    JobState.PENDING,
    JobState.RUNNING,
    JobState.SUCCEEDED,
    JobState.REQUEUED,
    JobState.FAILED,
    JobState.CANCELLED,
    JobState.RUNNING,
    JobState.SUCCEEDED,
]


FAST_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    """The personas' passwords are hashed with a fast hasher: these tests are
    about pages, and the default hasher costs seconds per persona on a busy machine."""
    settings.PASSWORD_HASHERS = FAST_HASHERS


@pytest.fixture(scope="module")
def module_world(django_db_setup: None, django_db_blocker: Any) -> Iterator[World]:
    """The world built once for a module of many tests (tests/conftest.py's
    `world_built_once`), with the fast hasher its tests sign in through; a module
    opts in by a `world` fixture that hands each test a copy of it."""
    with (
        override_settings(PASSWORD_HASHERS=FAST_HASHERS),
        world_built_once(django_db_blocker) as world,
    ):
        yield world


def page_client(world: Any, persona: str) -> Client:
    """A browser-like client signed in as the persona (anonymous: signed out)."""
    client = Client()
    if persona != "anonymous":
        client.force_login(world.users[persona])
    return client


def seed_jobs(world: Any, count: int, *, teams: list[Team] | None = None) -> list[Job]:
    """`count` jobs spread over the leaf teams and states. Running jobs get an
    open attempt with ranks; every fourth finished job got preempted once."""
    teams = teams or [world.vision, world.nlp, world.ops]
    submitters = {
        world.vision.pk: world.users["researcher"],
        world.nlp.pk: world.users["manager"],
        world.ops.pk: world.users["other_researcher"],
    }
    now = timezone.now()
    jobs = Job.objects.bulk_create(
        [
            Job(
                name=f"train-{index}",
                team=teams[index % len(teams)],
                submitter=submitters.get(teams[index % len(teams)].pk, world.users["admin"]),
                priority_class=world.batch,
                flavor=world.h100,
                ranks=1 + index % 2,
                gpus_per_rank=1,
                command="python train.py",
                state=STATES[index % len(STATES)],
                waiting_reason="waiting for 2 GPUs of h100-80gb; borrowing is full"
                if STATES[index % len(STATES)] in (JobState.PENDING, JobState.REQUEUED)
                else "",
            )
            for index in range(count)
        ]
    )
    # auto_now_add ignores a given value; spread the submissions over the last days.
    for index, job in enumerate(jobs):
        job.submitted_at = now - timedelta(minutes=index)
    Job.objects.bulk_update(jobs, ["submitted_at"], batch_size=500)
    attempts: list[Attempt] = []
    for index, job in enumerate(jobs):
        if job.state in (JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED):
            attempts.append(
                Attempt(
                    job=job,
                    number=1,
                    admitted_at=now - timedelta(minutes=index, seconds=30),
                    ended_at=None
                    if job.state == JobState.RUNNING
                    else now - timedelta(minutes=index),
                    end_reason="" if job.state == JobState.RUNNING else job.state,
                    borrowed_gpus=1 if index % 3 == 0 and job.state == JobState.RUNNING else 0,
                    placement=[{"node": "h100-node-0", "ranks": job.ranks}],
                )
            )
    Attempt.objects.bulk_create(attempts)
    Rank.objects.bulk_create(
        [
            Rank(
                attempt=attempt,
                index=rank,
                node="h100-node-0",
                state="running" if attempt.ended_at is None else "exited",
                exit_code=None if attempt.ended_at is None else 0,
            )
            for attempt in attempts
            for rank in range(attempt.job.ranks)
        ]
    )
    return jobs


@dataclass
class PreemptedJob:
    """A borrower's job reclaimed by another team, with its whole story."""

    victim: Job
    preemptor: Job
    event: PreemptionEvent


def seed_preemption(world: Any, *, decided_at: datetime | None = None) -> PreemptedJob:
    """Job of ops (borrowing) reclaimed by an 8-GPU job of vision: signal to two
    ranks, checkpoint at step 120, clean exits, requeue and resume on attempt 2."""
    decided = decided_at or timezone.now() - timedelta(minutes=30)
    victim = Job.objects.create(
        name="borrower",
        team=world.ops,
        submitter=world.users["other_researcher"],
        priority_class=world.batch,
        flavor=world.h100,
        ranks=2,
        gpus_per_rank=4,
        command="python train.py",
        state=JobState.RUNNING,
        resume_step=121,
    )
    preemptor = Job.objects.create(
        name="critical",
        team=world.vision,
        submitter=world.users["researcher"],
        priority_class=world.critical,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=8,
        command="python serve.py",
        state=JobState.RUNNING,
    )
    first = Attempt.objects.create(
        job=victim,
        number=1,
        admitted_at=decided - timedelta(minutes=10),
        ended_at=decided + timedelta(seconds=9),
        end_reason="preempted",
        borrowed_gpus=8,
    )
    for rank in range(2):
        Rank.objects.create(
            attempt=first,
            index=rank,
            node=f"h100-node-{rank}",
            state="exited",
            exit_code=0,
            signal_sent_at=decided + timedelta(milliseconds=200),
            signal_received_at=decided + timedelta(milliseconds=300 + 100 * rank),
            exited_at=decided + timedelta(seconds=8 + rank),
        )
    event = PreemptionEvent.objects.create(
        victim_attempt=first,
        job=victim,
        preemptor=preemptor,
        reason="reclaim",
        decided_at=decided,
        grace_seconds=60.0,
        deadline=decided + timedelta(seconds=60),
        signal_sent_at=decided + timedelta(milliseconds=200),
        all_exited_at=decided + timedelta(seconds=9),
        checkpoint_step=120,
        checkpoint_bytes=50_000_000,
        checkpoint_seconds=4.5,
        outcome="graceful",
        lost_gpu_seconds=16.0,
        requeued_at=decided + timedelta(seconds=10),
        resumed_at=decided + timedelta(seconds=40),
    )
    second = Attempt.objects.create(
        job=victim,
        number=2,
        admitted_at=decided + timedelta(seconds=38),
        placement=[{"node": "h100-node-2", "ranks": 2}],
    )
    for rank in range(2):
        Rank.objects.create(attempt=second, index=rank, node="h100-node-2", state="running")
    Checkpoint.objects.create(
        job=victim,
        attempt=first,
        step=120,
        path="/ckpt/step_120",
        bytes=50_000_000,
        seconds=4.5,
        committed_at=decided + timedelta(seconds=6),
    )
    origin = decided.timestamp()
    for rank in range(2):
        for name, offset, step in (
            ("signal_received", 0.3 + 0.1 * rank, None),
            ("checkpoint_started", 1.0, 120),
            ("checkpoint_committed", 5.5, 120),
            ("exiting", 8.0 + rank, None),
        ):
            TrapEvent.objects.create(
                job=victim,
                attempt=1,
                rank=rank,
                event=name,
                at=origin + offset,
                step=step,
                payload={"event": name, "bytes": 50_000_000, "seconds": 4.5}
                if name == "checkpoint_committed"
                else {"event": name},
                fingerprint=f"{victim.pk}-1-{rank}-{name}",
                source="post",
            )
        TrapEvent.objects.create(
            job=victim,
            attempt=2,
            rank=rank,
            event="resumed",
            at=origin + 40.0,
            step=121,
            payload={"event": "resumed", "step": 121},
            fingerprint=f"{victim.pk}-2-{rank}-resumed",
            source="log",
        )
    return PreemptedJob(victim=victim, preemptor=preemptor, event=event)


def seed_samples(world: Any, *, points: int = 6) -> list[UtilizationSample]:
    """Utilization samples a minute apart: vision uses 4, 6, 8, ...; nlp 2 less."""
    now = timezone.now()
    samples = []
    for index in range(points):
        at = now - timedelta(minutes=points - index)
        for team, used, guarantee in (
            (world.vision, 4 + index, 8),
            (world.nlp, 2 + index, 8),
            (world.ops, 1, 8),
            (world.ml, 6 + 2 * index, 16),
            (world.other, 1, 8),
            (world.org, 6 + 2 * index, 16),
        ):
            samples.append(
                UtilizationSample(
                    at=at,
                    team=team,
                    flavor=world.h100,
                    used=used,
                    guarantee=guarantee,
                    borrowed=max(used - guarantee, 0),
                    capacity=24,
                )
            )
    return UtilizationSample.objects.bulk_create(samples)


def seed_drill(*, passed: bool = True) -> DrillRun:
    """A finished drill with the figures of `manage.py drill --json`."""
    now = timezone.now()
    return DrillRun.objects.create(
        started_at=now - timedelta(minutes=5),
        finished_at=now,
        runtime="local",
        ranks=16,
        grace_seconds=60.0,
        passed=passed,
        result={
            "schema_version": 1,
            "runtime": "local",
            "ranks": 16,
            "grace_seconds": 60.0,
            "signal_propagation_seconds": 0.42,
            "signal_latency_seconds": [0.3] * 16,
            "checkpoint_seconds": 3.25,
            "checkpoint_committed": True,
            "exit_codes": [0] * 16,
            "orphaned_ports": 0,
            "restart_integrity": True,
            "restart_max_abs_diff": 0.0,
            "recovery_seconds": 41.5,
            "utilization": 0.93,
        },
    )


@pytest.fixture
def history(world: Any) -> Any:
    """A small, complete history on top of the world."""
    seed_jobs(world, 10)
    story = seed_preemption(world)
    seed_samples(world)
    seed_drill()
    return story


WEEK = 7 * 86_400.0


def seed_decayed_usage(world: Any) -> None:
    """Decayed usage at strength 1 with a week's half-life: vision and nlp guarantee 2
    GPUs each (ml keeps 16), vision used 8 GPUs for the whole last week and nlp nothing,
    and both now want 16. Other and ops want nothing, so ml's teams share all 24 GPUs.

    By hand, with a half-life h of a week: the attempt adds 8 · h/ln 2 · (1 - 1/2) =
    4h/ln 2 decayed GPU-seconds, of which vision's guarantee of 2 held all the time
    accounts for 2h/ln 2, so vision borrowed 2h/ln 2 and nlp nothing. With equal
    weights each sibling's share of what they borrowed is h/ln 2: vision used 2.0×
    its share. At strength 1 vision's weight for the surplus becomes 1/2 and nlp's
    (ratio 0, bounded to 1/8) becomes 8. By weight alone each gets 2 + 20/2 = 12; with
    usage nlp's share (2 + 20 · 8/8.5) is more than the 16 it wants, so it gets 16 and
    vision the other 8.
    """
    Quota.objects.filter(team__in=[world.vision, world.nlp]).update(guarantee=2)
    scheduling_policy_update(
        actor=world.users["admin"], usage_strength=1.0, usage_half_life_seconds=WEEK
    )
    now = timezone.now()
    past = builders.job(world, world.vision, state=JobState.SUCCEEDED, ranks=2, gpus_per_rank=4)
    Attempt.objects.create(
        job=past,
        number=1,
        admitted_at=now - timedelta(seconds=WEEK),
        ended_at=now,
        placement=[{"node": "h100-node-0", "ranks": 2}],
    )
    for team in (world.vision, world.nlp):
        builders.job(world, team, state=JobState.PENDING, ranks=2, gpus_per_rank=8)
