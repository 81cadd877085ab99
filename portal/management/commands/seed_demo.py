"""Seed a demo cluster: nodes of two flavors, a two-level team tree whose
guarantees use the cluster, the priority classes each team may use (only
serving may use ai-prod-critical), a user per role, and a few jobs that borrow."""

from __future__ import annotations

import shlex
import sys
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

from preemption.models import Job
from preemption.services import job_submit
from quotas.models import Node, PriorityClass, ResourceFlavor, Team
from quotas.services import membership_set, quota_set, team_priority_classes_set

# Demo passwords, printed once for the demo only.
DEMO_USERS = (
    ("admin", "admin-demo-pass", None, None),
    ("maria", "manager-demo-pass", "research", "manager"),
    ("ravi", "researcher-demo-pass", "vision", "researcher"),
    ("lena", "researcher-demo-pass", "language", "researcher"),
    ("omar", "manager-demo-pass", "production", "manager"),
    ("sam", "researcher-demo-pass", "serving", "researcher"),
)


class Command(BaseCommand):
    help = "Create the demo cluster, teams, users and jobs."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--if-empty", action="store_true", help="do nothing when teams already exist"
        )
        parser.add_argument(
            "--no-jobs", action="store_true", help="seed the cluster but submit no jobs"
        )

    def handle(self, *args: Any, if_empty: bool, no_jobs: bool, **options: Any) -> None:
        if if_empty and Team.objects.exists():
            self.stdout.write("Demo data already present.")
            return
        with transaction.atomic():
            jobs = self._seed(with_jobs=not no_jobs)
        self.stdout.write(
            self.style.SUCCESS("Demo cluster seeded. Sign in at http://127.0.0.1:8000/ as:")
        )
        for username, password, team, role in DEMO_USERS:
            what = f"{role} of {team}" if team else "platform admin"
            self.stdout.write(f"  {username:<6} / {password:<22} {what}")
        if jobs:
            ranks = sum(job.ranks for job in jobs)
            self.stdout.write(
                f"Submitted {len(jobs)} demo jobs: {ranks} real training processes "
                "(examples/train_ddp.py, PyTorch on the CPU) start on this machine and "
                "checkpoint under var/; stopping the portal stops them. "
                "`manage.py seed_demo --no-jobs` seeds without them."
            )

    def _seed(self, *, with_jobs: bool) -> list[Job]:
        h100, _ = ResourceFlavor.objects.get_or_create(
            name="h100-80gb", defaults={"description": "NVIDIA H100 80 GB"}
        )
        a100, _ = ResourceFlavor.objects.get_or_create(
            name="a100-40gb", defaults={"description": "NVIDIA A100 40 GB"}
        )
        for index in range(4):
            Node.objects.get_or_create(name=f"h100-{index}", defaults={"flavor": h100, "gpus": 8})
        for index in range(2):
            Node.objects.get_or_create(name=f"a100-{index}", defaults={"flavor": a100, "gpus": 8})
        research = Team.objects.create(slug="research", name="Research", weight=2.0)
        vision = Team.objects.create(slug="vision", name="Vision", parent=research)
        language = Team.objects.create(slug="language", name="Language", parent=research)
        production = Team.objects.create(slug="production", name="Production", weight=1.0)
        serving = Team.objects.create(slug="serving", name="Serving", parent=production)
        for team, h, a in (
            (research, 16, 8),
            (production, 16, 8),
            (vision, 8, 4),
            (language, 8, 4),
            (serving, 16, 8),
        ):
            quota_set(actor=None, team=team, flavor=h100, guarantee=h)
            quota_set(actor=None, team=team, flavor=a100, guarantee=a)
        # Only production (and so only serving, its one sub-team) may run
        # never-preempted work; research borrows and is preempted like batch work.
        critical = PriorityClass.objects.get(name="ai-prod-critical")
        batch = PriorityClass.objects.get(name="ai-batch-preemptible")
        team_priority_classes_set(
            actor=None, team=research, priority_classes=[batch], may_widen=True
        )
        team_priority_classes_set(
            actor=None, team=production, priority_classes=[critical, batch], may_widen=True
        )
        User = get_user_model()
        users: dict[str, Any] = {}
        teams = {t.slug: t for t in (research, vision, language, production, serving)}
        for username, password, team, role in DEMO_USERS:
            user = User.objects.filter(username=username).first() or User.objects.create_user(
                username, f"{username}@example.org", password
            )
            if team is None:
                user.is_staff = user.is_superuser = True
                user.save(update_fields=["is_staff", "is_superuser"])
            else:
                membership_set(actor=None, user=user, team=teams[team], role=role)
            users[username] = user
        return self._submit_jobs(users, teams, h100) if with_jobs else []

    def _submit_jobs(
        self, users: dict[str, Any], teams: dict[str, Team], h100: ResourceFlavor
    ) -> list[Job]:
        batch = PriorityClass.objects.get(name="ai-batch-preemptible")
        train = settings.BASE_DIR / "examples" / "train_ddp.py"
        python = shlex.quote(sys.executable)

        def command(steps: int) -> str:
            return f"{python} {shlex.quote(str(train))} --steps {steps} --step-sleep 0.5 --save-every 20"

        submitted: list[Job] = []
        # Vision runs inside its guarantee; language borrows production's idle GPUs.
        submitted.append(
            job_submit(
                submitter=users["ravi"],
                team=teams["vision"],
                flavor=h100,
                ranks=2,
                gpus_per_rank=4,
                command=command(600),
                priority_class=batch,
                name="resnet-sweep",
            )
        )
        submitted.append(
            job_submit(
                submitter=users["lena"],
                team=teams["language"],
                flavor=h100,
                ranks=2,
                gpus_per_rank=8,
                command=command(1200),
                priority_class=batch,
                name="llm-pretrain",
            )
        )
        submitted.append(
            job_submit(
                submitter=users["lena"],
                team=teams["language"],
                flavor=h100,
                ranks=1,
                gpus_per_rank=8,
                command=command(900),
                priority_class=batch,
                name="llm-finetune",
            )
        )
        return submitted
