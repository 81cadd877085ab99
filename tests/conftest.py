"""Shared fixtures: a small cluster and the six personas every view is tested as.

The world:
    org (root, 16 h100)          other (root, 8 h100)
    └── ml (inner, 16)           └── ops (leaf, 8)
        ├── vision (leaf, 8)
        └── nlp (leaf, 8)
Nodes: 3 × 8 h100 GPUs (24 in all), 1 × 8 a100.
Personas: admin (staff), manager (of ml), other_manager (of other),
researcher (of vision), other_researcher (of ops), anonymous.
Both root teams may use both mission classes, as the migration leaves an
installation that existed before teams had priority classes.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.apps import apps
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.hashers import make_password
from django.core.cache import cache
from django.core.management import call_command
from django.db import transaction
from django.db.backends.base.creation import BaseDatabaseCreation
from hypothesis import settings as hypothesis_settings
from rest_framework.test import APIClient

from preemption.runtimes.runner import RunnerAccount, find_runner
from quotas.models import Membership, Node, PriorityClass, Quota, ResourceFlavor, Team
from tests import builders

# Hypothesis draws the same examples on every run of the suite ("suite", the default), so
# that a red run is the code's doing and reproduces; HYPOTHESIS_PROFILE=explore draws new
# ones each run, to search wider (the engine's known rare flaps are in fairshare/README.md).
hypothesis_settings.register_profile("suite", derandomize=True)
hypothesis_settings.register_profile("explore", derandomize=False)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))

# `make test` starts two of its pytest runs in the background, where the shell ignores
# SIGINT, and every process a test starts would inherit that: give the run (and so those
# processes) SIGINT's usual handling back, as in a run started in the foreground, so
# tests of signals see the same, and Ctrl-C stops every run. An xdist worker keeps what
# xdist gave it.
if "PYTEST_XDIST_WORKER" not in os.environ and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

PERSONAS = ("admin", "manager", "other_manager", "researcher", "other_researcher", "anonymous")
PASSWORD = "correct-horse-battery-staple"


TESTS = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True, specname="pytest_collection_modifyitems")
def pytest_mark_kubernetes_tests(items: list[pytest.Item]) -> None:
    """Mark `k8s` every test that needs the Kubernetes control plane, wherever it is.

    `make test` runs these in a pytest process of their own beside the xdist workers
    (`-m k8s`): the control plane, the kubelet stand-in's nodes and the real nodes are
    session-wide and one per machine, and a kube-apiserver per worker would cost more
    than it saves. First, so that `-m` sees the marks."""
    for item in items:
        if Path(str(item.path)).is_relative_to(TESTS / "k8s") or "control_plane" in getattr(
            item, "fixturenames", ()
        ):
            item.add_marker(pytest.mark.k8s)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_setupnodes(config: pytest.Config, specs: list[Any]) -> None:
    """Start the xdist workers on the settings this process loaded: tests/worker_settings.py
    put `portal.settings` in the environment for the processes tests start, and a worker
    would take the environment's over the ini file's."""
    os.environ["DJANGO_SETTINGS_MODULE"] = settings.SETTINGS_MODULE


_deserialize_db = BaseDatabaseCreation.deserialize_db_from_string


def _deserialize_into_an_empty_database(self: BaseDatabaseCreation, data: str) -> None:
    """Empty the database before a serialized test restores the migrated rows into it.

    Django restores them assuming the last transactional test left the database empty;
    one without serialized rollback leaves the content types re-created under new ids
    (its flush runs post_migrate), and the restored ids then collide with them. The
    order below keeps serialized tests first, but a pytest-xdist worker may still be
    handed one after another transactional test, so the restore does not rely on it."""
    call_command(
        "flush",
        verbosity=0,
        interactive=False,
        database=self.connection.alias,
        reset_sequences=False,
        inhibit_post_migrate=True,
    )
    _deserialize_db(self, data)


BaseDatabaseCreation.deserialize_db_from_string = _deserialize_into_an_empty_database  # type: ignore[method-assign]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the transactional tests that restore the migrated rows
    (`serialized_rollback=True`) before the other transactional tests.

    pytest-django already runs rollback tests first and transactional ones after.
    A transactional test without serialized rollback flushes the database at its
    end and Django re-creates the content types under new ids; a serialized test
    after it then restores the old ids and collides with them. Serialized tests
    leave an empty database behind, which every other transactional test accepts.
    """

    def serialized_transactional(item: pytest.Item) -> bool:
        marker = item.get_closest_marker("django_db")
        return bool(
            marker
            and marker.kwargs.get("serialized_rollback")
            and (
                marker.kwargs.get("transaction")
                or "live_server" in getattr(item, "fixturenames", [])
            )
        )

    first_transactional = next(
        (
            index
            for index, item in enumerate(items)
            if "transactional_db" in getattr(item, "fixturenames", [])
            or "live_server" in getattr(item, "fixturenames", [])
            or (
                (marker := item.get_closest_marker("django_db")) is not None
                and marker.kwargs.get("transaction")
            )
        ),
        None,
    )
    if first_transactional is None:
        return
    rest = items[first_transactional:]
    rest.sort(key=lambda item: not serialized_transactional(item))
    items[first_transactional:] = rest


