"""`qm` as a real subprocess against a live server: login, submit, ls, show,
cancel, teams, logs (with --follow over a real rank process) and its errors.

`qm` runs as `python -m qmcli` from this checkout (the installed `qm` script
calls the same `qmcli.cli:main`, see test_cli_standalone.py), so the tests
exercise this tree's client whatever was installed into the virtualenv."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from portal.services import api_token_create
from preemption.models import Attempt, Checkpoint, Job, JobState, PreemptionEvent, Rank
from preemption.reconcile.steps import gang_spec
from preemption.runtime import use_runtime
from preemption.runtimes.base import GangId, GangSpec, NodeInventory, RankPlacement
from preemption.runtimes.local import LocalRuntime
from tests import builders

QM = [sys.executable, "-m", "qmcli"]
ROOT = str(Path(__file__).resolve().parents[2])
PASSWORD = "correct-horse-battery-staple"  # the personas' password in tests/conftest.py
pytestmark = pytest.mark.django_db(transaction=True, serialized_rollback=True)


@pytest.fixture(autouse=True)
def _fast_passwords(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def qm(live_server: Any, tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run `qm` with its own home folder, pointed at the live server."""
    home = tmp_path / "home"
    home.mkdir()

    def run(
        *args: str, stdin: str = "", env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        environment = {
            "PATH": os.environ["PATH"],
            "PYTHONPATH": ROOT,
            "HOME": str(home),
            "QM_URL": live_server.url,
            **(env or {}),
        }
        return subprocess.run(
            [*QM, *args], input=stdin, capture_output=True, text=True, timeout=60, env=environment
        )

    run.home = home  # type: ignore[attr-defined]
    run.url = live_server.url  # type: ignore[attr-defined]
    return run


def test_login_submit_ls_show_cancel_teams(world: Any, qm: Any) -> None:
    login = qm("login", "--username", "researcher", "--password-stdin", stdin=PASSWORD + "\n")
    assert login.returncode == 0, login.stderr
    config = qm.home / ".config" / "quartermaster" / "config.json"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    stored = json.loads(config.read_text())
    assert stored["username"] == "researcher" and stored["token"].startswith("qm_")

    submitted = qm(
        "submit",
        "--team",
        "vision",
        "--flavor",
        "h100-80gb",
        "--ranks",
        "2",
        "--gpus-per-rank",
        "2",
        "--name",
        "resnet",
        "--env",
        "SEED=7",
        "--",
        "python",
        "train.py",
        "--steps",
        "10",
    )
    assert submitted.returncode == 0, submitted.stderr
    job = Job.objects.get(name="resnet")
    assert f"Submitted job {job.pk} to vision" in submitted.stdout
    assert job.submitter.username == "researcher"
    assert job.command == "python train.py --steps 10" and job.env == {"SEED": "7"}
    assert job.ranks == 2 and job.gpus_per_rank == 2

    listed = qm("ls")
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split()[:5] == ["ID", "NAME", "TEAM", "USER", "STATE"]
    assert rows[0].split()[:5] == [str(job.pk), "resnet", "vision", "researcher", "pending"]
    as_json = json.loads(qm("ls", "--json", "--state", "pending").stdout)
    assert [row["id"] for row in as_json] == [job.pk]
    assert json.loads(qm("ls", "--json", "--state", "running").stdout) == []

    shown = qm("show", str(job.pk))
    assert shown.returncode == 0, shown.stderr
    assert "python train.py --steps 10" in shown.stdout
    assert "2 ranks × 2 GPUs = 4 GPUs (h100-80gb)" in shown.stdout
    assert json.loads(qm("show", str(job.pk), "--json").stdout)["state"] == "pending"
    # Where only minimum runtimes keep it out, qm says until when, in the page's words.
    until = timezone.now() + timedelta(minutes=20)
    Job.objects.filter(pk=job.pk).update(
        waiting_reason="no node of flavor h100-80gb has 4 free GPUs", protected_until=until
    )
    shown = qm("show", str(job.pk))
    assert (
        f"until {until.astimezone(UTC):%H:%M} UTC: the only jobs it could preempt are "
        "protected by their minimum runtime until then"
    ) in " ".join(shown.stdout.split())

    teams = qm("teams")
    assert teams.returncode == 0, teams.stderr
    assert "vision" in teams.stdout and "h100-80gb 8" in teams.stdout
    assert "ops" not in teams.stdout  # another tree: not the researcher's to see

    cancelled = qm("cancel", str(job.pk))
    assert cancelled.returncode == 0, cancelled.stderr
    assert f"Cancelled job {job.pk}." in cancelled.stdout
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED


def test_errors_are_one_clear_line_with_an_exit_code(world: Any, qm: Any) -> None:
    _, token = api_token_create(user=world.users["researcher"], name="ci")
    with_token = {"QM_TOKEN": token}

    not_signed_in = qm("ls")
    assert not_signed_in.returncode == 3
    assert "not signed in" in not_signed_in.stderr and "qm login" in not_signed_in.stderr

    wrong_password = qm("login", "--username", "researcher", "--password-stdin", stdin="guess\n")
    assert wrong_password.returncode == 3
    assert "Wrong username or password" in wrong_password.stderr

    missing = qm("show", "999999", env=with_token)
    assert missing.returncode == 4 and "not found" in missing.stderr

    other_job = builders.job(
        world,
        world.ops,
        state=JobState.PENDING,
        submitter=world.users["other_researcher"],
        command="true",
    )
    hidden = qm("cancel", str(other_job.pk), env=with_token)
    assert hidden.returncode == 4  # another team's job does not even exist for this user

    forbidden = qm("submit", "--team", "ops", "--flavor", "h100-80gb", "--", "true", env=with_token)
    assert forbidden.returncode == 3 and "not allowed" in forbidden.stderr

    too_big = qm(
        "submit",
        "--team",
        "vision",
        "--flavor",
        "h100-80gb",
        "--gpus-per-rank",
        "16",
        "--",
        "true",
        env=with_token,
    )
    assert too_big.returncode == 1
    assert too_big.stderr.strip() == (
        "qm: gpus_per_rank: Each rank needs 16 GPUs; the largest h100-80gb node has 8."
    )

    # A class the team may not use: the API's reason, naming the classes it may.
    world.vision.priority_classes.set([world.batch])
    critical = qm(
        "submit",
        "--team",
        "vision",
        "--flavor",
        "h100-80gb",
        "--priority-class",
        "ai-prod-critical",
        "--",
        "true",
        env=with_token,
    )
    assert critical.returncode == 1
    assert critical.stderr.strip() == (
        "qm: priority_class: Team vision may not use ai-prod-critical; "
        "it may use: ai-batch-preemptible."
    )

    bad_usage = qm("show", "twelve", env=with_token)
    assert bad_usage.returncode == 2

    unreachable = qm("ls", env={**with_token, "QM_URL": "http://127.0.0.1:9"})
    assert unreachable.returncode == 5 and "cannot reach" in unreachable.stderr
    assert Job.objects.count() == 1  # none of the refused calls created anything


@pytest.fixture
def local_runtime(tmp_path: Path) -> Iterator[LocalRuntime]:
    runtime = LocalRuntime(tmp_path / "runs", [NodeInventory("h100-node-0", "h100-80gb", 8)])
    use_runtime(runtime)
    yield runtime
    use_runtime(None)
    for observation in runtime.observe():
        runtime.kill(GangId(observation.job_id, observation.attempt))


def _all_exited(runtime: LocalRuntime, gang: GangId, *, ranks: int) -> bool:
    observations = runtime.observe(gang)
    return len(observations) == ranks and all(o.phase == "exited" for o in observations)


def test_logs_prints_and_follows_a_real_rank(
    world: Any, qm: Any, local_runtime: LocalRuntime
) -> None:
    now = timezone.now()
    job = builders.running_job(world, world.vision, ranks=2, command="echo", admitted_at=now)
    attempt = job.attempts.get()
    command = 'echo "rank $RANK step 1"; sleep 2; echo "rank $RANK step 2"'
    local_runtime.launch(
        GangSpec(
            job_id=job.pk,
            attempt=1,
            command=command,
            ranks=(RankPlacement(0, "h100-node-0", 0), RankPlacement(1, "h100-node-0", 1)),
            gpus_per_rank=1,
            grace_seconds=5.0,
            priority_class="ai-batch-preemptible",
            env={},
        )
    )
    _, token = api_token_create(user=world.users["researcher"], name="ci")
    following = subprocess.Popen(
        [*QM, "logs", str(job.pk), "--rank", "1", "--follow"],
        env={
            "PATH": os.environ["PATH"],
            "PYTHONPATH": ROOT,
            "HOME": str(qm.home),
            "QM_URL": qm.url,
            "QM_TOKEN": token,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not _all_exited(local_runtime, GangId(job.pk, 1), ranks=2):
        assert time.monotonic() < deadline, "the ranks did not exit"
        time.sleep(0.1)
    # Until the attempt ends, --follow keeps polling; ending it lets the follower finish.
    assert following.poll() is None
    Attempt.objects.filter(pk=attempt.pk).update(ended_at=timezone.now(), end_reason="succeeded")
    out, err = following.communicate(timeout=30)
    assert following.returncode == 0, err
    assert out == "rank 1 step 1\nrank 1 step 2\n"

    whole = qm("logs", str(job.pk), env={"QM_TOKEN": token})
    assert whole.returncode == 0 and whole.stdout == "rank 0 step 1\nrank 0 step 2\n"
    tail = qm("logs", str(job.pk), "--rank", "1", "--tail", "14", env={"QM_TOKEN": token})
    assert tail.stdout == "rank 1 step 2\n"
    chunks = [
        json.loads(line)
        for line in qm("logs", str(job.pk), "--json", env={"QM_TOKEN": token}).stdout.splitlines()
    ]
    assert chunks[0]["attempt"] == 1 and chunks[0]["finished"] is True
    assert chunks[-1]["text"] == "" and chunks[-1]["next_offset"] == len(
        b"rank 0 step 1\nrank 0 step 2\n"
    )
    no_rank = qm("logs", str(job.pk), "--rank", "5", env={"QM_TOKEN": token})
    assert no_rank.returncode == 4 and "ranks 0 to 1" in no_rank.stderr


def _wait_for_exit(runtime: LocalRuntime, gang: GangId, *, ranks: int) -> list[Any]:
    deadline = time.monotonic() + 30
    while not _all_exited(runtime, gang, ranks=ranks):
        assert time.monotonic() < deadline, "the ranks did not exit"
        time.sleep(0.1)
    return sorted(runtime.observe(gang), key=lambda o: o.rank)


def test_submit_keeps_the_commands_words_up_to_the_rank(
    world: Any, qm: Any, local_runtime: LocalRuntime
) -> None:
    """The words after `--` reach the rank's process exactly: quotes, pipes and `$`
    are the user's words, not instructions to the shell that starts the rank."""
    words = [
        'say "hello" | tr a-z A-Z > never.txt',
        "$HOME ${PATH} $(echo nope) `date`",
        "it's; exit 3 && echo \\n",
        "",
    ]
    argv = [
        sys.executable,
        "-c",
        "import json, sys; print('ARGV ' + json.dumps(sys.argv[1:]))",
        *words,
    ]
    _, token = api_token_create(user=world.users["researcher"], name="ci")
    submitted = qm(
        "submit",
        "--team",
        "vision",
        "--flavor",
        "h100-80gb",
        "--name",
        "quoting",
        "--",
        *argv,
        env={"QM_TOKEN": token},
    )
    assert submitted.returncode == 0, submitted.stderr
    job = Job.objects.select_related("priority_class", "team", "flavor").get(name="quoting")
    assert shlex.split(job.command) == argv

    # Launch it the way the reconciler does: the spec built from the stored job.
    attempt = Attempt.objects.create(
        job=job,
        number=1,
        placement=[{"node": "h100-node-0", "ranks": 1}],
        admitted_at=timezone.now(),
    )
    rank = Rank.objects.create(attempt=attempt, index=0, node="h100-node-0")
    local_runtime.launch(gang_spec(job, attempt, [rank]))
    (observation,) = _wait_for_exit(local_runtime, GangId(job.pk, 1), ranks=1)
    assert observation.exit_code == 0

    logged = qm("logs", str(job.pk), env={"QM_TOKEN": token})
    assert logged.returncode == 0, logged.stderr
    (line,) = [line for line in logged.stdout.splitlines() if line.startswith("ARGV ")]
    assert json.loads(line.removeprefix("ARGV ")) == words


def test_ls_into_a_pipe_that_closes_early_ends_quietly(world: Any, qm: Any) -> None:
    """`qm ls | head`: once head has its lines, qm stops without a traceback."""
    Job.objects.bulk_create(
        Job(
            team=world.vision,
            submitter=world.users["researcher"],
            priority_class=world.batch,
            flavor=world.h100,
            ranks=1,
            gpus_per_rank=1,
            command="true",
            # Long names make the listing far larger than a pipe holds (64 KiB), so
            # qm is still writing when head exits.
            name=f"job-{number:04d}-" + "x" * 100,
        )
        for number in range(1200)
    )
    _, token = api_token_create(user=world.users["researcher"], name="ci")
    pipeline = (
        shlex.join([*QM, "ls", "--limit", "1200"])
        + ' | head -n 3; echo "qm exited ${PIPESTATUS[0]}" >&2'
    )
    finished = subprocess.run(
        ["bash", "-c", pipeline],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "PATH": os.environ["PATH"],
            "PYTHONPATH": ROOT,
            "HOME": str(qm.home),
            "QM_URL": qm.url,
            "QM_TOKEN": token,
        },
    )
    assert finished.returncode == 0
    assert finished.stderr == "qm exited 141\n"  # no traceback, no "Exception ignored"
    header, *rows = finished.stdout.splitlines()
    assert header.split()[:2] == ["ID", "NAME"] and len(rows) == 2


def test_show_says_why_a_job_was_preempted_and_how_its_failing_rank_ended(
    world: Any, qm: Any, local_runtime: LocalRuntime
) -> None:
    now = timezone.now()
    job = Job.objects.create(
        team=world.vision,
        submitter=world.users["researcher"],
        priority_class=world.batch,
        flavor=world.h100,
        ranks=2,
        gpus_per_rank=1,
        command="train",
        name="unlucky",
        state=JobState.FAILED,
        failure_reason="Rank 1 exited with code 3.",
        finished_at=now,
    )
    first = Attempt.objects.create(
        job=job,
        number=1,
        placement=[{"node": "h100-node-0", "ranks": 2}],
        admitted_at=now - timedelta(minutes=10),
        ended_at=now - timedelta(minutes=5),
        end_reason=Attempt.EndReason.PREEMPTED,
    )
    PreemptionEvent.objects.create(
        victim_attempt=first,
        job=job,
        cause="Reclaimed by serving, 8 GPUs under its guarantee.",
        reason=PreemptionEvent.Reason.RECLAIM,
        decided_at=now - timedelta(minutes=6),
        grace_seconds=30.0,
        deadline=now - timedelta(minutes=6) + timedelta(seconds=30),
        checkpoint_step=45,
        outcome=PreemptionEvent.Outcome.GRACEFUL,
    )
    second = Attempt.objects.create(
        job=job, number=2, placement=[{"node": "h100-node-0", "ranks": 2}], admitted_at=now
    )
    ranks = [Rank.objects.create(attempt=second, index=i, node="h100-node-0") for i in (0, 1)]
    # Rank 1 prints 30 numbered lines and fails; rank 0 ends cleanly a moment later.
    command = (
        'if [ "$RANK" = 1 ]; then for i in $(seq 1 30); do echo "rank 1 line $i"; done; exit 3; '
        'else sleep 0.5; echo "rank 0 done"; fi'
    )
    local_runtime.launch(
        GangSpec(
            job_id=job.pk,
            attempt=2,
            command=command,
            ranks=(RankPlacement(0, "h100-node-0", 0), RankPlacement(1, "h100-node-0", 1)),
            gpus_per_rank=1,
            grace_seconds=5.0,
            priority_class="ai-batch-preemptible",
            env={},
        )
    )
    for observation in _wait_for_exit(local_runtime, GangId(job.pk, 2), ranks=2):
        rank = ranks[observation.rank]
        rank.exit_code, rank.state = observation.exit_code, Rank.State.EXITED
        rank.exited_at = datetime.fromtimestamp(observation.exited_at or time.time(), tz=UTC)
        rank.save(update_fields=["exit_code", "state", "exited_at"])
    Attempt.objects.filter(pk=second.pk).update(ended_at=timezone.now(), end_reason="failed")
    _, token = api_token_create(user=world.users["researcher"], name="ci")

    shown = qm("show", str(job.pk), env={"QM_TOKEN": token})
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert (
        "Preempted: Reclaimed by serving, 8 GPUs under its guarantee. (decided "
        in out.split("Attempt 1:")[1].split("Attempt 2:")[0]
    )
    assert "grace 30 s, checkpoint at step 45, outcome graceful)" in out
    tail = out.split("Last lines of rank 1 (attempt 2, exit 3):\n")[1]
    assert tail.splitlines() == [f"  rank 1 line {i}" for i in range(11, 31)]

    as_json = json.loads(qm("show", str(job.pk), "--json", env={"QM_TOKEN": token}).stdout)
    assert [e["checkpoint_step"] for e in as_json["preemptions"]] == [45]

    # Another team's researcher learns nothing about the job, its preemption or its log.
    _, other = api_token_create(user=world.users["other_researcher"], name="ci")
    hidden = qm("show", str(job.pk), env={"QM_TOKEN": other})
    assert hidden.returncode == 4 and "rank 1 line" not in hidden.stdout + hidden.stderr


def test_submit_asks_for_retries_within_bounds(world: Any, qm: Any) -> None:
    _, token = api_token_create(user=world.users["researcher"], name="ci")
    common = ["submit", "--team", "vision", "--flavor", "h100-80gb"]
    asked = qm(
        *common, "--name", "retried", "--retries", "2", "--", "true", env={"QM_TOKEN": token}
    )
    assert asked.returncode == 0, asked.stderr
    assert Job.objects.get(name="retried").retries == 2
    plain = qm(*common, "--name", "plain", "--", "true", env={"QM_TOKEN": token})
    assert plain.returncode == 0 and Job.objects.get(name="plain").retries == 0

    too_many = qm(
        *common, "--name", "many", "--retries", "21", "--", "true", env={"QM_TOKEN": token}
    )
    assert too_many.returncode == 1
    assert too_many.stderr.strip() == "qm: retries: Must be a whole number from 0 to 20 (got 21)."
    assert not Job.objects.filter(name="many").exists()


def test_submit_sweep_queues_one_job_per_combination_or_none(world: Any, qm: Any) -> None:
    _, token = api_token_create(user=world.users["researcher"], name="ci")
    common = ["submit", "--team", "vision", "--flavor", "h100-80gb", "--env", "SEED=1"]
    swept = qm(
        *common,
        "--name",
        "lr",
        "--sweep",
        "LR=0.1,0.2",
        "--sweep",
        "WD=0,0.01",
        "--",
        "python",
        "train.py",
        env={"QM_TOKEN": token},
    )
    assert swept.returncode == 0, swept.stderr
    jobs = list(Job.objects.order_by("pk"))
    assert [(job.name, job.env) for job in jobs] == [
        ("lr[LR=0.1,WD=0]", {"SEED": "1", "LR": "0.1", "WD": "0"}),
        ("lr[LR=0.1,WD=0.01]", {"SEED": "1", "LR": "0.1", "WD": "0.01"}),
        ("lr[LR=0.2,WD=0]", {"SEED": "1", "LR": "0.2", "WD": "0"}),
        ("lr[LR=0.2,WD=0.01]", {"SEED": "1", "LR": "0.2", "WD": "0.01"}),
    ]
    assert {job.command for job in jobs} == {"python train.py"}
    assert swept.stdout.splitlines()[0] == (
        "Submitted 4 jobs to vision (1 GPUs of h100-80gb each, ai-batch-preemptible):"
    )
    assert [line.split()[0] for line in swept.stdout.splitlines()[1:]] == [
        str(job.pk) for job in jobs
    ]

    # A sweep the server refuses queues nothing and says why in one line.
    too_big = qm(
        *common,
        "--gpus-per-rank",
        "9",
        "--sweep",
        "LR=0.1,0.2",
        "--",
        "true",
        env={"QM_TOKEN": token},
    )
    assert too_big.returncode == 1
    assert too_big.stderr.strip() == (
        "qm: jobs: 0: gpus_per_rank: Each rank needs 9 GPUs; the largest h100-80gb node "
        "has 8.; 1: gpus_per_rank: Each rank needs 9 GPUs; the largest h100-80gb node has 8."
    )
    elsewhere = qm(
        "submit",
        "--team",
        "ops",
        "--flavor",
        "h100-80gb",
        "--sweep",
        "LR=1,2",
        "--",
        "true",
        env={"QM_TOKEN": token},
    )
    assert elsewhere.returncode != 0
    assert elsewhere.stderr.strip() == "qm: not allowed: You may not submit jobs to team ops."
    for bad in ("LR", "LR=", "LR=1,,2", "=1"):
        usage = qm(*common, "--sweep", bad, "--", "true", env={"QM_TOKEN": token})
        assert usage.returncode == 2 and "--sweep takes NAME=VALUE" in usage.stderr, bad
    huge = qm(
        *common,
        *[f"--sweep=X{i}=" + ",".join(map(str, range(10))) for i in range(3)],
        "--",
        "true",
        env={"QM_TOKEN": token},
    )
    assert huge.returncode == 2 and "makes 1,000 jobs" in huge.stderr
    assert Job.objects.count() == 4


def _shown_fields(output: str) -> dict[str, str]:
    """`qm show`'s "Name  value" lines up to the first blank line, by name."""
    fields = {}
    for line in output.split("\n\n")[0].splitlines():
        name, _, value = line.partition("  ")
        fields[name] = value.strip()
    return fields


def test_show_counts_ranks_and_gpus_and_a_final_job_resumes_nowhere(world: Any, qm: Any) -> None:
    now = timezone.now()

    def job_at_step(name: str, state: str, ranks: int, gpus_per_rank: int) -> Job:
        job = Job.objects.create(
            team=world.vision,
            submitter=world.users["researcher"],
            priority_class=world.batch,
            flavor=world.h100,
            ranks=ranks,
            gpus_per_rank=gpus_per_rank,
            command="python train.py",
            name=name,
            state=state,
            resume_step=658,
            finished_at=now if state == JobState.CANCELLED else None,
        )
        attempt = Attempt.objects.create(
            job=job,
            number=1,
            placement=[{"node": "h100-node-0", "ranks": ranks}],
            admitted_at=now - timedelta(minutes=5),
            ended_at=now,
            end_reason=Attempt.EndReason.CANCELLED
            if state == JobState.CANCELLED
            else Attempt.EndReason.PREEMPTED,
        )
        Checkpoint.objects.create(
            job=job, attempt=attempt, step=657, path=f"/ckpt/{name}/step_657", committed_at=now
        )
        return job

    cancelled = job_at_step("given-up", JobState.CANCELLED, ranks=1, gpus_per_rank=1)
    requeued = job_at_step("waiting", JobState.REQUEUED, ranks=2, gpus_per_rank=4)
    _, token = api_token_create(user=world.users["researcher"], name="ci")

    shown = qm("show", str(cancelled.pk), env={"QM_TOKEN": token})
    assert shown.returncode == 0, shown.stderr
    fields = _shown_fields(shown.stdout)
    assert fields["GPUs"] == "1 rank × 1 GPU (h100-80gb)"
    assert fields["Last checkpoint"] == "step 657"
    assert "Resumes at step" not in fields and "Resumes" not in shown.stdout

    shown = qm("show", str(requeued.pk), env={"QM_TOKEN": token})
    assert shown.returncode == 0, shown.stderr
    fields = _shown_fields(shown.stdout)
    assert fields["GPUs"] == "2 ranks × 4 GPUs = 8 GPUs (h100-80gb)"
    assert fields["Resumes at step"] == "658"
    assert "Last checkpoint" not in fields


def test_show_prints_the_command_as_it_was_typed(world: Any, qm: Any) -> None:
    """`qm submit -- python -c "print('hi')"` stores the words shell-quoted for
    `sh -c` (a single quote becomes '"'"'); `qm show` prints them as typed."""
    _, token = api_token_create(user=world.users["researcher"], name="ci")
    typed = "python -c \"print('hi')\" --out 'a b' --lr 0.1"
    submitted = qm(
        *("submit", "--team", "vision", "--flavor", "h100-80gb", "--name", "typed", "--"),
        *shlex.split(typed),
        env={"QM_TOKEN": token},
    )
    assert submitted.returncode == 0, submitted.stderr
    job = Job.objects.get(name="typed")
    assert shlex.split(job.command) == shlex.split(typed)

    shown = qm("show", str(job.pk), env={"QM_TOKEN": token})
    assert shown.returncode == 0, shown.stderr
    assert _shown_fields(shown.stdout)["Command"] == typed


def test_submit_an_elastic_range_and_show_the_size_it_runs_at(world: Any, qm: Any) -> None:
    _, token = api_token_create(user=world.users["researcher"], name="ci")
    env = {"QM_TOKEN": token}
    common = ["submit", "--team", "vision", "--flavor", "h100-80gb"]
    ranged = qm(*common, "--ranks", "2:8", "--name", "ranged", "--", "true", env=env)
    assert ranged.returncode == 0, ranged.stderr
    sized = qm(*common, "--ranks", "2,4,8", "--name", "sized", "--", "true", env=env)
    assert sized.returncode == 0, sized.stderr
    assert sorted(Job.objects.values_list("name", "ranks", "ranks_min", "rank_sizes")) == [
        ("ranged", 8, 2, []),
        ("sized", 8, 2, [2, 4, 8]),
    ]

    refused = qm(*common, "--ranks", "9:8", "--name", "upside-down", "--", "true", env=env)
    assert refused.returncode == 1
    assert refused.stderr.strip() == "qm: ranks: min (9) must not be more than max (8)."
    malformed = qm(*common, "--ranks", "2-8", "--name", "dashed", "--", "true", env=env)
    assert malformed.returncode == 2
    assert "takes N, MIN:MAX or SIZE,SIZE,... (got '2-8')" in malformed.stderr
    assert not Job.objects.filter(name__in=["upside-down", "dashed"]).exists()

    job = Job.objects.get(name="ranged")
    Job.objects.filter(pk=job.pk).update(state=JobState.RUNNING)
    builders.attempt(job, ranks=4)
    shown = qm("show", str(job.pk), env=env)
    assert shown.returncode == 0, shown.stderr
    assert _shown_fields(shown.stdout)["GPUs"] == (
        "4 ranks (elastic 2–8) × 1 GPU = 4 GPUs (h100-80gb)"
    )
    listed = qm("ls", env=env)
    assert any(row.split()[5] == "2:8x1" for row in listed.stdout.splitlines()[1:]), listed.stdout
