"""Render times of the dashboard and the job list with 100,000 jobs and 500 teams
in PostgreSQL. Goal: p95 under 300 ms for both.

Usage: DATABASE_URL=postgres://quartermaster:quartermaster@127.0.0.1:5432/quartermaster \
    .venv/bin/python bench/bench_pages.py [--jobs 100000] [--teams 500] [--runs 30]

The bench never fills the given database: it works in a sibling database named
`<name>_bench` (created when missing, seeded once, reused afterwards), e.g.
quartermaster_bench. Each page is requested through Django's test client, so a
figure covers URL routing, middleware, the selectors' queries and the template.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_URL = "postgres://quartermaster:quartermaster@127.0.0.1:5432/quartermaster"
GOAL_MS = 300.0


def bench_database_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("postgres", "postgresql"):
        raise SystemExit(f"bench_pages needs PostgreSQL; DATABASE_URL is {url!r}")
    name = parts.path.lstrip("/") or "quartermaster"
    if not name.endswith("_bench"):
        name += "_bench"
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


def ensure_database(url: str) -> None:
    import psycopg

    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    admin = urlunsplit((parts.scheme, parts.netloc, "/postgres", "", ""))
    with psycopg.connect(admin, autocommit=True) as connection:
        exists = connection.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", [name]
        ).fetchone()
        if not exists:
            connection.execute(f'CREATE DATABASE "{name}"')
            print(f"created database {name}")


def seed(jobs: int, teams: int) -> dict[str, object]:
    """A cluster of 500 teams (20 organisations of 24 leaf teams) and `jobs` jobs,
    mostly finished, a few hundred running, a few thousand waiting, with attempts,
    ranks and preemptions. Seeded once; a second run reuses it."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.hashers import make_password
    from django.utils import timezone

    from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank
    from quotas.models import Membership, Node, PriorityClass, Quota, ResourceFlavor, Team

    User = get_user_model()
    if Job.objects.count() >= jobs and Team.objects.count() >= teams:
        return personas()
    print(f"seeding {jobs:,} jobs and {teams} teams (once) ...", flush=True)
    started = time.perf_counter()
    h100, _ = ResourceFlavor.objects.get_or_create(name="h100-80gb")
    a100, _ = ResourceFlavor.objects.get_or_create(name="a100-40gb")
    Node.objects.bulk_create(
        [Node(name=f"h100-{i:03d}", flavor=h100, gpus=8) for i in range(64)]
        + [Node(name=f"a100-{i:03d}", flavor=a100, gpus=8) for i in range(16)],
        ignore_conflicts=True,
    )
    organisations = 20
    per_organisation = max((teams - organisations) // organisations, 1)
    orgs = Team.objects.bulk_create(
        [Team(slug=f"org-{o:02d}", name=f"Organisation {o}") for o in range(organisations)]
    )
    leaves = Team.objects.bulk_create(
        [
            Team(slug=f"team-{o:02d}-{t:02d}", name=f"Team {o}.{t}", parent=org)
            for o, org in enumerate(orgs)
            for t in range(per_organisation)
        ]
    )
    Quota.objects.bulk_create(
        [Quota(team=org, flavor=h100, guarantee=per_organisation) for org in orgs]
        + [Quota(team=leaf, flavor=h100, guarantee=1, borrow_limit=8) for leaf in leaves]
        + [Quota(team=org, flavor=a100, guarantee=4) for org in orgs[:32]]
    )
    password = make_password("bench-password")
    User.objects.create(username="bench-admin", is_staff=True, password=password)
    manager = User.objects.create(username="bench-manager", password=password)
    researcher = User.objects.create(username="bench-researcher", password=password)
    submitters = User.objects.bulk_create(
        [User(username=f"user-{i:03d}", password=password) for i in range(100)]
    )
    Membership.objects.create(user=manager, team=orgs[0], role="manager")
    Membership.objects.create(user=researcher, team=leaves[0], role="researcher")
    Membership.objects.bulk_create(
        [
            Membership(user=user, team=leaves[i % len(leaves)], role="researcher")
            for i, user in enumerate(submitters)
        ]
    )
    batch = PriorityClass.objects.get(name="ai-batch-preemptible")
    critical = PriorityClass.objects.get(name="ai-prod-critical")
    now = timezone.now()
    running_slots = 480  # one GPU each: the cluster's 512 h100 GPUs stay within capacity
    chunk = 10_000
    made = 0
    while made < jobs:
        count = min(chunk, jobs - made)
        rows = []
        for i in range(made, made + count):
            leaf = leaves[i % len(leaves)]
            if i < running_slots:
                state = JobState.RUNNING
            elif i % 40 == 0:
                state = JobState.PENDING
            elif i % 97 == 0:
                state = JobState.REQUEUED
            elif i % 13 == 0:
                state = JobState.FAILED
            else:
                state = JobState.SUCCEEDED
            rows.append(
                Job(
                    name=f"train-{i}",
                    team=leaf,
                    submitter=submitters[i % len(submitters)],
                    priority_class=critical if i % 50 == 0 else batch,
                    flavor=h100,
                    ranks=1,
                    gpus_per_rank=1,
                    command="python train.py",
                    state=state,
                    waiting_reason="waiting for 1 GPU of h100-80gb: the cluster is full"
                    if state in (JobState.PENDING, JobState.REQUEUED)
                    else "",
                )
            )
        created = Job.objects.bulk_create(rows, batch_size=2000)
        attempts = [
            Attempt(
                job=job,
                number=1,
                admitted_at=now - timedelta(minutes=made + index),
                ended_at=None
                if job.state == JobState.RUNNING
                else now - timedelta(minutes=made + index - 1),
                end_reason=""
                if job.state == JobState.RUNNING
                else ("preempted" if job.state == JobState.REQUEUED else job.state),
                placement=[{"node": f"h100-{(made + index) % 64:03d}", "ranks": 1}],
                borrowed_gpus=1 if job.state == JobState.RUNNING and index % 5 == 0 else 0,
            )
            for index, job in enumerate(created)
            if job.state != JobState.PENDING
        ]
        Attempt.objects.bulk_create(attempts, batch_size=2000)
        Rank.objects.bulk_create(
            [
                Rank(
                    attempt=attempt,
                    index=0,
                    node=attempt.placement[0]["node"],
                    state="running" if attempt.ended_at is None else "exited",
                    exit_code=None if attempt.ended_at is None else 0,
                )
                for attempt in attempts
            ],
            batch_size=5000,
        )
        PreemptionEvent.objects.bulk_create(
            [
                PreemptionEvent(
                    victim_attempt=attempt,
                    job=attempt.job,
                    reason="reclaim",
                    cause="reclaimed by its lender",
                    decided_at=attempt.ended_at - timedelta(seconds=30),
                    grace_seconds=60.0,
                    deadline=attempt.ended_at + timedelta(seconds=30),
                    outcome="graceful",
                    checkpoint_seconds=4.0,
                )
                for attempt in attempts
                if attempt.end_reason == "preempted"
            ],
            batch_size=2000,
        )
        made += count
        print(f"  {made:,} jobs", flush=True)
    # submitted_at is auto_now_add: spread the history over the past in one statement.
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE preemption_job SET submitted_at = now() - (id * interval '1 minute')"
        )
        cursor.execute("ANALYZE")
    print(f"seeded in {time.perf_counter() - started:.0f} s", flush=True)
    return personas()


