"""Attacks on sign-in, API tokens, /metrics, error pages and the production start.

Each case of `ATTACKS` is one attack as an outsider would try it, the status it
must get, the reason the answer must give, and (checked for every case) the
database unchanged afterwards. Login throttling is attacked on each of the
three login paths (portal, Django admin, the API's token login), once per
account (wrong passwords from many addresses) and once per address (wrong
passwords for many accounts), each time ending with the right password.

The production-start cases run `manage.py` in a subprocess with a deployment's
environment, since the refusal happens while settings load.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from axes.models import AccessAttempt
from django.conf import settings
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from portal.models import ApiToken, TokenScope
from portal.services import api_token_create
from preemption.models import Job, JobState
from tests.conftest import PASSWORD, database_state

ROOT = Path(__file__).resolve().parents[2]
WRONG_TRIES = 30


@pytest.fixture(autouse=True)
def _fast_passwords(settings: Any) -> None:
    # Thirty wrong passwords per case: the default hasher would make that
    # minutes on a busy machine, and hashing strength is not under test.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


# --- the three login paths ------------------------------------------------------------------


@dataclass
class LoginPath:
    """One way to sign in with a password, and how to tell that it let the user in."""

    name: str
    url: str
    api: bool

    def attempt(self, username: str, password: str, address: str, **headers: str) -> Any:
        if self.api:
            return APIClient().post(
                self.url,
                {"username": username, "password": password},
                format="json",
                REMOTE_ADDR=address,
                **headers,
            )
        return Client().post(
            self.url,
            {"username": username, "password": password, "next": "/admin/"},
            REMOTE_ADDR=address,
            **headers,
        )

    def accepted(self, response: Any) -> bool:
        return response.status_code == (201 if self.api else 302)


LOGIN_PATHS = {
    "portal": LoginPath("portal", "/login/", api=False),
    "admin": LoginPath("admin", "/admin/login/", api=False),
    "api": LoginPath("api", "/api/v1/tokens/login/", api=True),
}


def _wrong_tries(path: LoginPath, *, per: str, victim: str) -> str:
    """30 wrong passwords; returns the address the right password then comes from.

    per="address" (the one lockout there is): every wrong try from one address,
    each for a different (made-up) account, and the right password for the
    victim later from that same address."""
    assert per == "address", per
    for index in range(WRONG_TRIES):
        path.attempt(f"nobody-{index}", f"guess-{index}", "10.2.0.1")
    return "10.2.0.1"


def _wrong_then_right(path: LoginPath, *, per: str, victim: str) -> Any:
    address = _wrong_tries(path, per=per, victim=victim)
    return path.attempt(victim, PASSWORD, address)


# --- the attack table -----------------------------------------------------------------------


Strike = Callable[[], Any]


@dataclass
class Attack:
    """One attack: `prepare` sets the scene (tokens, earlier wrong passwords) and
    returns the strike, whose answer must carry the status and the reason and
    which must leave the database as it found it."""

    name: str
    prepare: Callable[[Any], Strike]
    status: int
    reason: str
    header: tuple[str, str] | None = None


def _bearer(value: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {value}"}


def _token(world: Any, persona: str = "researcher", **options: Any) -> str:
    """A token of the persona's, as if used a moment ago: a token's first use in a
    minute records when (portal/auth.py), which is bookkeeping, not the attack."""
    token, value = api_token_create(user=world.users[persona], name="attack", **options)
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
    return value


def _login_attack(name: str, per: str) -> Callable[[Any], Strike]:
    path = LOGIN_PATHS[name]
    victim = "admin" if name == "admin" else "researcher"

    def prepare(world: Any) -> Strike:
        address = _wrong_tries(path, per=per, victim=victim)
        return lambda: path.attempt(victim, PASSWORD, address)

    return prepare


def _expired_token(world: Any) -> Strike:
    value = _token(world)
    ApiToken.objects.filter(user=world.users["researcher"]).update(
        expires_at=timezone.now() - timedelta(minutes=1)
    )
    return lambda: APIClient().get("/api/v1/jobs/", **_bearer(value))


def _expired_token_on_metrics(world: Any) -> Strike:
    value = _token(world)
    ApiToken.objects.filter(user=world.users["researcher"]).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    return lambda: Client().get(reverse("metrics"), **_bearer(value))


def _read_only_token_posts(world: Any) -> Strike:
    value = _token(world, scope=TokenScope.READ)
    body = {
        "name": "sneaky",
        "team": "vision",
        "flavor": "h100-80gb",
        "ranks": 1,
        "gpus_per_rank": 1,
        "command": "sleep 1",
    }
    return lambda: APIClient().post("/api/v1/jobs/", body, format="json", **_bearer(value))


def _read_only_token_revokes(world: Any) -> Strike:
    value = _token(world, scope=TokenScope.READ)
    mine = ApiToken.objects.get(user=world.users["researcher"])
    return lambda: APIClient().delete(f"/api/v1/tokens/{mine.pk}/", **_bearer(value))


def _token_mints_token(world: Any) -> Strike:
    value = _token(world)
    return lambda: APIClient().post(
        "/api/v1/tokens/", {"name": "forever"}, format="json", **_bearer(value)
    )


def _token_beyond_the_maximum(world: Any) -> Strike:
    client = APIClient()
    client.force_login(world.users["researcher"])
    days = settings.QM_TOKEN_MAX_DAYS + 1
    return lambda: client.post("/api/v1/tokens/", {"name": "long", "days": days}, format="json")


def _login_token_beyond_the_maximum(world: Any) -> Strike:
    body = {"username": "researcher", "password": PASSWORD, "days": 100_000}
    return lambda: APIClient().post("/api/v1/tokens/login/", body, format="json")


def _missing_page(world: Any) -> Strike:
    return lambda: Client().get("/no-such-page/")


ATTACKS = [
    *[
        Attack(
            f"{WRONG_TRIES} wrong then right, per {per}, on the {name} login",
            _login_attack(name, per),
            429,
            "Too many failed sign-ins",
            ("Retry-After", "900"),
        )
        for name in LOGIN_PATHS
        for per in ("address",)
    ],
    Attack("an expired token", _expired_token, 401, "This token expired at"),
    Attack("an expired token on /metrics", _expired_token_on_metrics, 401, "This token expired at"),
    Attack("a read-only token POSTing a job", _read_only_token_posts, 403, "read-only"),
    Attack("a read-only token revoking a token", _read_only_token_revokes, 403, "read-only"),
    Attack("a token minting a token", _token_mints_token, 403, "A token cannot create tokens"),
    Attack(
        "a session asking for a token beyond the maximum lifetime",
        _token_beyond_the_maximum,
        400,
        "A token lasts from 1 to",
    ),
    Attack(
        "a login asking for a token beyond the maximum lifetime",
        _login_token_beyond_the_maximum,
        400,
        "A token lasts from 1 to",
    ),
    Attack("a missing page", _missing_page, 404, "There is no page at /no-such-page/"),
]


@pytest.mark.parametrize("attack", ATTACKS, ids=[attack.name for attack in ATTACKS])
def test_attack_is_refused_with_its_reason_and_changes_nothing(world: Any, attack: Attack) -> None:
    strike = attack.prepare(world)
    tokens = set(ApiToken.objects.values_list("pk", flat=True))
    before = database_state()
    response = strike()
    assert response.status_code == attack.status, (attack.name, response.content[:400])
    assert attack.reason in response.content.decode(), response.content[:400]
    if attack.header is not None:
        name, value = attack.header
        assert response[name] == value
    assert database_state() == before, f"{attack.name}: refused, but the database changed"
    assert set(ApiToken.objects.values_list("pk", flat=True)) == tokens


# --- the lockouts are aimed: a neighbour still gets in, and it ends ------------------------


@pytest.mark.parametrize("name", LOGIN_PATHS)
def test_wrong_passwords_from_elsewhere_never_lock_the_owner_out(world: Any, name: str) -> None:
    """An attacker who knows an account's name sends wrong passwords for it from
    ten addresses, and ten more from one: the owner still signs in from their own
    address, and the attacker's address is locked, even with the right password."""
    path = LOGIN_PATHS[name]
    owner = "admin" if name == "admin" else "researcher"
    for index in range(settings.AXES_FAILURE_LIMIT):
        assert not path.accepted(path.attempt(owner, f"guess-{index}", f"10.7.0.{index + 1}"))
    for index in range(settings.AXES_FAILURE_LIMIT):
        path.attempt(owner, f"guess-{index}", "10.7.1.1")
    assert path.accepted(path.attempt(owner, PASSWORD, "10.8.0.1"))
    locked = path.attempt(owner, PASSWORD, "10.7.1.1")
    assert locked.status_code == 429
    assert "Too many failed sign-ins from this address" in locked.content.decode()