@pytest.fixture(autouse=True)
def _fresh_request_counts() -> None:
    """The API's request rates count in Django's cache, which outlives a test: each
    test starts with none counted, as a user or an address would after a quiet
    minute, so no test is throttled for what the ones before it sent."""
    cache.clear()


@dataclass
class World:
    h100: ResourceFlavor
    a100: ResourceFlavor
    org: Team
    ml: Team
    vision: Team
    nlp: Team
    other: Team
    ops: Team
    critical: PriorityClass
    batch: PriorityClass
    users: dict[str, Any]

    def quota(self, team: Team, flavor: ResourceFlavor | None = None) -> Quota:
        return Quota.objects.get(team=team, flavor=flavor or self.h100)

    def client(self, persona: str) -> APIClient:
        client = APIClient()
        if persona != "anonymous":
            client.force_authenticate(self.users[persona])
        return client


MISSION_CLASSES = {
    "ai-prod-critical": {
        "value": 1_000_000,
        "preemption_policy": "PreemptLowerPriority",
        "preemptible": False,
        "grace_seconds": 90,
        "is_default": False,
    },
    "ai-batch-preemptible": {
        "value": 10_000,
        "preemption_policy": "Never",
        "preemptible": True,
        "grace_seconds": 60,
        "is_default": True,
    },
}


def mission_class(name: str) -> PriorityClass:
    """The seeded classes; transactional tests flush the data migration's rows."""
    return PriorityClass.objects.get_or_create(name=name, defaults=MISSION_CLASSES[name])[0]


_PASSWORD_HASHES: dict[str, str] = {}


def persona_password_hash() -> str:
    """PASSWORD as the first of settings.PASSWORD_HASHERS stores it, hashed once per run.

    The default hasher takes about a third of a second of CPU by design, and `world`
    signs up five personas for each of the suite's many tests. They share one salt,
    which no test can tell; each signs in with PASSWORD through the same hasher
    (a test that hands the personas a faster hasher gets that hasher's hash)."""
    hasher = settings.PASSWORD_HASHERS[0]
    if hasher not in _PASSWORD_HASHES:
        _PASSWORD_HASHES[hasher] = make_password(PASSWORD)
    return _PASSWORD_HASHES[hasher]


