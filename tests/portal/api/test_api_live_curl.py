"""The README's curl example, run as written against a live server: a seeded
demo user gets a token over HTTP, then lists and submits jobs with curl."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command

from preemption.models import Job

README = Path(settings.BASE_DIR) / "README.md"
CURL = shutil.which("curl") or "/usr/bin/curl"


def readme_curl_example() -> str:
    """The shell block of the README's REST API section that calls curl."""
    text = README.read_text()
    section = text[text.index("## The REST API") :]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, "the README's REST API section has no sh block"
    assert "curl" in block.group(1)
    return block.group(1)


def curl(*args: str) -> Any:
    done = subprocess.run(
        [CURL, "--silent", "--show-error", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.django_db(transaction=True, serialized_rollback=True)
def test_readme_curl_example_lists_and_submits_jobs_with_a_token(
    live_server: Any, settings: Any
) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    call_command("seed_demo", stdout=io.StringIO())
    url = live_server.url

    created = curl(
        "-H",
        "Content-Type: application/json",
        "-d",
        json.dumps({"username": "ravi", "password": "researcher-demo-pass", "name": "curl"}),
        f"{url}/api/v1/tokens/login/",
    )
    token = created["token"]
    assert token.startswith("qm_")

    listed = curl("-H", f"Authorization: Bearer {token}", f"{url}/api/v1/jobs/")
    vision_jobs = set(Job.objects.filter(team__slug="vision").values_list("id", flat=True))
    assert vision_jobs, "the demo has jobs in vision"
    # ravi, a researcher of vision, sees vision's demo jobs and nothing of other teams.
    assert {job["id"] for job in listed["results"]} == vision_jobs

    # The README's block itself, pointed at this server, with the token in QM_TOKEN.
    script = (
        readme_curl_example()
        .replace("http://127.0.0.1:8000", url)
        .replace("curl ", f"{CURL} --silent ")
    )
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={"QM_TOKEN": token, "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    decoder = json.JSONDecoder()
    first, end = decoder.raw_decode(done.stdout)
    second, _ = decoder.raw_decode(done.stdout[end:].lstrip())
    assert {job["id"] for job in first["results"]} == vision_jobs
    assert (
        second["team"] == "vision"
        and second["submitter"] == "ravi"
        and second["state"] == "pending"
    )
    assert Job.objects.filter(
        pk=second["id"], submitter__username="ravi", ranks=2, gpus_per_rank=4
    ).exists()

    # A revoked token stops working at once.
    revoke = subprocess.run(
        [
            CURL,
            "--silent",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-X",
            "DELETE",
            "-H",
            f"Authorization: Bearer {token}",
            f"{url}/api/v1/tokens/{created['id']}/",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert revoke.stdout == "204"
    refused = subprocess.run(
        [
            CURL,
            "--silent",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-H",
            f"Authorization: Bearer {token}",
            f"{url}/api/v1/jobs/",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.stdout == "401"
