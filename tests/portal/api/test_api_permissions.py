"""Every operation of the OpenAPI schema, from each of the six personas.

`CASES` holds, per operation, one or more case tables: the request and, for
each persona, the status it must get. Allowed calls must succeed (and lists
must hold exactly what the persona may see); every other call must answer
401/403/404 and leave every row of the database as it was.
`test_every_operation_has_a_case_table_for_every_persona` walks the schema and
fails for any operation (new ones included) without such a table.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.test import override_settings
from django.utils import timezone
from drf_spectacular.generators import SchemaGenerator
from rest_framework.test import APIClient

from portal.services import api_token_create
from preemption.event_tokens import attempt_events_token
from preemption.models import Attempt, Checkpoint, Job, JobState, PreemptionEvent, Rank
from preemption.webhooks import webhook_create
from quotas import services as quota_services
from quotas.models import AuditEntry, Node, PriorityClass, Quota, Team
from tests import builders
from tests.conftest import World, database_state, world_built_once

# The personas and password of tests/conftest.py's `world`.
PERSONAS = ("admin", "manager", "other_manager", "researcher", "other_researcher", "anonymous")
PASSWORD = "correct-horse-battery-staple"

ANON = 401  # not signed in: DRF answers 401 with `WWW-Authenticate: Bearer`


@dataclass
class Objects:
    """Rows every case can act on, in a team each persona relates to differently."""

    job_v: Job  # running in vision, submitted by researcher
    job_v_pending: Job  # pending in vision, submitted by researcher
    job_v_by_manager: Job  # pending in vision, submitted by manager
    job_ops: Job  # running in ops, submitted by other_researcher
    attempt_v: Attempt
    attempt_ops: Attempt
    rank_v: Rank
    rank_ops: Rank
    event_v: PreemptionEvent
    event_ops: PreemptionEvent
    checkpoint_v: Checkpoint
    checkpoint_ops: Checkpoint
    webhook_v: Any
    webhook_ops: Any
    spare_node: Node
    spare_class: PriorityClass
    spare_team: Team
    tokens: dict[str, Any]


def _running_job(world: Any, team: Team, submitter: Any, node: str) -> tuple[Job, Attempt, Rank]:
    now = timezone.now()
    job = builders.running_job(
        world,
        team,
        name=f"train-{team.slug}",
        submitter=submitter,
        gpus_per_rank=4,
        command="sleep 1",
        admitted_at=now,
        running_at=now,
        node=node,
        attempt_fields={"launched_at": now},
        rank_fields={"started_at": now},
    )
    attempt = job.attempts.get()
    return job, attempt, attempt.rank_set.get()


def _preemption(job: Job, attempt: Attempt) -> PreemptionEvent:
    now = timezone.now()
    return PreemptionEvent.objects.create(
        victim_attempt=attempt,
        job=job,
        reason=PreemptionEvent.Reason.RECLAIM,
        decided_at=now,
        grace_seconds=60,
        deadline=now + timedelta(seconds=60),
        cause="test",
    )


def _build_objects(world: World) -> Objects:
    users = world.users
    job_v, attempt_v, rank_v = _running_job(world, world.vision, users["researcher"], "h100-node-0")
    job_ops, attempt_ops, rank_ops = _running_job(
        world, world.ops, users["other_researcher"], "h100-node-1"
    )
    pending = {
        key: builders.job(
            world,
            world.vision,
            state=JobState.PENDING,
            name=key,
            submitter=users[who],
            command="true",
        )
        for key, who in (("pending", "researcher"), ("by-manager", "manager"))
    }
    now = timezone.now()
    checkpoint_v = Checkpoint.objects.create(
        job=job_v, attempt=attempt_v, step=10, committed_at=now
    )
    checkpoint_ops = Checkpoint.objects.create(
        job=job_ops, attempt=attempt_ops, step=10, committed_at=now
    )
    admin = users["admin"]
    # Audit rows in both trees, written the way people write them.
    quota_services.quota_update(actor=admin, quota=world.quota(world.vision), borrow_limit=4)
    quota_services.quota_update(actor=admin, quota=world.quota(world.ops), borrow_limit=4)
    # nlp may use the batch class only, so a case can try to widen it again.
    quota_services.team_priority_classes_set(
        actor=admin, team=world.nlp, priority_classes=[world.batch], may_widen=True
    )
    webhook_v = webhook_create(actor=admin, team=world.vision, url="http://192.0.2.9/vision")
    webhook_ops = webhook_create(actor=admin, team=world.ops, url="http://192.0.2.9/ops")
    tokens = {
        persona: api_token_create(user=users[persona], name="laptop")[0]
        for persona in PERSONAS[:-1]
    }
    return Objects(
        job_v=job_v,
        job_v_pending=pending["pending"],
        job_v_by_manager=pending["by-manager"],
        job_ops=job_ops,
        attempt_v=attempt_v,
        attempt_ops=attempt_ops,
        rank_v=rank_v,
        rank_ops=rank_ops,
        event_v=_preemption(job_v, attempt_v),
        event_ops=_preemption(job_ops, attempt_ops),
        checkpoint_v=checkpoint_v,
        checkpoint_ops=checkpoint_ops,
        webhook_v=webhook_v,
        webhook_ops=webhook_ops,
        spare_node=Node.objects.create(name="spare-node", flavor=world.a100, gpus=8),
        spare_class=PriorityClass.objects.create(name="spare", value=5),
        spare_team=builders.team("spare", name="Spare", parent=world.ml),
        tokens=tokens,
    )


@pytest.fixture(scope="module", autouse=True)
def _module_settings() -> Iterator[None]:
    # The default hasher is deliberately slow, and strength is not under test here.
    # Webhooks may reach only public addresses; the documentation network
    # (192.0.2.0/24, never routed) stands in for one, opened by the allow-list.
    with override_settings(
        PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"],
        QM_WEBHOOK_ALLOW_NETS=["192.0.2.0/24"],
    ):
        yield


@pytest.fixture(scope="module")
def _shared_rows(
    _module_settings: None, django_db_setup: None, django_db_blocker: Any
) -> Iterator[tuple[World, Objects]]:
    """The world and the objects, built once for the module's several hundred cases
    rather than once per case; each case runs in a savepoint rolled back at its end
    (tests/conftest.py's `world_built_once`)."""
    with world_built_once(django_db_blocker) as world:
        yield world, _build_objects(world)


@pytest.fixture
def _case_rows(db: None, _shared_rows: tuple[World, Objects]) -> tuple[World, Objects]:
    # A copy of the instances, so that what a case does to them in memory (a user's
    # last_login, a refreshed job) is not what the next case starts from.
    return copy.deepcopy(_shared_rows)


@pytest.fixture
def world(_case_rows: tuple[World, Objects]) -> World:
    return _case_rows[0]


@pytest.fixture
def objects(_case_rows: tuple[World, Objects]) -> Objects:
    return _case_rows[1]


# Which of the two jobs' rows each persona may read.
SEES_VISION = {"admin", "manager", "researcher"}
SEES_OPS = {"admin", "other_manager", "other_researcher"}


def _scoped(
    vision: Callable[[Objects], Any], ops: Callable[[Objects], Any]
) -> Callable[..., dict[str, set[int]]]:
    def visible(world: Any, o: Objects) -> dict[str, set[int]]:
        return {
            persona: {
                *({vision(o).pk} if persona in SEES_VISION else set()),
                *({ops(o).pk} if persona in SEES_OPS else set()),
            }
            for persona in PERSONAS[:-1]
        }

    return visible


def _expect(
    admin: int, manager: int, other_manager: int, researcher: int, other_researcher: int
) -> dict[str, int]:
    return {
        "admin": admin,
        "manager": manager,
        "other_manager": other_manager,
        "researcher": researcher,
        "other_researcher": other_researcher,
        "anonymous": ANON,
    }


EVERYONE = _expect(200, 200, 200, 200, 200)
VISION_READ = _expect(200, 200, 404, 200, 404)


def _admin_only(code: int) -> dict[str, int]:
    return _expect(code, 403, 403, 403, 403)


@dataclass
class Case:
    """One request and the status each persona gets for it."""

    name: str
    method: str
    path: Callable[[Any, Objects], str]
    expect: dict[str, int]
    body: Callable[[Any, Objects], Any] | None = None
    visible: Callable[[Any, Objects], dict[str, set[int]]] | None = None
    headers: Callable[[Any, Objects], dict[str, str]] | None = None
    writes: bool = True  # a successful non-GET call must change the database
    # Sign in with a real session instead of forcing the user onto the request,
    # where the request's own credentials (the trap's token) must be seen.
    session: bool = False


def _teams_visible(world: Any, o: Objects) -> dict[str, set[int]]:
    ml_tree = {world.ml.pk, world.vision.pk, world.nlp.pk, o.spare_team.pk}
    other_tree = {world.other.pk, world.ops.pk}
    return {
        "admin": set(Team.objects.values_list("pk", flat=True)),
        "manager": ml_tree,
        "other_manager": other_tree,
        "researcher": {world.vision.pk},
        "other_researcher": {world.ops.pk},
    }


def _quotas_visible(world: Any, o: Objects) -> dict[str, set[int]]:
    teams = _teams_visible(world, o)
    return {
        p: set(Quota.objects.filter(team_id__in=ids).values_list("pk", flat=True))
        for p, ids in teams.items()
    }


def _audit_visible(world: Any, o: Objects) -> dict[str, set[int]]:
    teams = _teams_visible(world, o)
    rows = {
        p: set(AuditEntry.objects.filter(team_id__in=ids).values_list("pk", flat=True))
        for p, ids in teams.items()
    }
    rows["admin"] = set(AuditEntry.objects.values_list("pk", flat=True))
    rows["researcher"] = rows["other_researcher"] = set()
    return rows


def _tokens_visible(world: Any, o: Objects) -> dict[str, set[int]]:
    return {persona: {token.pk} for persona, token in o.tokens.items()}


def _webhooks_visible(world: Any, o: Objects) -> dict[str, set[int]]:
    return {
        "admin": {o.webhook_v.pk, o.webhook_ops.pk},
        "manager": {o.webhook_v.pk},
        "other_manager": {o.webhook_ops.pk},
        "researcher": set(),
        "other_researcher": set(),
    }


def _everything(model: Any) -> Callable[[Any, Objects], dict[str, set[int]]]:
    def visible(world: Any, o: Objects) -> dict[str, set[int]]:
        ids = set(model.objects.values_list("pk", flat=True))
        return {persona: ids for persona in PERSONAS[:-1]}

    return visible


def _job_body(team: str) -> Callable[[Any, Objects], dict[str, Any]]:
    return lambda w, o: {
        "team": team,
        "flavor": "h100-80gb",
        "ranks": 2,
        "gpus_per_rank": 2,
        "command": "python train.py",
    }


def _event(o: Objects) -> dict[str, Any]:
    return {
        "event": "signal_received",
        "job_id": o.job_v.pk,
        "attempt": 1,
        "rank": 0,
        "at": 1_800_000_000.5,
    }


V1 = "/api/v1"
CASES: dict[tuple[str, str], list[Case]] = {}


def case(method: str, path: str, *cases: Case) -> None:
    CASES[(method, path)] = list(cases)


case(
    "GET",
    "/api/v1/attempts/",
    Case(
        "list",
        "GET",
        lambda w, o: f"{V1}/attempts/",
        EVERYONE,
        visible=_scoped(lambda o: o.attempt_v, lambda o: o.attempt_ops),
    ),
)
case(
    "GET",
    "/api/v1/attempts/{id}/",
    Case("vision attempt", "GET", lambda w, o: f"{V1}/attempts/{o.attempt_v.pk}/", VISION_READ),
)
case(
    "GET",
    "/api/v1/audit-log/",
    Case("list", "GET", lambda w, o: f"{V1}/audit-log/", EVERYONE, visible=_audit_visible),
)
case(
    "GET",
    "/api/v1/audit-log/{id}/",
    Case(
        "vision entry",
        "GET",
        lambda w, o: f"{V1}/audit-log/{AuditEntry.objects.filter(team=w.vision).first().pk}/",
        _expect(200, 200, 404, 404, 404),
    ),
)
case(
    "GET",
    "/api/v1/checkpoints/",
    Case(
        "list",
        "GET",
        lambda w, o: f"{V1}/checkpoints/",
        EVERYONE,
        visible=_scoped(lambda o: o.checkpoint_v, lambda o: o.checkpoint_ops),
    ),
)
case(
    "GET",
    "/api/v1/checkpoints/{id}/",
    Case(
        "vision checkpoint",
        "GET",
        lambda w, o: f"{V1}/checkpoints/{o.checkpoint_v.pk}/",
        VISION_READ,
    ),
)
case("GET", "/api/v1/flavors/", Case("list", "GET", lambda w, o: f"{V1}/flavors/", EVERYONE))
# Which teams each persona sees here is checked in tests/portal/pages/test_pages_borrowed.py.
case("GET", "/api/v1/usage/", Case("now", "GET", lambda w, o: f"{V1}/usage/", EVERYONE))
case(
    "GET",
    "/api/v1/fragmentation/",
    Case("now", "GET", lambda w, o: f"{V1}/fragmentation/", EVERYONE),
)
case(
    "GET",
    "/api/v1/scheduling-policy/",
    Case("read", "GET", lambda w, o: f"{V1}/scheduling-policy/", EVERYONE),
)
case(
    "PATCH",
    "/api/v1/scheduling-policy/",
    Case(
        "change the half-life",
        "PATCH",
        lambda w, o: f"{V1}/scheduling-policy/",
        _admin_only(200),
        body=lambda w, o: {"usage_half_life_seconds": 86400},
    ),
)
case(
    "POST",
    "/api/v1/flavors/",
    Case(
        "add",
        "POST",
        lambda w, o: f"{V1}/flavors/",
        _admin_only(201),
        body=lambda w, o: {"name": "b200-192gb"},
    ),
)
case(
    "GET",
    "/api/v1/flavors/{id}/",
    Case("one", "GET", lambda w, o: f"{V1}/flavors/{w.h100.pk}/", EVERYONE),
)
case(
    "GET",
    "/api/v1/jobs/",
    Case(
        "list",
        "GET",
        lambda w, o: f"{V1}/jobs/",
        EVERYONE,
        visible=lambda w, o: {
            "admin": set(Job.objects.values_list("pk", flat=True)),
            "manager": {o.job_v.pk, o.job_v_pending.pk, o.job_v_by_manager.pk},
            "other_manager": {o.job_ops.pk},
            "researcher": {o.job_v.pk, o.job_v_pending.pk, o.job_v_by_manager.pk},
            "other_researcher": {o.job_ops.pk},
        },
    ),
)
case(
    "POST",
    "/api/v1/jobs/",
    Case(
        "submit to vision",
        "POST",
        lambda w, o: f"{V1}/jobs/",
        _expect(201, 201, 403, 201, 403),
        body=_job_body("vision"),
    ),
    Case(
        "submit to ops",
        "POST",
        lambda w, o: f"{V1}/jobs/",
        _expect(201, 403, 201, 403, 201),
        body=_job_body("ops"),
    ),
)
case(
    "POST",
    "/api/v1/jobs/batch/",
    Case(
        "sweep to vision",
        "POST",
        lambda w, o: f"{V1}/jobs/batch/",
        _expect(201, 201, 403, 201, 403),
        body=lambda w, o: {"jobs": [_job_body("vision")(w, o)] * 2},
    ),
    Case(
        "sweep to vision and ops",
        "POST",
        lambda w, o: f"{V1}/jobs/batch/",
        _admin_only(201),
        body=lambda w, o: {"jobs": [_job_body("vision")(w, o), _job_body("ops")(w, o)]},
    ),
)
case(
    "GET",
    "/api/v1/jobs/{id}/",
    Case("vision job", "GET", lambda w, o: f"{V1}/jobs/{o.job_v.pk}/", VISION_READ),
)
case(
    "POST",
    "/api/v1/jobs/{id}/cancel/",
    Case(
        "own pending job",
        "POST",
        lambda w, o: f"{V1}/jobs/{o.job_v_pending.pk}/cancel/",
        _expect(202, 202, 404, 202, 404),
    ),
    Case(
        "a teammate's job",
        "POST",
        lambda w, o: f"{V1}/jobs/{o.job_v_by_manager.pk}/cancel/",
        _expect(202, 202, 404, 403, 404),
    ),
)
case(
    "POST",
    "/api/v1/jobs/{id}/topology/",
    Case(
        "own pending job",
        "POST",
        lambda w, o: f"{V1}/jobs/{o.job_v_pending.pk}/topology/",
        _expect(200, 200, 404, 200, 404),
        body=lambda w, o: {"topology_level": "rack", "topology_required": False},
    ),
    Case(
        "a teammate's job",
        "POST",
        lambda w, o: f"{V1}/jobs/{o.job_v_by_manager.pk}/topology/",
        _expect(200, 200, 404, 403, 404),
        body=lambda w, o: {"topology_level": "rack"},
    ),
)
case(
    "POST",
    "/api/v1/jobs/{id}/events/",
    Case(
        "with the job's token",
        "POST",
        lambda w, o: f"{V1}/jobs/{o.job_v.pk}/events/",
        {p: 202 for p in PERSONAS},
        body=lambda w, o: _event(o),
        headers=lambda w, o: {"HTTP_AUTHORIZATION": f"Bearer {attempt_events_token(o.attempt_v)}"},
        session=True,
    ),
    Case(
        "with another job's token",
        "POST",
        lambda w, o: f"{V1}/jobs/{o.job_v.pk}/events/",
        {p: 403 for p in PERSONAS},
        body=lambda w, o: _event(o),
        headers=lambda w, o: {
            "HTTP_AUTHORIZATION": f"Bearer {attempt_events_token(o.attempt_ops)}"
        },
        session=True,
    ),
    Case(
        "without a token",
        "POST",
        lambda w, o: f"{V1}/jobs/{o.job_v.pk}/events/",
        {p: 403 for p in PERSONAS},
        body=lambda w, o: _event(o),
        session=True,
    ),
)
case(
    "GET",
    "/api/v1/jobs/{id}/events/",
    Case(
        "the notice poll with the job's token",
        "GET",
        lambda w, o: f"{V1}/jobs/{o.job_v.pk}/events/",
        {p: 200 for p in PERSONAS},
        headers=lambda w, o: {"HTTP_AUTHORIZATION": f"Bearer {attempt_events_token(o.attempt_v)}"},
        session=True,
    ),
    Case(
        "the notice poll with another job's token",
        "GET",
        lambda w, o: f"{V1}/jobs/{o.job_v.pk}/events/",
        {p: 403 for p in PERSONAS},
        headers=lambda w, o: {
            "HTTP_AUTHORIZATION": f"Bearer {attempt_events_token(o.attempt_ops)}"
        },
        session=True,
    ),
    Case(
        "the notice poll without a token",
        "GET",
        lambda w, o: f"{V1}/jobs/{o.job_v.pk}/events/",
        {p: 403 for p in PERSONAS},
        session=True,
    ),
)
case(
    "GET",
    "/api/v1/jobs/{id}/logs/",
    Case("vision job", "GET", lambda w, o: f"{V1}/jobs/{o.job_v.pk}/logs/?rank=0", VISION_READ),
)
case(
    "GET",
    "/api/v1/nodes/",
    Case("list", "GET", lambda w, o: f"{V1}/nodes/", EVERYONE, visible=_everything(Node)),
)
case(
    "POST",
    "/api/v1/nodes/",
    Case(
        "add",
        "POST",
        lambda w, o: f"{V1}/nodes/",
        _admin_only(201),
        body=lambda w, o: {"name": "h100-node-9", "flavor": "h100-80gb", "gpus": 8},
    ),
)
case(
    "GET",
    "/api/v1/nodes/{id}/",
    Case("one", "GET", lambda w, o: f"{V1}/nodes/{o.spare_node.pk}/", EVERYONE),
)
case(
    "PATCH",
    "/api/v1/nodes/{id}/",
    Case(
        "cordon",
        "PATCH",
        lambda w, o: f"{V1}/nodes/{o.spare_node.pk}/",
        _admin_only(200),
        body=lambda w, o: {"schedulable": False},
    ),
)
case(
    "DELETE",
    "/api/v1/nodes/{id}/",
    Case("remove", "DELETE", lambda w, o: f"{V1}/nodes/{o.spare_node.pk}/", _admin_only(204)),
)
case(
    "GET",
    "/api/v1/preemption-events/",
    Case(
        "list",
        "GET",
        lambda w, o: f"{V1}/preemption-events/",
        EVERYONE,
        visible=_scoped(lambda o: o.event_v, lambda o: o.event_ops),
    ),
)
case(
    "GET",
    "/api/v1/preemption-events/{id}/",
    Case("vision", "GET", lambda w, o: f"{V1}/preemption-events/{o.event_v.pk}/", VISION_READ),
)
case(
    "GET",
    "/api/v1/priority-classes/",
    Case(
        "list",
        "GET",
        lambda w, o: f"{V1}/priority-classes/",
        EVERYONE,
        visible=_everything(PriorityClass),
    ),
)
case(
    "POST",
    "/api/v1/priority-classes/",
    Case(
        "add",
        "POST",
        lambda w, o: f"{V1}/priority-classes/",
        _admin_only(201),
        body=lambda w, o: {"name": "ai-interactive", "value": 50000, "grace_seconds": 30},
    ),
)
case(
    "GET",
    "/api/v1/priority-classes/{id}/",
    Case("one", "GET", lambda w, o: f"{V1}/priority-classes/{w.batch.pk}/", EVERYONE),
)
case(
    "PATCH",
    "/api/v1/priority-classes/{id}/",
    Case(
        "longer grace",
        "PATCH",
        lambda w, o: f"{V1}/priority-classes/{o.spare_class.pk}/",
        _admin_only(200),
        body=lambda w, o: {"grace_seconds": 120},
    ),
)
case(
    "DELETE",
    "/api/v1/priority-classes/{id}/",
    Case(
        "unused class",
        "DELETE",
        lambda w, o: f"{V1}/priority-classes/{o.spare_class.pk}/",
        _admin_only(204),
    ),
)
case(
    "GET",
    "/api/v1/quotas/",
    Case("list", "GET", lambda w, o: f"{V1}/quotas/", EVERYONE, visible=_quotas_visible),
)
case(
    "POST",
    "/api/v1/quotas/",
    Case(
        "quota of nlp (below ml)",
        "POST",
        lambda w, o: f"{V1}/quotas/",
        _expect(201, 201, 403, 403, 403),
        body=lambda w, o: {"team": "nlp", "flavor": "a100-40gb", "guarantee": 0},
    ),
    Case(
        "quota of ml itself",
        "POST",
        lambda w, o: f"{V1}/quotas/",
        _expect(201, 403, 403, 403, 403),
        body=lambda w, o: {"team": "ml", "flavor": "a100-40gb", "guarantee": 0},
    ),
)
case(
    "GET",
    "/api/v1/quotas/{id}/",
    Case("vision", "GET", lambda w, o: f"{V1}/quotas/{w.quota(w.vision).pk}/", VISION_READ),
)
case(
    "PATCH",
    "/api/v1/quotas/{id}/",
    Case(
        "vision",
        "PATCH",
        lambda w, o: f"{V1}/quotas/{w.quota(w.vision).pk}/",
        _expect(200, 200, 404, 403, 404),
        body=lambda w, o: {"guarantee": 4},
    ),
    Case(
        "ml's own quota",
        "PATCH",
        lambda w, o: f"{V1}/quotas/{w.quota(w.ml).pk}/",
        _expect(200, 403, 404, 404, 404),
        body=lambda w, o: {"borrow_limit": 8},
    ),
)
case(
    "DELETE",
    "/api/v1/quotas/{id}/",
    Case(
        "vision",
        "DELETE",
        lambda w, o: f"{V1}/quotas/{w.quota(w.vision).pk}/",
        _expect(204, 204, 404, 403, 404),
    ),
)
case(
    "POST",
    "/api/v1/quotas/{id}/preview/",
    Case(
        "vision",
        "POST",
        lambda w, o: f"{V1}/quotas/{w.quota(w.vision).pk}/preview/",
        _expect(200, 200, 404, 403, 404),
        body=lambda w, o: {"guarantee": 4},
        writes=False,
    ),
)
case(
    "GET",
    "/api/v1/ranks/",
    Case(
        "list",
        "GET",
        lambda w, o: f"{V1}/ranks/",
        EVERYONE,
        visible=_scoped(lambda o: o.rank_v, lambda o: o.rank_ops),
    ),
)
case(
    "GET",
    "/api/v1/ranks/{id}/",
    Case("vision", "GET", lambda w, o: f"{V1}/ranks/{o.rank_v.pk}/", VISION_READ),
)
case(
    "GET",
    "/api/v1/teams/",
    Case("list", "GET", lambda w, o: f"{V1}/teams/", EVERYONE, visible=_teams_visible),
)
case(
    "POST",
    "/api/v1/teams/",
    Case(
        "add",
        "POST",
        lambda w, o: f"{V1}/teams/",
        _admin_only(201),
        body=lambda w, o: {"slug": "speech", "name": "Speech", "parent": "ml"},
    ),
)
case(
    "GET",
    "/api/v1/teams/{id}/",
    Case("vision", "GET", lambda w, o: f"{V1}/teams/{w.vision.pk}/", VISION_READ),
)
case(
    "PATCH",
    "/api/v1/teams/{id}/",
    Case(
        "reweigh vision",
        "PATCH",
        lambda w, o: f"{V1}/teams/{w.vision.pk}/",
        _expect(200, 200, 404, 403, 404),
        body=lambda w, o: {"weight": 2.0},
    ),
    Case(
        "move the empty spare team",
        "PATCH",
        lambda w, o: f"{V1}/teams/{o.spare_team.pk}/",
        _expect(200, 403, 404, 404, 404),
        body=lambda w, o: {"parent": "org"},
    ),
)
case(
    "DELETE",
    "/api/v1/teams/{id}/",
    Case(
        "empty team",
        "DELETE",
        lambda w, o: f"{V1}/teams/{o.spare_team.pk}/",
        _expect(204, 403, 404, 404, 404),
    ),
)
case(
    "GET",
    "/api/v1/teams/{id}/priority-classes/",
    Case("vision", "GET", lambda w, o: f"{V1}/teams/{w.vision.pk}/priority-classes/", VISION_READ),
)
case(
    "PATCH",
    "/api/v1/teams/{id}/priority-classes/",
    Case(
        "narrow vision to batch",
        "PATCH",
        lambda w, o: f"{V1}/teams/{w.vision.pk}/priority-classes/",
        _expect(200, 200, 404, 403, 404),
        body=lambda w, o: {"priority_classes": ["ai-batch-preemptible"]},
    ),
    Case(
        "widen nlp back to critical",
        "PATCH",
        lambda w, o: f"{V1}/teams/{w.nlp.pk}/priority-classes/",
        # Only admins widen; the manager above nlp may only narrow it.
        _expect(200, 403, 404, 404, 404),
        body=lambda w, o: {"priority_classes": ["ai-prod-critical", "ai-batch-preemptible"]},
    ),
    Case(
        "give the org root a new class",
        "PATCH",
        lambda w, o: f"{V1}/teams/{w.org.pk}/priority-classes/",
        _expect(200, 404, 404, 404, 404),
        body=lambda w, o: {"priority_classes": ["ai-batch-preemptible", "spare"]},
    ),
)
case("GET", "/api/v1/teams/tree/", Case("tree", "GET", lambda w, o: f"{V1}/teams/tree/", EVERYONE))
case(
    "GET",
    "/api/v1/tokens/",
    Case("own tokens", "GET", lambda w, o: f"{V1}/tokens/", EVERYONE, visible=_tokens_visible),
)
case(
    "POST",
    "/api/v1/tokens/",
    Case(
        "create",
        "POST",
        lambda w, o: f"{V1}/tokens/",
        _expect(201, 201, 201, 201, 201),
        body=lambda w, o: {"name": "ci"},
    ),
)
case(
    "GET",
    "/api/v1/tokens/{id}/",
    Case(
        "researcher's token",
        "GET",
        lambda w, o: f"{V1}/tokens/{o.tokens['researcher'].pk}/",
        _expect(404, 404, 404, 200, 404),
    ),
)
case(
    "DELETE",
    "/api/v1/tokens/{id}/",
    Case(
        "researcher's token",
        "DELETE",
        lambda w, o: f"{V1}/tokens/{o.tokens['researcher'].pk}/",
        _expect(404, 404, 404, 204, 404),
    ),
)
case(
    "POST",
    "/api/v1/tokens/login/",
    Case(
        "right password",
        "POST",
        lambda w, o: f"{V1}/tokens/login/",
        {p: 201 for p in PERSONAS},
        body=lambda w, o: {"username": "researcher", "password": PASSWORD},
    ),
    Case(
        "wrong password",
        "POST",
        lambda w, o: f"{V1}/tokens/login/",
        {p: 403 for p in PERSONAS},
        body=lambda w, o: {"username": "researcher", "password": "guess"},
    ),
)
case(
    "GET",
    "/api/v1/webhooks/",
    Case("list", "GET", lambda w, o: f"{V1}/webhooks/", EVERYONE, visible=_webhooks_visible),
)
case(
    "POST",
    "/api/v1/webhooks/",
    Case(
        "for vision",
        "POST",
        lambda w, o: f"{V1}/webhooks/",
        _expect(201, 201, 403, 403, 403),
        body=lambda w, o: {
            "team": "vision",
            "url": "https://192.0.2.10/qm",
            "events": ["preempted"],
        },
    ),
)
case(
    "GET",
    "/api/v1/webhooks/{id}/",
    Case(
        "vision",
        "GET",
        lambda w, o: f"{V1}/webhooks/{o.webhook_v.pk}/",
        _expect(200, 200, 404, 404, 404),
    ),
)
case(
    "DELETE",
    "/api/v1/webhooks/{id}/",
    Case(
        "vision",
        "DELETE",
        lambda w, o: f"{V1}/webhooks/{o.webhook_v.pk}/",
        _expect(204, 204, 404, 404, 404),
    ),
)


def _schema_operations() -> set[tuple[str, str]]:
    schema = SchemaGenerator().get_schema(request=None, public=True)
    return {
        (method.upper(), path)
        for path, item in schema["paths"].items()
        for method in item
        if method in {"get", "post", "put", "patch", "delete"}
    }


def test_every_operation_has_a_case_table_for_every_persona() -> None:
    operations = _schema_operations()
    missing = sorted(
        f"{method} {path}" for method, path in operations if (method, path) not in CASES
    )
    assert not missing, f"operations without a case table: {missing}"
    for key, tables in CASES.items():
        assert key in operations, f"case table for {key} matches no operation of the schema"
        for table in tables:
            assert set(table.expect) == set(PERSONAS), (
                f"{key} {table.name}: not every persona has a case"
            )
            denied = [p for p, code in table.expect.items() if code >= 400]
            assert all(table.expect[p] in (401, 403, 404) for p in denied), f"{key} {table.name}"


PARAMS = [
    pytest.param(table, persona, id=f"{method} {path} [{table.name}] as {persona}")
    for (method, path), tables in sorted(CASES.items())
    for table in tables
    for persona in PERSONAS
]


@pytest.mark.parametrize(("table", "persona"), PARAMS)
def test_operation_as_persona(world: Any, objects: Objects, table: Case, persona: str) -> None:
    if table.session:
        client = APIClient()
        if persona != "anonymous":
            client.force_login(world.users[persona])
    else:
        client = world.client(persona)
    path = table.path(world, objects)
    body = table.body(world, objects) if table.body else None
    headers = table.headers(world, objects) if table.headers else {}
    expected = table.expect[persona]
    before = database_state()
    response = getattr(client, table.method.lower())(path, body, format="json", **headers)
    assert response.status_code == expected, (
        persona,
        path,
        response.status_code,
        getattr(response, "data", None),
    )
    if expected >= 400:
        assert database_state() == before, f"{persona} was refused but the database changed"
        return
    if table.method != "GET" and table.writes:
        assert database_state() != before, (
            f"{persona}'s {table.method} succeeded but changed nothing"
        )
    if table.visible is not None:
        rows = response.json()
        rows = rows["results"] if isinstance(rows, dict) else rows
        assert {row["id"] for row in rows} == table.visible(world, objects)[persona]
