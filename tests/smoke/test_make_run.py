"""`make run` as a new user meets it: the README's first command, on its defaults
(SQLite, the broker on disk, the local runtime, the seeded demo cluster with its
training jobs), then every demo persona signs in and clicks through every page they
can reach, and Ctrl-C stops it all.

`make test` runs this module last, in a pytest of its own, so the suite ends on what a
user sees first. Only the folder for the embedded default's files is fresh (QM_VAR_DIR),
so that a developer's own `var/` is left alone, and the port moves off 8000 only when
something else already listens there.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests

from tools.portal_crawl import crawl

ROOT = Path(__file__).resolve().parents[2]
# seed_demo prints each persona as "  <user> / <password> <role>".
PERSONA_LINE = re.compile(r"^\s+(\w+)\s+/\s+(\S+)\s+(platform admin|\w+ of [\w-]+)\s*$")
STARTED = "Quartermaster is running at"
# The first start installs nothing here (make test has just set the venv up) but
# compiles nothing either way: migrations, the demo's seed, collectstatic, three processes.
START_SECONDS = 300


@dataclass
class Portal:
    process: subprocess.Popen[bytes]
    base_url: str
    var_dir: Path
    log: Path
    personas: list[tuple[str, str, str]]

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def _port() -> int:
    if _free(8000):
        return 8000
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _user_environment(var_dir: Path, port: int) -> dict[str, str]:
    """This machine's environment as a user's shell has it: none of the test
    run's own settings (its PostgreSQL, Redis, engine or var folder)."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("QM_", "DJANGO_", "CELERY_", "PYTEST_"))
        and name not in {"DATABASE_URL", "MAKEFLAGS", "MAKELEVEL", "MFLAGS"}
    }
    env["QM_VAR_DIR"] = str(var_dir)
    if port != 8000:
        env["RUN_BIND"] = f"127.0.0.1:{port}"
        env["QM_PUBLIC_URL"] = f"http://127.0.0.1:{port}"
    return env


@pytest.fixture(scope="module")
def portal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Portal]:
    # Kept after the run (make test's var/test/smoke), for its log and the ranks' logs.
    var = os.environ.get("QM_VAR_DIR")
    folder = Path(var) / "make-run" if var else tmp_path_factory.mktemp("make-run")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    var_dir = folder / "var"
    log = folder / "make-run.log"
    port = _port()
    with log.open("wb") as output:
        process = subprocess.Popen(
            ["make", "--no-print-directory", "run"],
            cwd=ROOT,
            env=_user_environment(var_dir, port),
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base_url = f"http://127.0.0.1:{port}"
    running = Portal(process, base_url, var_dir, log, [])
    try:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline and process.poll() is None:
            if STARTED in running.output():
                try:
                    if requests.get(f"{base_url}/login/", timeout=30).status_code == 200:
                        break
                except requests.RequestException:
                    pass  # not listening yet, or its first answer still on the way
            time.sleep(0.5)
        else:
            pytest.fail(f"make run did not serve {base_url}:\n{running.output()[-4000:]}")
        running.personas = [
            match.groups()
            for line in running.output().splitlines()
            if (match := PERSONA_LINE.match(line))
        ]
        yield running
    finally:
        # After a failure too: web, worker and beat run in sessions of their own, out of
        # make's process group, so nothing of this portal may be left to a later run.
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for pid in _processes_of(var_dir):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


def test_the_demo_is_seeded_and_its_personas_printed(portal: Portal) -> None:
    roles = {role for _, _, role in portal.personas}
    assert len(portal.personas) == 6, portal.output()[-3000:]
    assert "platform admin" in roles
    assert any(role.startswith("manager of") for role in roles)
    assert any(role.startswith("researcher of") for role in roles)


def test_every_persona_clicks_through_every_page_without_a_server_error(portal: Portal) -> None:
    failures: list[str] = []
    for username, password, _ in portal.personas:
        result = crawl(portal.base_url, username, password)
        print(f"{username}: {len(result.pages)} pages in {result.seconds:.1f} s")
        failures += [f"{username}: {failure}" for failure in result.failures]
        # Every persona reaches the jobs table and its export, which the nav links to.
        assert result.pages.get("/jobs/") == 200, (username, sorted(result.pages)[:40])
        assert any(path.startswith("/jobs/?") and "format=csv" in path for path in result.pages)
        assert len(result.pages) > 10
    assert not failures, "\n".join(failures) + "\n" + portal.output()[-3000:]


def test_the_api_schema_and_docs_answer(portal: Portal) -> None:
    for path in ("/api/schema/", "/api/docs/", "/api/v1/"):
        assert requests.get(portal.base_url + path, timeout=30).status_code < 500, path


def test_ctrl_c_stops_the_portal_and_every_rank_of_the_demo(portal: Portal) -> None:
    runs = portal.var_dir / "runs"
    assert runs.is_dir() and any(runs.iterdir()), "the demo launched no job"
    os.killpg(portal.process.pid, signal.SIGINT)  # Ctrl-C in the terminal
    code = portal.process.wait(timeout=90)
    # make passes Ctrl-C on by dying of it once its recipe has stopped.
    assert code in (0, 2, -signal.SIGINT), portal.output()[-3000:]
    # The ranks have their whole grace (15 s) to checkpoint; none may outlive it by much.
    deadline = time.monotonic() + 40
    while (left := _processes_of(portal.var_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left
    assert re.search(r"Stopped \d+ rank processes", portal.output()), portal.output()[-2000:]


def _processes_of(var_dir: Path) -> dict[int, str]:
    """The processes of the portal that keeps its files in `var_dir`: web, worker and
    beat (their environment names the folder) and the ranks of its jobs (they work
    in folders under it), each by pid with its command line."""
    found = {}
    for process in psutil.process_iter(["pid", "cwd", "cmdline"]):
        cwd = process.info["cwd"] or ""
        cmdline = " ".join(process.info["cmdline"] or [])
        try:
            named = process.environ().get("QM_VAR_DIR") == str(var_dir)
        except psutil.Error:
            named = False
        if named or cwd.startswith(str(var_dir)) or str(var_dir) in cmdline:
            found[process.info["pid"]] = cmdline
    return found