@pytest.mark.parametrize("name", LOGIN_PATHS)
def test_an_address_lockout_leaves_the_account_free_from_other_addresses(
    world: Any, name: str
) -> None:
    path = LOGIN_PATHS[name]
    victim = "admin" if name == "admin" else "researcher"
    assert _wrong_then_right(path, per="address", victim=victim).status_code == 429
    assert path.accepted(path.attempt(victim, PASSWORD, "10.3.0.1"))


def test_behind_a_proxy_logins_count_per_client_and_a_forged_header_does_not_help(
    world: Any, settings: Any
) -> None:
    settings.QM_PROXY_COUNT = 1
    path, ingress = LOGIN_PATHS["portal"], "10.9.9.9"
    for index in range(WRONG_TRIES):
        # The client forges an address of its own in front; the ingress appends the real one.
        forged = f"192.0.2.{index + 1}, 10.6.0.1"
        path.attempt(f"nobody-{index}", "guess", ingress, HTTP_X_FORWARDED_FOR=forged)
    locked = path.attempt("researcher", PASSWORD, ingress, HTTP_X_FORWARDED_FOR="10.6.0.1")
    assert locked.status_code == 429
    # Another client behind the same ingress is not locked out with it.
    other = path.attempt("researcher", PASSWORD, ingress, HTTP_X_FORWARDED_FOR="10.6.0.2")
    assert path.accepted(other)


