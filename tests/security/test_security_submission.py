"""Attacks on what a job may ask for (issue 13, findings 1 and 7), one line each.

Finding 1: a researcher chose `ai-prod-critical` for a 1-GPU job and it preempted
a 16-GPU gang. Teams now carry the classes they may use; here vision may use
`ai-batch-preemptible` only, while its parent ml (through org) may use both.
Finding 7: input that can never run (env names execve() refuses, names the
runtime owns, an image that is not a reference, more GPUs than the cluster)
was accepted and failed later, five times over.

Every attack must answer its status with the reason in the named field of the
JSON body, and leave every row of the database as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from quotas.models import Node, PriorityClass, ResourceFlavor
from quotas.services import team_priority_classes_set
from tests.conftest import database_state

JOBS = "/api/v1/jobs/"
DIGEST = "sha256:" + "a" * 64


@pytest.fixture(autouse=True)
def _fast_passwords(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def cluster(world: Any) -> Any:
    """The world with 6 × 8 h100 GPUs (48), a flavor without nodes, a class no
    team may use yet, and vision narrowed to the batch class."""
    for index in range(3, 6):
        Node.objects.create(name=f"h100-node-{index}", flavor=world.h100, gpus=8)
    PriorityClass.objects.create(name="spare", value=5)
    ResourceFlavor.objects.create(name="b200-192gb")
    team_priority_classes_set(
        actor=world.users["admin"],
        team=world.vision,
        priority_classes=[world.batch],
        may_widen=True,
    )
    return world


def job(**change: Any) -> Callable[[Any], dict[str, Any]]:
    def body(world: Any) -> dict[str, Any]:
        return {
            "team": "vision",
            "flavor": "h100-80gb",
            "ranks": 1,
            "gpus_per_rank": 1,
            "command": "python train.py",
            **change,
        }

    return body


def classes_of(team: str) -> Callable[[Any], str]:
    return lambda w: f"/api/v1/teams/{getattr(w, team).pk}/priority-classes/"


def const(value: Any) -> Callable[[Any], Any]:
    return lambda w: value


@dataclass
class Attack:
    name: str
    persona: str
    method: str
    path: Callable[[Any], str]
    body: Callable[[Any], Any] | None
    status: int
    field: str
    reason: str
    # DRF nests a dict field's reasons under the offending key.
    key: str | None = field(default=None)


ATTACKS = [
    # --- finding 1: priority classes a team may not use ------------------------
    Attack(
        "researcher submits a critical job to a batch-only team",
        "researcher",
        "post",
        const(JOBS),
        job(priority_class="ai-prod-critical"),
        400,
        "priority_class",
        "Team vision may not use ai-prod-critical; it may use: ai-batch-preemptible.",
    ),
    Attack(
        "manager submits a critical job to the batch-only team below them",
        "manager",
        "post",
        const(JOBS),
        job(priority_class="ai-prod-critical", gpus_per_rank=8),
        400,
        "priority_class",
        "Team vision may not use ai-prod-critical; it may use: ai-batch-preemptible.",
    ),
    Attack(
        "researcher gives their own team the critical class",
        "researcher",
        "patch",
        classes_of("vision"),
        const({"priority_classes": ["ai-prod-critical", "ai-batch-preemptible"]}),
        403,
        "detail",
        "Only a manager above vision or an admin may change its classes.",
    ),
    Attack(
        "manager widens a sub-team to the critical class",
        "manager",
        "patch",
        classes_of("vision"),
        const({"priority_classes": ["ai-prod-critical", "ai-batch-preemptible"]}),
        403,
        "detail",
        "Only platform admins may widen the classes of vision: it may not use "
        "ai-prod-critical now.",
    ),
    Attack(
        "manager widens a sub-team by dropping its own list",
        "manager",
        "patch",
        classes_of("vision"),
        const({"priority_classes": None}),
        403,
        "detail",
        "Only platform admins may widen the classes of vision",
    ),
    Attack(
        "manager makes a class the team may not use its default",
        "manager",
        "patch",
        classes_of("vision"),
        const({"default_priority_class": "ai-prod-critical"}),
        400,
        "default_priority_class",
        "ai-prod-critical is not among the classes vision may use (ai-batch-preemptible).",
    ),
    Attack(
        "manager of another tree edits vision's classes",
        "other_manager",
        "patch",
        classes_of("vision"),
        const({"priority_classes": ["ai-batch-preemptible"]}),
        404,
        "detail",
        "No Team matches the given query.",
    ),
    Attack(
        "admin gives a sub-team a class its parent lacks",
        "admin",
        "patch",
        classes_of("nlp"),
        const({"priority_classes": ["spare"]}),
        400,
        "priority_classes",
        "A sub-team can only narrow its parent's classes: ml may use ai-prod-critical, "
        "ai-batch-preemptible, not spare.",
    ),
    Attack(
        "admin narrows a parent so that a sub-team keeps no class",
        "admin",
        "patch",
        classes_of("ml"),
        const({"priority_classes": ["ai-prod-critical"]}),
        400,
        "priority_classes",
        "Sub-team vision may use only ai-batch-preemptible; this change would leave it no "
        "class. Change vision first.",
    ),
    Attack(
        "admin deletes the only class a team may use, which would widen it to its parent's",
        "admin",
        "delete",
        lambda w: f"/api/v1/priority-classes/{w.batch.pk}/",
        None,
        400,
        "priority_class",
        "ai-batch-preemptible is the only class teams vision may use; give them another "
        "class first.",
    ),
    # --- finding 7: environment variables ---------------------------------------
    Attack(
        "env name with '='",
        "researcher",
        "post",
        const(JOBS),
        job(env={"A=B": "1"}),
        400,
        "env",
        "Name 'A=B' is not a portable environment name",
    ),
    Attack(
        "env name starting with a digit",
        "researcher",
        "post",
        const(JOBS),
        job(env={"1X": "1"}),
        400,
        "env",
        "Name '1X' is not a portable environment name",
    ),
    Attack(
        "env name with a space and a shell character",
        "researcher",
        "post",
        const(JOBS),
        job(env={"X; rm": "1"}),
        400,
        "env",
        "Name 'X; rm' is not a portable environment name",
    ),
    Attack(
        "env overrides the job's own event token",
        "researcher",
        "post",
        const(JOBS),
        job(env={"QM_EVENTS_TOKEN": "forged"}),
        400,
        "env",
        "QM_EVENTS_TOKEN is set by the runtime for every rank",
    ),
    Attack(
        "env overrides the attempt number",
        "researcher",
        "post",
        const(JOBS),
        job(env={"QM_ATTEMPT": "7"}),
        400,
        "env",
        "QM_ATTEMPT is set by the runtime for every rank",
    ),
    Attack(
        "env overrides the rendezvous rank",
        "researcher",
        "post",
        const(JOBS),
        job(env={"RANK": "0"}),
        400,
        "env",
        "RANK is set by the runtime for every rank",
    ),
    Attack(
        "env overrides the master address",
        "researcher",
        "post",
        const(JOBS),
        job(env={"MASTER_ADDR": "evil.example.com"}),
        400,
        "env",
        "MASTER_ADDR is set by the runtime for every rank",
    ),
    Attack(
        "env value with a NUL byte",
        "researcher",
        "post",
        const(JOBS),
        job(env={"SEED": "1\x002"}),
        400,
        "env",
        "Null characters are not allowed.",
        key="SEED",
    ),
    Attack(
        "201 env variables",
        "researcher",
        "post",
        const(JOBS),
        job(env={f"V{i}": "1" for i in range(201)}),
        400,
        "env",
        "At most 200 variables (got 201).",
    ),
    Attack(
        "an env value over 32 KiB",
        "researcher",
        "post",
        const(JOBS),
        job(env={"BLOB": "x" * 32_769}),
        400,
        "env",
        "The value of 'BLOB' is longer than 32,768 characters.",
    ),
    Attack(
        "env values that together pass 128 KiB",
        "researcher",
        "post",
        const(JOBS),
        job(env={f"BLOB{i}": "x" * 30_000 for i in range(5)}),
        400,
        "env",
        "Names and values total 150,025 characters; at most 131,072.",
    ),
    # --- finding 7: image references -------------------------------------------
    Attack(
        "image with a shell command after it",
        "researcher",
        "post",
        const(JOBS),
        job(image="evil.example.com/x:latest; rm -rf /"),
        400,
        "image",
        "'evil.example.com/x:latest; rm -rf /' is not an image reference",
    ),
    Attack(
        "image with command substitution",
        "researcher",
        "post",
        const(JOBS),
        job(image="trainer:$(reboot)"),
        400,
        "image",
        "is not an image reference",
    ),
    Attack(
        "image with an upper-case path",
        "researcher",
        "post",
        const(JOBS),
        job(image="registry.example.org/Team/Trainer:1"),
        400,
        "image",
        "is not an image reference",
    ),
    Attack(
        "image with a newline",
        "researcher",
        "post",
        const(JOBS),
        job(image="trainer:1\nEVIL=1"),
        400,
        "image",
        "is not an image reference",
    ),
    Attack(
        "image longer than any reference",
        "researcher",
        "post",
        const(JOBS),
        job(image="a" * 301),
        400,
        "image",
        "Must be at most 300 characters (got 301).",
    ),
    # --- finding 7: more GPUs than there are -----------------------------------
    Attack(
        "4,096 ranks of 8 GPUs on a cluster of 48",
        "researcher",
        "post",
        const(JOBS),
        job(ranks=4096, gpus_per_rank=8),
        400,
        "ranks",
        "Needs 32,768 h100-80gb GPUs (4,096 × 8); the cluster has 48.",
    ),
    Attack(
        "a rank larger than any node",
        "researcher",
        "post",
        const(JOBS),
        job(gpus_per_rank=16),
        400,
        "gpus_per_rank",
        "Each rank needs 16 GPUs; the largest h100-80gb node has 8.",
    ),
    Attack(
        "ranks that fit the GPU count but not the nodes",
        "researcher",
        "post",
        const(JOBS),
        job(ranks=7, gpus_per_rank=5),
        400,
        "ranks",
        "Needs 7 ranks of 5 GPUs; the h100-80gb nodes can hold at most 6 such ranks.",
    ),
    Attack(
        "a flavor without nodes",
        "researcher",
        "post",
        const(JOBS),
        job(flavor="b200-192gb"),
        400,
        "gpus_per_rank",
        "Each rank needs 1 GPU; the cluster has no b200-192gb node.",
    ),
    # --- finding 7: unbounded text ---------------------------------------------
    Attack(
        "a command of 20,001 characters",
        "researcher",
        "post",
        const(JOBS),
        job(command="x" * 20_001),
        400,
        "command",
        "Must be at most 20,000 characters (got 20,001).",
    ),
    Attack(
        "a command with a NUL byte",
        "researcher",
        "post",
        const(JOBS),
        job(command="python train.py\x00--evil"),
        400,
        "command",
        "Null characters are not allowed.",
    ),
    Attack(
        "a name of 121 characters",
        "researcher",
        "post",
        const(JOBS),
        job(name="n" * 121),
        400,
        "name",
        "Must be at most 120 characters (got 121).",
    ),
    Attack(
        "101 attempts",
        "researcher",
        "post",
        const(JOBS),
        job(max_attempts=101),
        400,
        "max_attempts",
        "Ensure this value is less than or equal to 100.",
    ),
]


@pytest.mark.parametrize("attack", ATTACKS, ids=[attack.name for attack in ATTACKS])
def test_attack_is_refused_and_changes_nothing(cluster: Any, attack: Attack) -> None:
    client = cluster.client(attack.persona)
    body = attack.body(cluster) if attack.body else None
    before = database_state()
    response = getattr(client, attack.method)(attack.path(cluster), body, format="json")
    assert response.status_code == attack.status, (response.status_code, response.content[:500])
    reasons = response.json()[attack.field]
    if attack.key is not None:
        reasons = reasons[attack.key]
    text = reasons if isinstance(reasons, str) else " ".join(reasons)
    assert attack.reason in text, text
    assert database_state() == before, f"{attack.name}: refused, but the database changed"


def test_the_same_team_may_submit_what_it_is_allowed(cluster: Any) -> None:
    """The refusals above are about the values, not the fields: allowed ones pass."""
    client = cluster.client("researcher")
    response = client.post(
        JOBS,
        job(
            ranks=6,
            gpus_per_rank=8,
            image=f"registry.example.org:5000/vision/trainer_v2:1.4-cuda12@{DIGEST}",
            env={"SEED": "1", "_PRIVATE": "", "NCCL_DEBUG": "INFO", "lower_case": "ok"},
            name="n" * 120,
        )(cluster),
        format="json",
    )
    assert response.status_code == 201, response.json()
    # Left out, the class is the team's default, one it may use.
    assert response.json()["priority_class"] == "ai-batch-preemptible"
