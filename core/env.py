"""Strict readers for settings that come from the environment.

Each reader raises ImproperlyConfigured naming the variable, so a typo in a
deployment fails at start-up instead of somewhere later.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
SQLITE_ENGINE = "core.sqlite_turns"


def env_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value is None else value


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean (1/0, true/false, yes/no), got {value!r}")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        parsed = int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and parsed < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, got {parsed}")
    return parsed


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        parsed = float(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, got {value!r}") from None
    if minimum is not None and parsed < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, got {parsed}")
    return parsed


def env_list(name: str, default: list[str]) -> list[str]:
    value = os.environ.get(name)
    if value is None:
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


def env_mapping(name: str, default: dict[str, str]) -> dict[str, str]:
    """``key=value`` pairs separated by commas."""
    value = os.environ.get(name)
    if value is None:
        return default
    pairs: dict[str, str] = {}
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        key, sep, text = item.partition("=")
        if not sep or not key.strip() or not text.strip():
            raise ImproperlyConfigured(f"{name} must be key=value pairs, got {item!r}")
        pairs[key.strip()] = text.strip()
    return pairs


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(name, default)
    if value not in choices:
        raise ImproperlyConfigured(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def parse_database_url(name: str, url: str) -> dict[str, Any]:
    """Turn `sqlite:///path` or `postgres://user:pass@host:port/db` into a DATABASES entry."""
    parsed = urlparse(url)
    if parsed.scheme == "sqlite":
        path = unquote(parsed.path)
        if url.startswith("sqlite:////"):
            path = "/" + path.lstrip("/")
        elif path.startswith("/"):
            path = path[1:]
        if not path:
            raise ImproperlyConfigured(f"{name} names no SQLite file: {url!r}")
        return {
            # Django's SQLite backend, whose write transactions take turns
            # (core/sqlite_turns/base.py says why).
            "ENGINE": SQLITE_ENGINE,
            "NAME": str(Path(path)),
            # Each web server thread and worker keeps its connection between
            # requests and tasks: opening one, with its PRAGMAs, for every API
            # request took about a fifteenth of the web server's time in a burst
            # of job submissions.
            "CONN_MAX_AGE": 60,
            # Web, worker, beat and the trap's events all write: WAL lets readers
            # go on while one writer works, and IMMEDIATE transactions wait on the
            # busy timeout instead of failing on lock upgrades.
            "OPTIONS": {
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
                "transaction_mode": "IMMEDIATE",
                "timeout": 30,
            },
        }
    if parsed.scheme in ("postgres", "postgresql", "pgsql"):
        database = unquote(parsed.path.lstrip("/"))
        if not database:
            raise ImproperlyConfigured(f"{name} names no database: {url!r}")
        options = {key: values[-1] for key, values in parse_qs(parsed.query).items()}
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": database,
            "USER": unquote(parsed.username or ""),
            "PASSWORD": unquote(parsed.password or ""),
            "HOST": parsed.hostname or "",
            "PORT": str(parsed.port or ""),
            "CONN_MAX_AGE": 60,
            "CONN_HEALTH_CHECKS": True,
            "OPTIONS": options,
        }
    raise ImproperlyConfigured(
        f"{name} must start with sqlite:// or postgres://, got {parsed.scheme or url!r}"
    )


def read_or_create_secret(path: Path) -> str:
    """Read the embedded default's secret key, generating it on first use (mode 0600)."""
    from django.core.management.utils import get_random_secret_key

    if path.exists():
        private_file(path)
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = get_random_secret_key()
    # Create exclusively so two processes starting at once keep one key, and with its
    # final mode so it is never readable by others, not even for a moment.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with open(fd, "w") as handle:
        handle.write(secret)
    return secret


# A production key must be long and varied. Django's own deploy check asks for
# 50 characters and 5 distinct ones; ten distinct characters is still well
# below what any generator produces (a hex key uses 16), but it refuses keys
# typed by hand such as a repeated word.
SECRET_KEY_MIN_DISTINCT = 10


def check_secret_key(name: str, value: str) -> str:
    """Refuse a secret key that would let anyone forge sessions and CSRF tokens.

    The rule is Django's `security.W009` (length, distinct characters, the
    `django-insecure-` prefix of a generated development key) made stricter on
    distinct characters, and raised at start-up instead of printed as a warning.
    """
    from django.core.checks.security.base import (
        SECRET_KEY_INSECURE_PREFIX,
        SECRET_KEY_MIN_LENGTH,
    )

    if value.startswith(SECRET_KEY_INSECURE_PREFIX):
        raise ImproperlyConfigured(
            f"{name} starts with {SECRET_KEY_INSECURE_PREFIX!r}: it is a development key. "
            "Generate one with: python -c 'import secrets; print(secrets.token_urlsafe(50))'"
        )
    if len(value) < SECRET_KEY_MIN_LENGTH:
        raise ImproperlyConfigured(
            f"{name} is {len(value)} characters long; production needs at least "
            f"{SECRET_KEY_MIN_LENGTH}. Generate one with: "
            "python -c 'import secrets; print(secrets.token_urlsafe(50))'"
        )
    if len(set(value)) < SECRET_KEY_MIN_DISTINCT:
        raise ImproperlyConfigured(
            f"{name} uses only {len(set(value))} distinct characters; production needs at least "
            f"{SECRET_KEY_MIN_DISTINCT}. Generate one with: "
            "python -c 'import secrets; print(secrets.token_urlsafe(50))'"
        )
    return value


# The local runtime's ranks run as another user (preemption/runtimes/runner.py) and reach
# their folders under var/runs and var/checkpoints, so they may pass through var/; they
# must not list it, nor read or write anything the control plane keeps there.
VAR_FOLDER_CLOSED_BITS = 0o066
VAR_FOLDER_PASS_BITS = 0o011


def var_folder(path: Path) -> None:
    """Create the control plane's var folder, or mend it: others may pass, not look."""
    path.mkdir(parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.geteuid():
        return
    mode = stat.S_IMODE(info.st_mode)
    wanted = (mode & ~VAR_FOLDER_CLOSED_BITS) | VAR_FOLDER_PASS_BITS
    if wanted != mode:
        path.chmod(wanted)


def private_folder(path: Path) -> None:
    """Create a folder only the control plane may enter (0700), or close an open one."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) & 0o077:
        path.chmod(0o700)


def private_file(path: Path) -> None:
    """Create a file only the control plane may read (0600), or close an open one."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        return
    except FileExistsError:
        pass
    info = path.stat()
    if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) & 0o077:
        path.chmod(stat.S_IMODE(info.st_mode) & ~0o077)