def test_the_portal_lockout_page_says_why_and_signs_nobody_in(world: Any) -> None:
    client = Client()
    for index in range(WRONG_TRIES):
        client.post(
            "/login/",
            {"username": "researcher", "password": f"guess-{index}", "csrfmiddlewaretoken": "t"},
            REMOTE_ADDR="10.4.0.1",
        )
    response = client.post(
        "/login/", {"username": "researcher", "password": PASSWORD}, REMOTE_ADDR="10.4.0.1"
    )
    body = response.content.decode()
    assert response.status_code == 429
    assert 'id="lockout"' in body and "even with the right password" in body
    assert '<form method="post" action="/login/"' in body  # the portal's own layout and form
    assert "_auth_user_id" not in client.session
    # What axes keeps of the failed tries holds neither the passwords nor CSRF tokens.
    kept = " ".join(AccessAttempt.objects.values_list("post_data", flat=True))
    assert "guess-" not in kept and PASSWORD not in kept
    assert "csrfmiddlewaretoken=*" in kept and "csrfmiddlewaretoken=t" not in kept


def test_a_lockout_ends_after_the_lockout_time(world: Any, settings: Any) -> None:
    path = LOGIN_PATHS["api"]
    assert _wrong_then_right(path, per="address", victim="researcher").status_code == 429
    # The cool-off counts from the last try; move every try past it.
    AccessAttempt.objects.update(
        attempt_time=timezone.now() - settings.AXES_COOLOFF_TIME - timedelta(seconds=1)
    )
    assert path.accepted(path.attempt("researcher", PASSWORD, "10.2.0.1"))


def test_wrong_passwords_under_the_limit_do_not_lock_anyone_out(world: Any) -> None:
    path = LOGIN_PATHS["api"]
    for index in range(settings.AXES_FAILURE_LIMIT - 1):
        path.attempt("researcher", f"guess-{index}", "10.5.0.1")
    assert path.accepted(path.attempt("researcher", PASSWORD, "10.5.0.1"))


# --- what a token may do --------------------------------------------------------------------


def test_a_read_only_token_reads_and_a_full_token_writes(world: Any) -> None:
    read = _token(world, scope=TokenScope.READ)
    assert APIClient().get("/api/v1/jobs/", **_bearer(read)).status_code == 200
    assert Client().get(reverse("metrics"), **_bearer(read)).status_code == 200
    full = _token(world)
    mine = ApiToken.objects.get(user=world.users["researcher"], scope=TokenScope.READ)
    assert APIClient().delete(f"/api/v1/tokens/{mine.pk}/", **_bearer(full)).status_code == 204


def test_tokens_expire_after_the_default_lifetime_unless_asked_otherwise(world: Any) -> None:
    client = APIClient()
    client.force_login(world.users["researcher"])
    default = client.post("/api/v1/tokens/", {"name": "ci"}, format="json").json()
    short = client.post(
        "/api/v1/tokens/", {"name": "ci-ro", "days": 2, "scope": "read"}, format="json"
    ).json()
    now = timezone.now()
    expires = ApiToken.objects.get(pk=default["id"]).expires_at
    assert abs(expires - (now + timedelta(days=settings.QM_TOKEN_DEFAULT_DAYS))) < timedelta(
        minutes=1
    )
    assert default["scope"] == "full" and short["scope"] == "read"
    assert abs(ApiToken.objects.get(pk=short["id"]).expires_at - (now + timedelta(days=2))) < (
        timedelta(minutes=1)
    )
    listed = {row["id"]: row for row in client.get("/api/v1/tokens/").json()["results"]}
    assert listed[short["id"]]["expires_at"] and listed[short["id"]]["scope"] == "read"
    login = APIClient().post(
        "/api/v1/tokens/login/",
        {"username": "researcher", "password": PASSWORD, "days": 1, "scope": "read"},
        format="json",
    )
    assert login.status_code == 201 and login.json()["scope"] == "read"