def personas() -> dict[str, object]:
    from django.contrib.auth import get_user_model

    User = get_user_model()
    return {
        name: User.objects.get(username=f"bench-{name}")
        for name in ("admin", "manager", "researcher")
    }


def measure(client: object, path: str, runs: int) -> tuple[float, float, int]:
    """(p50 ms, p95 ms, queries) of `runs` requests after two warm-up requests."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    for _ in range(2):
        response = client.get(path)  # type: ignore[attr-defined]
        assert response.status_code == 200, (path, response.status_code)
    with CaptureQueriesContext(connection) as queries:
        client.get(path)  # type: ignore[attr-defined]
    query_count = len(queries)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        response = client.get(path)  # type: ignore[attr-defined]
        times.append((time.perf_counter() - started) * 1000.0)
        assert response.status_code == 200
    times.sort()
    p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
    return statistics.median(times), p95, query_count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--teams", type=int, default=500)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()

    url = bench_database_url(os.environ.get("DATABASE_URL", DEFAULT_URL))
    ensure_database(url)
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    os.environ.setdefault("CELERY_BROKER_URL", "memory://")

    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command
    from django.test import Client

    settings.ALLOWED_HOSTS = ["testserver"]
    # Keep one connection across requests, as a server with CONN_MAX_AGE or a
    # pool would: the figures are the pages' own work, not connection setup.
    from django.core import signals
    from django.db import close_old_connections

    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    call_command("migrate", verbosity=0)
    users = seed(args.jobs, args.teams)

    from preemption.models import Job
    from quotas.models import Team

    print(
        f"database {urlsplit(url).path.lstrip('/')}: {Job.objects.count():,} jobs, "
        f"{Team.objects.count()} teams"
    )
    pages = [
        ("dashboard", "/"),
        ("job list", "/jobs/"),
        ("job list, pending", "/jobs/?state=pending"),
        ("job list, page 500", "/jobs/?page=500"),
    ]
    print(f"{'page':<22}{'persona':<12}{'p50 ms':>9}{'p95 ms':>9}{'queries':>9}  goal p95 < 300 ms")
    worst = 0.0
    for label, path in pages:
        for persona, user in users.items():
            client = Client()
            client.force_login(user)
            p50, p95, queries = measure(client, path, args.runs)
            if label in ("dashboard", "job list"):
                worst = max(worst, p95)
            verdict = "ok" if p95 < GOAL_MS else "over"
            print(f"{label:<22}{persona:<12}{p50:>9.1f}{p95:>9.1f}{queries:>9}  {verdict}")
    print(
        f"worst p95 of the dashboard and the job list: {worst:.1f} ms "
        f"({worst / GOAL_MS:.2f} of the 300 ms goal)"
    )


if __name__ == "__main__":
    main()
