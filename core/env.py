"""Strict readers for settings that come from the environment.

Each reader raises ImproperlyConfigured naming the variable, so a typo in a
deployment fails at start-up instead of somewhere later.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


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
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(Path(path)),
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
    """Read the embedded default's secret key, generating it on first use."""
    from django.core.management.utils import get_random_secret_key

    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = get_random_secret_key()
    # Create exclusively so two processes starting at once keep one key.
    try:
        with open(path, "x") as handle:
            handle.write(secret)
        path.chmod(0o600)
    except FileExistsError:
        return path.read_text().strip()
    return secret