def test_the_token_page_shows_expiry_and_scope_and_creates_read_only_tokens(world: Any) -> None:
    client = Client()
    client.force_login(world.users["researcher"])
    response = client.post(reverse("tokens"), {"name": "grafana", "days": "7", "read_only": "on"})
    assert response.status_code == 200
    token = ApiToken.objects.get(name="grafana")
    assert token.scope == TokenScope.READ
    assert abs(token.expires_at - (timezone.now() + timedelta(days=7))) < timedelta(minutes=1)
    page = client.get(reverse("tokens")).content.decode()
    assert "read only" in page and token.expires_at.strftime("%Y-%m-%d") in page
    too_long = client.post(
        reverse("tokens"), {"name": "forever", "days": str(settings.QM_TOKEN_MAX_DAYS + 1)}
    )
    assert too_long.status_code == 400
    assert not ApiToken.objects.filter(name="forever").exists()


# --- /metrics: a researcher sees only their teams --------------------------------------------


def test_a_researcher_reads_no_other_teams_metrics(world: Any) -> None:
    Job.objects.create(
        name="ops-waiting",
        team=world.ops,
        submitter=world.users["other_researcher"],
        priority_class=world.batch,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=2,
        command="sleep 1",
        state=JobState.PENDING,
    )
    admin = Client().get(reverse("metrics"), **_bearer(_token(world, "admin"))).content.decode()
    assert 'team="ops"' in admin  # the series exist; the scrape below must not show them
    researcher = _token(world, "researcher")
    before = database_state()
    scraped = Client().get(reverse("metrics"), **_bearer(researcher))
    text = scraped.content.decode()
    assert scraped.status_code == 200
    assert 'qm_gpu_guarantee{team="vision",flavor="h100-80gb"} 8' in text
    for team in ("ops", "other", "nlp", "ml", "org"):
        assert f'team="{team}"' not in text, team
    assert database_state() == before


# --- debug pages: off by default, refused in production ------------------------------------


def _manage(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {
        key: value
        for key, value in os.environ.items()
        # The browser tests set DJANGO_ALLOW_ASYNC_UNSAFE in this process; a
        # deployment never has it, and the deploy checks refuse it.
        if not key.startswith(
            ("QM_", "DEBUG", "SECRET_KEY", "ALLOWED_HOSTS", "DJANGO_ALLOW_ASYNC_UNSAFE")
        )
    }
    base["QM_VAR_DIR"] = os.environ.get("QM_VAR_DIR", str(ROOT / "var" / "test"))
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


STRONG_KEY = "k3J9-vQ_x2Lm8pR7tY1wZ4nB6cD0eF5gH3jK8lM2nP9qR4sT7uV1wX6yZ0aB5cD8eF"
# deploy/config.yaml's settings (the Kubernetes runtime), with a strong key.
PRODUCTION = {
    "QM_PRODUCTION": "1",
    "QM_RUNTIME": "kubernetes",
    # As deploy/config.yaml names it: production refuses Kubernetes without a checkpoint volume.
    "QM_K8S_CHECKPOINT_CLAIM": "qm-checkpoints",
    "SECRET_KEY": STRONG_KEY,
    "ALLOWED_HOSTS": "qm.example.org",
    "CSRF_TRUSTED_ORIGINS": "https://qm.example.org",
}


def test_debug_is_off_by_default_and_on_only_when_asked() -> None:
    show = "from django.conf import settings; print('DEBUG', settings.DEBUG)"
    assert "DEBUG False" in _manage("shell", "-c", show).stdout
    assert "DEBUG True" in _manage("shell", "-c", show, QM_DEBUG="1").stdout


def test_a_deployment_passes_the_deploy_checks() -> None:
    checked = _manage("check", "--deploy", "--fail-level", "WARNING", **PRODUCTION)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "no issues" in checked.stdout


@pytest.mark.parametrize(
    ("name", "env", "reason"),
    [
        ("debug on", {"QM_DEBUG": "1"}, "DEBUG is on while QM_PRODUCTION is on"),
        ("debug on, old name", {"DEBUG": "true"}, "DEBUG is on while QM_PRODUCTION is on"),
        ("no key", {"SECRET_KEY": ""}, "SECRET_KEY is 0 characters long"),
        ("short key", {"SECRET_KEY": "s3cr3t-but-short"}, "SECRET_KEY is 16 characters long"),
        ("low-entropy key", {"SECRET_KEY": "ab" * 40}, "uses only 2 distinct characters"),
        (
            "django-insecure key",
            {"SECRET_KEY": "django-insecure-" + STRONG_KEY},
            "starts with 'django-insecure-'",
        ),
    ],
)
def test_production_refuses_to_start(name: str, env: dict[str, str], reason: str) -> None:
    started = _manage("check", **{**PRODUCTION, **env})
    assert started.returncode != 0, name
    assert "ImproperlyConfigured" in started.stderr and reason in started.stderr, started.stderr