def build_world() -> World:
    """The world's rows: `world` builds them for each test, `world_built_once` for a module."""
    User = get_user_model()
    h100 = ResourceFlavor.objects.create(name="h100-80gb")
    a100 = ResourceFlavor.objects.create(name="a100-40gb")
    for index in range(3):
        Node.objects.create(name=f"h100-node-{index}", flavor=h100, gpus=8)
    Node.objects.create(name="a100-node-0", flavor=a100, gpus=8)
    org = builders.team("org", name="Org", quotas={h100: 16})
    ml = builders.team("ml", name="ML", parent=org, quotas={h100: 16})
    vision = builders.team("vision", name="Vision", parent=ml, quotas={h100: 8})
    nlp = builders.team("nlp", name="NLP", parent=ml, quotas={h100: 8})
    other = builders.team("other", name="Other", quotas={h100: 8})
    ops = builders.team("ops", name="Ops", parent=other, quotas={h100: 8})
    critical, batch = mission_class("ai-prod-critical"), mission_class("ai-batch-preemptible")
    for root in (org, other):
        root.priority_classes.set([critical, batch])
    users: dict[str, Any] = {}
    password = persona_password_hash()
    # `create`, not `create_user`, to store the hash made once (create_user hashes anew).
    users["admin"] = User.objects.create(
        username="admin",
        email="admin@example.org",
        password=password,
        is_staff=True,
        is_superuser=True,
    )
    for persona, team, role in (
        ("manager", ml, "manager"),
        ("other_manager", other, "manager"),
        ("researcher", vision, "researcher"),
        ("other_researcher", ops, "researcher"),
    ):
        users[persona] = User.objects.create(
            username=persona, email=f"{persona}@example.org", password=password
        )
        Membership.objects.create(user=users[persona], team=team, role=role)
    return World(
        h100=h100,
        a100=a100,
        org=org,
        ml=ml,
        vision=vision,
        nlp=nlp,
        other=other,
        ops=ops,
        critical=critical,
        batch=batch,
        users=users,
    )


@pytest.fixture
def world(db: Any) -> World:
    return build_world()


@pytest.fixture
def collector_on() -> Iterator[None]:
    """Python's cyclic garbage collector on for the test, and as it was afterwards: for
    tests of the code that pauses it (fairshare.collector_paused)."""
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


@contextmanager
def world_built_once(django_db_blocker: Any) -> Iterator[World]:
    """The world for a module-scoped fixture: built once for all the module's tests
    rather than once per test, in a transaction rolled back when the module is done.

    Each test still starts from exactly these rows: the `db` fixture runs it in a
    savepoint inside this transaction and rolls back whatever it wrote, as Django's
    `TestCase.setUpTestData` does for a class. Hand each test a copy of the instances
    (`copy.deepcopy`), so that what one does to them in memory (a user's last_login,
    a refreshed row) is not what the next starts from."""
    with django_db_blocker.unblock(), transaction.atomic():
        yield build_world()
        transaction.set_rollback(True)


@pytest.fixture(scope="session")
def runner_account() -> RunnerAccount:
    """The real second OS user the local runtime runs ranks as.

    bin/runner-user creates it with `useradd --system` when it is missing and lets it
    reach this interpreter; the tests run as root, as CI does.
    """
    script = Path(__file__).resolve().parents[1] / "bin" / "runner-user"
    result = subprocess.run(
        [str(script), sys.executable],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "QM_RUNNER_USER": settings.QM_RUNNER_USER},
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lookup = find_runner(settings.QM_RUNNER_USER, gid_base=settings.QM_RUNNER_GID_BASE)
    assert lookup.account is not None, lookup.reason
    return lookup.account


@pytest.fixture
def runner_tmp_path() -> Iterator[Path]:
    """A temporary folder the runner user may pass through (pytest's own are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="qm-test-"))
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def database_state() -> dict[str, list[dict[str, Any]]]:
    """Every row of the project's apps and of auth, to show a refusal changed nothing."""
    state: dict[str, list[dict[str, Any]]] = {}
    for label in ("portal", "quotas", "preemption", "telemetry", "auth"):
        # Auto-created models are the many-to-many tables, such as the
        # priority classes each team may use.
        for model in apps.get_app_config(label).get_models(include_auto_created=True):
            state[model._meta.label] = list(model.objects.order_by("pk").values())
    return state
