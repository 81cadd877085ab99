"""The ``QM_*`` environment a trap reads: a variable's value, or None when it is unset
or blank, as text, seconds, an integer or a job id; a value that does not parse is
refused with its name. Reads the environment, nothing else.
"""

from __future__ import annotations

import os


def env(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def env_float(name: str) -> float | None:
    value = env(name)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number of seconds") from None


def env_int(name: str) -> int | None:
    value = env(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def job_id_from_env() -> int | str | None:
    value = env("QM_JOB_ID")
    if value is None:
        return None
    return int(value) if value.isdigit() else value
