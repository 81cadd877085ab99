"""`qm`, Quartermaster's command-line client over the REST API.

    qm login                      ask for the server, user and password; store a token
    qm submit --team T --flavor F --ranks N --gpus-per-rank G -- python train.py
    qm ls [--team T] [--state S] [--mine]
    qm show JOB
    qm cancel JOB
    qm teams
    qm logs JOB [--rank N] [--attempt A] [--follow]
    qm completion bash|zsh        print a shell completion script

The server comes from QM_URL, else from `qm login`'s config; the token from
QM_TOKEN, else from the config (~/.config/quartermaster/config.json, mode 600).
Every command takes --json for scripts. Exit codes: 0 done, 1 the server
refused (bad input, conflict), 2 wrong usage, 3 not signed in or not allowed,
4 no such object, 5 the server could not be reached, 141 the reader of qm's
output went away (`qm ls | head`), which ends qm quietly as it ends any Unix tool.
"""

from __future__ import annotations

import argparse
import getpass
import itertools
import json
import math
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import requests

from qmcli.completion import SHELLS, completion_script
from qmcli.words import (
    failing_rank,
    gpus_words,
    preemption_line,
    resize_line,
    short_time,
)

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_AUTH = 3
EXIT_NOT_FOUND = 4
EXIT_UNREACHABLE = 5
# What a shell reports for a tool stopped by SIGPIPE (128 + 13).
EXIT_CLOSED_PIPE = 141

# The states a job ends in: it runs no more and resumes nowhere.
FINAL_STATES = ("succeeded", "failed", "cancelled")

DEFAULT_URL = "http://127.0.0.1:8000"
TIMEOUT_SECONDS = 30.0
FOLLOW_POLL_SECONDS = 1.0
# How much of a failed rank's log `qm show` reads, and how many of its lines it prints.
FAILED_LOG_TAIL_BYTES = 8192
FAILED_LOG_LINES = 20


class CliError(Exception):
    """A failure to report in one line, with the exit code it maps to."""

    def __init__(self, message: str, code: int = EXIT_REFUSED) -> None:
        super().__init__(message)
        self.code = code


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "quartermaster" / "config.json"


def load_config() -> dict[str, Any]:
    path = config_path()
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        raise CliError(f"cannot read {path}: {error}; run `qm login` again", EXIT_USAGE) from error
    return loaded if isinstance(loaded, dict) else {}


def save_config(values: dict[str, Any]) -> Path:
    """Write the config so that only its owner can read it: it holds a token."""
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    temporary = path.with_name(path.name + ".tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump(values, handle, indent=2)
        handle.write("\n")
    os.chmod(temporary, 0o600)
    os.replace(temporary, path)
    return path


def describe_error(body: Any) -> str:
    """The API's `{field: [reasons]}` (or `{"detail": ...}`) as one readable line."""
    if isinstance(body, dict):
        if set(body) == {"detail"}:
            return str(body["detail"])
        parts = []
        for field, reasons in body.items():
            text = (
                "; ".join(describe_error(r) for r in reasons)
                if isinstance(reasons, list)
                else describe_error(reasons)
            )
            parts.append(text if field in ("non_field_errors", "detail") else f"{field}: {text}")
        return "; ".join(parts)
    if isinstance(body, list):
        return "; ".join(describe_error(item) for item in body)
    return str(body)


class Client:
    """The REST API, with the server and token resolved once."""

    def __init__(self, url: str, token: str | None) -> None:
        self.url = url.rstrip("/")
        self.token = token
        # requests (and urllib3 under it) takes most of qm's start-up time, so it
        # loads only when a command talks to the server: `--help` and
        # `completion` answer without it.
        import requests

        self._requests = requests
        self.session: requests.Session = requests.Session()
        self.session.headers["User-Agent"] = "qm"
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"

    @classmethod
    def from_environment(cls, *, need_token: bool = True) -> Client:
        config = load_config()
        url = os.environ.get("QM_URL") or config.get("url") or DEFAULT_URL
        token = os.environ.get("QM_TOKEN") or config.get("token")
        if need_token and not token:
            raise CliError("not signed in: run `qm login` or set QM_TOKEN", EXIT_AUTH)
        return cls(url, token)

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        address = f"{self.url}/api/v1/{path.lstrip('/')}"
        try:
            response = self.session.request(method, address, timeout=TIMEOUT_SECONDS, **kwargs)
        except self._requests.RequestException as error:
            raise CliError(
                f"cannot reach {self.url}: {error.__class__.__name__}", EXIT_UNREACHABLE
            ) from error
        if response.status_code == 204:
            return None
        try:
            body = response.json()
        except ValueError:
            body = {"detail": response.text.strip()[:300] or response.reason}
        if response.status_code >= 400:
            message = describe_error(body)
            if response.status_code == 401:
                raise CliError(
                    f"not signed in ({message}): run `qm login` or set QM_TOKEN", EXIT_AUTH
                )
            if response.status_code == 403:
                raise CliError(f"not allowed: {message}", EXIT_AUTH)
            if response.status_code == 404:
                raise CliError(f"not found: {message}", EXIT_NOT_FOUND)
            if response.status_code >= 500:
                raise CliError(
                    f"the server failed ({response.status_code}): {message}", EXIT_REFUSED
                )
            raise CliError(message, EXIT_REFUSED)
        return body

    def all_pages(self, path: str, params: dict[str, Any], limit: int) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        params = {**params, "limit": min(limit, 1000), "offset": 0}
        while len(rows) < limit:
            page = self.call("GET", path, params=params)
            results = page["results"] if isinstance(page, dict) else page
            rows.extend(results)
            if not isinstance(page, dict) or not page.get("next") or not results:
                break
            params["offset"] += len(results)
        return rows[:limit]


# --- output ----------------------------------------------------------------------


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    """Plain aligned columns, readable in any terminal and easy to grep."""
    cells = [[str(h) for h in headers]] + [
        ["" if v is None else str(v) for v in row] for row in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


# --- commands --------------------------------------------------------------------


def cmd_login(args: argparse.Namespace) -> int:
    config = load_config()
    default_url = os.environ.get("QM_URL") or config.get("url") or DEFAULT_URL
    interactive = sys.stdin.isatty() and not args.password_stdin
    url = args.url or (_ask(f"Server URL [{default_url}]: ") if interactive else "") or default_url
    if not url.startswith(("http://", "https://")):
        raise CliError(
            f"the server URL must start with http:// or https:// (got {url!r})", EXIT_USAGE
        )
    username = args.username or (_ask("Username: ") if interactive else "")
    if not username:
        raise CliError("a username is required (--username)", EXIT_USAGE)
    if args.password_stdin:
        password = sys.stdin.readline().rstrip("\n")
    else:
        password = getpass.getpass("Password: ")
    client = Client(url, None)
    request: dict[str, Any] = {
        "username": username,
        "password": password,
        "name": f"qm on {socket.gethostname()}"[:100],
        "scope": "read" if args.read_only else "full",
    }
    if args.days is not None:
        request["days"] = args.days
    created = client.call("POST", "tokens/login/", json=request)
    path = save_config({"url": client.url, "username": username, "token": created["token"]})
    if args.json:
        print_json(
            {
                "url": client.url,
                "username": username,
                "token_id": created["id"],
                "scope": created["scope"],
                "expires_at": created["expires_at"],
                "config": str(path),
            }
        )
    else:
        print(
            f"Signed in to {client.url} as {username}; token {created['prefix']}… "
            f"({created['scope']}, expires {created['expires_at']}) saved in {path}"
        )
    return EXIT_OK


def _ask(prompt: str) -> str:
    try:
        return input(prompt).strip()
    except EOFError:
        return ""


def _parse_env(pairs: Iterable[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise CliError(f"--env takes NAME=VALUE (got {pair!r})", EXIT_USAGE)
        env[name] = value
    return env


def cmd_submit(args: argparse.Namespace) -> int:
    # Join the words so that `sh -c` (how every runtime starts a rank) splits them
    # back into exactly these words: quotes, pipes and `$` stay the user's words.
    command = args.command_text or shlex.join(args.command)
    if not command.strip():
        raise CliError(
            "give the command to run, e.g. `qm submit ... -- python train.py`", EXIT_USAGE
        )
    body: dict[str, Any] = {
        "team": args.team,
        "flavor": args.flavor,
        "ranks": args.ranks,
        "gpus_per_rank": args.gpus_per_rank,
        "command": command,
        "name": args.name or "",
        "env": _parse_env(args.env or []),
    }
    if args.priority_class:
        body["priority_class"] = args.priority_class
    if args.image:
        body["image"] = args.image
    if args.retries:
        body["retries"] = args.retries
    if args.sweep:
        return _submit_sweep(args, body, _parse_sweep(args.sweep))
    job = Client.from_environment().call("POST", "jobs/", json=body)
    if args.json:
        print_json(job)
    else:
        print(
            f"Submitted job {job['id']} to {job['team']} ({job['gpus']} GPUs of {job['flavor']}, {job['priority_class']}): {job['state']}"
        )
    return EXIT_OK


# The most jobs POST /jobs/batch/ takes in one call.
MAX_SWEEP = 500


def _parse_sweep(specs: Iterable[str]) -> list[tuple[str, list[str]]]:
    """`NAME=V1,V2,...` per --sweep, in the order given."""
    axes: list[tuple[str, list[str]]] = []
    for spec in specs:
        name, sep, values = spec.partition("=")
        choices = values.split(",") if values else []
        if not sep or not name or not choices or not all(choices):
            raise CliError(
                f"--sweep takes NAME=VALUE,VALUE,... with no empty value (got {spec!r})",
                EXIT_USAGE,
            )
        if any(name == other for other, _ in axes):
            raise CliError(f"--sweep names {name} twice", EXIT_USAGE)
        axes.append((name, choices))
    return axes


def _submit_sweep(
    args: argparse.Namespace, body: dict[str, Any], axes: list[tuple[str, list[str]]]
) -> int:
    """One job per combination of the sweep's values, each with its values in its
    environment and its name, queued together: all of them or none."""
    count = math.prod(len(choices) for _, choices in axes)
    if count > MAX_SWEEP:
        raise CliError(
            f"the sweep makes {count:,} jobs; the server takes at most {MAX_SWEEP} at once",
            EXIT_USAGE,
        )
    jobs = []
    for values in itertools.product(*(choices for _, choices in axes)):
        chosen = dict(zip((name for name, _ in axes), values, strict=True))
        label = ",".join(f"{name}={value}" for name, value in chosen.items())
        jobs.append(
            {
                **body,
                "name": f"{body['name']}[{label}]" if body["name"] else label,
                "env": {**body["env"], **chosen},
            }
        )
    queued = Client.from_environment().call("POST", "jobs/batch/", json={"jobs": jobs})
    if args.json:
        print_json(queued)
    else:
        first = queued[0]
        print(
            f"Submitted {len(queued)} jobs to {first['team']} ({first['gpus']} GPUs of "
            f"{first['flavor']} each, {first['priority_class']}):"
        )
        for job in queued:
            print(f"  {job['id']}  {job['name']}")
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    client = Client.from_environment()
    params: dict[str, Any] = {}
    for name in ("team", "state", "since", "until", "flavor"):
        value = getattr(args, name)
        if value:
            params[name] = value
    if args.mine:
        params["submitter"] = load_config().get("username") or os.environ.get("QM_USER") or ""
        if not params["submitter"]:
            raise CliError("--mine needs the username from `qm login` (or QM_USER)", EXIT_USAGE)
    elif args.submitter:
        params["submitter"] = args.submitter
    jobs = client.all_pages("jobs/", params, args.limit)
    if args.json:
        print_json(jobs)
        return EXIT_OK
    if not jobs:
        print("No jobs.")
        return EXIT_OK
    rows = [
        (
            job["id"],
            job["name"] or "-",
            job["team"],
            job["submitter"],
            job["state"],
            f"{_ranks_typed(job)}x{job['gpus_per_rank']}",
            job["priority_class"],
            short_time(job["submitted_at"]),
            # why_waiting: the portal's words (with until when); older portals lack it.
            job.get("why_waiting") or job["waiting_reason"]
            if job["state"] in ("pending", "requeued")
            else "",
        )
        for job in jobs
    ]
    print(
        table(
            rows,
            ["ID", "NAME", "TEAM", "USER", "STATE", "GPUS", "PRIORITY", "SUBMITTED", "WAITING FOR"],
        )
    )
    return EXIT_OK


def _job_id(value: str) -> int:
    if not value.isdigit():
        raise CliError(f"a job id is a number (got {value!r})", EXIT_USAGE)
    return int(value)


def cmd_show(args: argparse.Namespace) -> int:
    client = Client.from_environment()
    job_id = _job_id(args.job)
    job = client.call("GET", f"jobs/{job_id}/")
    preemptions = client.all_pages("preemption-events/", {"job": job_id}, limit=1000)
    if args.json:
        print_json({**job, "preemptions": preemptions})
        return EXIT_OK
    fields = [
        ("Job", f"{job['id']} {job['name']}".strip()),
        ("Team", job["team"]),
        ("Submitter", job["submitter"]),
        ("State", job["state"]),
        ("Priority class", job["priority_class"]),
        ("GPUs", gpus_words(job)),
        ("Command", job.get("command_as_typed") or job["command"]),
        ("Submitted", short_time(job["submitted_at"])),
        ("Finished", short_time(job["finished_at"])),
    ]
    if job.get("why_waiting") or job["waiting_reason"]:
        fields.append(("Waiting for", job.get("why_waiting") or job["waiting_reason"]))
    if job["failure_reason"]:
        fields.append(("Failed because", job["failure_reason"]))
    if job["resume_step"] is not None:
        if job["state"] in FINAL_STATES:
            # A job that has ended resumes nowhere; its last checkpoint is still worth
            # knowing (a job resumes at the step after it).
            checkpoint = job.get("checkpoint_step")
            if checkpoint is None:
                checkpoint = job["resume_step"] - 1
            fields.append(("Last checkpoint", f"step {checkpoint}"))
        else:
            fields.append(("Resumes at step", job["resume_step"]))
    width = max(len(name) for name, _ in fields)
    for name, value in fields:
        print(f"{name.ljust(width)}  {value}")
    preempted = {event["attempt_number"]: event for event in preemptions}
    resized = {resize["attempt_number"]: resize for resize in job.get("resizes", [])}
    for attempt in job.get("attempts", []):
        print()
        ended = (
            f"ended {short_time(attempt['ended_at'])} ({attempt['end_reason']})"
            if attempt["ended_at"]
            else "open"
        )
        print(
            f"Attempt {attempt['number']}: admitted {short_time(attempt['admitted_at'])}, {ended}, borrowed {attempt['borrowed_gpus']} GPUs"
        )
        event = preempted.get(attempt["number"])
        if event is not None:
            print(f"Preempted: {preemption_line(event)}")
        resize = resized.get(attempt["number"])
        if resize is not None:
            print(f"Resized: {resize_line(resize)}")
        rows = [
            (r["index"], r["node"], r["state"], r["exit_code"], short_time(r["exited_at"]))
            for r in attempt["ranks"]
        ]
        if rows:
            print(table(rows, ["RANK", "NODE", "STATE", "EXIT", "EXITED"]))
    if job["state"] == "failed":
        _print_failed_rank_log(client, job)
    return EXIT_OK


def _ranks_typed(job: dict[str, Any]) -> str:
    """A job's sizes as `--ranks` takes them: "8", "2:8" or "2,4,8"."""
    if job.get("ranks_min") is None:
        return str(job["ranks"])
    if job.get("rank_sizes"):
        return ",".join(map(str, job["rank_sizes"]))
    return f"{job['ranks_min']}:{job['ranks']}"


def ranks_argument(text: str) -> int | dict[str, Any]:
    """`--ranks` as the API takes it: "8" as 8, "2:8" as {"min": 2, "max": 8}, "2,4,8"
    as {"sizes": [2, 4, 8]}. Only the form is checked here; the portal judges the sizes."""
    try:
        if ":" in text:
            low, _, high = text.partition(":")
            return {"min": int(low), "max": int(high)}
        if "," in text:
            return {"sizes": [int(size) for size in text.split(",")]}
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"takes N, MIN:MAX or SIZE,SIZE,... (got {text!r})"
        ) from None


def _print_failed_rank_log(client: Client, job: dict[str, Any]) -> None:
    attempts = job.get("attempts") or []
    if not attempts:
        return
    attempt = max(attempts, key=lambda a: a["number"])
    rank = failing_rank(attempt)
    if rank is None:
        return
    print()
    title = f"Last lines of rank {rank['index']} (attempt {attempt['number']}, exit {rank['exit_code']}):"
    try:
        chunk = client.call(
            "GET",
            f"jobs/{job['id']}/logs/",
            params={
                "rank": rank["index"],
                "attempt": attempt["number"],
                "tail": FAILED_LOG_TAIL_BYTES,
            },
        )
    except CliError as error:
        # The job's description is still worth printing when its log is gone.
        print(f"{title} the log cannot be read ({error})")
        return
    lines = chunk["text"].splitlines()
    if chunk["offset"] > 0 and lines:
        lines = lines[1:]  # the tail began inside a line; print whole lines only
    lines = lines[-FAILED_LOG_LINES:]
    print(title if lines else f"{title} the log is empty")
    for line in lines:
        print(f"  {line}")


def cmd_cancel(args: argparse.Namespace) -> int:
    job = Client.from_environment().call("POST", f"jobs/{_job_id(args.job)}/cancel/")
    if args.json:
        print_json(job)
    elif job["state"] == "cancelled":
        print(f"Cancelled job {job['id']}.")
    else:
        print(f"Stopping job {job['id']} gracefully (signal, grace window, then kill).")
    return EXIT_OK


def _tree_lines(nodes: list[dict[str, Any]], depth: int = 0) -> Iterable[tuple[str, str, str]]:
    for node in nodes:
        quotas = ", ".join(
            f"{q['flavor']} {q['guarantee']}"
            + (f" (borrow ≤{q['borrow_limit']})" if q["borrow_limit"] is not None else "")
            + (f" (lend ≤{q['lend_limit']})" if q["lend_limit"] is not None else "")
            for q in node["quotas"]
        )
        yield ("  " * depth + node["slug"], f"{node['weight']:g}", quotas or "-")
        yield from _tree_lines(node["children"], depth + 1)


def cmd_teams(args: argparse.Namespace) -> int:
    tree = Client.from_environment().call("GET", "teams/tree/")
    if args.json:
        print_json(tree)
        return EXIT_OK
    rows = list(_tree_lines(tree))
    print(table(rows, ["TEAM", "WEIGHT", "GUARANTEES"]) if rows else "No teams.")
    return EXIT_OK


def cmd_logs(args: argparse.Namespace) -> int:
    client = Client.from_environment()
    job_id = _job_id(args.job)
    params: dict[str, Any] = {"rank": args.rank}
    if args.attempt is not None:
        params["attempt"] = args.attempt
    if args.tail is not None:
        params["tail"] = args.tail
    else:
        params["offset"] = 0
    out = sys.stdout
    while True:
        chunk = client.call("GET", f"jobs/{job_id}/logs/", params=params)
        if args.json:
            print(json.dumps(chunk, sort_keys=True), flush=True)
        elif chunk["text"]:
            out.write(chunk["text"])
            out.flush()
        params.pop("tail", None)
        # Pin the attempt we started on, so a follow never jumps to a later one mid-stream.
        params.update({"offset": chunk["next_offset"], "attempt": chunk["attempt"]})
        if chunk["text"]:
            continue
        if not args.follow or chunk["finished"]:
            return EXIT_OK
        time.sleep(FOLLOW_POLL_SECONDS)


# --- the parser ------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qm", description="Quartermaster's command-line client.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print JSON for scripts")
    commands = parser.add_subparsers(dest="name", metavar="COMMAND", required=True)

    login = commands.add_parser("login", parents=[common], help="sign in and store a token")
    login.add_argument("--url", help=f"server URL (default: QM_URL or {DEFAULT_URL})")
    login.add_argument("--username")
    login.add_argument("--password-stdin", action="store_true", help="read the password from stdin")
    login.add_argument("--days", type=int, help="how many days the token lasts (server default)")
    login.add_argument(
        "--read-only", action="store_true", help="a token that may only read (GET requests)"
    )
    login.set_defaults(handler=cmd_login)

    submit = commands.add_parser("submit", parents=[common], help="submit a job")
    submit.add_argument("--team", required=True, help="leaf team slug")
    submit.add_argument("--flavor", required=True, help="GPU flavor, e.g. h100-80gb")
    submit.add_argument(
        "--ranks",
        type=ranks_argument,
        default=1,
        help="N ranks, or an elastic job's MIN:MAX (any size between) or SIZE,SIZE,... "
        "(only those); it starts at the largest that fits",
    )
    submit.add_argument("--gpus-per-rank", type=int, default=1)
    submit.add_argument(
        "--priority-class", help="one the team may use; default: the team's default class"
    )
    submit.add_argument("--name")
    submit.add_argument(
        "--retries",
        type=int,
        default=0,
        metavar="N",
        help="run the job again up to N times if it fails on its own (default 0); "
        "preemptions always requeue",
    )
    submit.add_argument("--image", help="container image (Kubernetes runtime)")
    submit.add_argument("--env", action="append", metavar="NAME=VALUE", help="repeatable")
    submit.add_argument(
        "--sweep",
        action="append",
        metavar="NAME=V1,V2,...",
        help="one job per value (per combination, when repeated), the value in NAME; "
        "queued together, all or none",
    )
    submit.add_argument("--command", dest="command_text", help="the command as one string")
    submit.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    submit.set_defaults(handler=cmd_submit)

    ls = commands.add_parser("ls", parents=[common], help="list jobs")
    ls.add_argument("--team")
    ls.add_argument(
        "--state",
        choices=[
            "pending",
            "admitted",
            "running",
            "preempting",
            "requeued",
            "succeeded",
            "failed",
            "cancelled",
        ],
    )
    ls.add_argument("--flavor")
    ls.add_argument("--submitter", help="username")
    ls.add_argument("--mine", action="store_true", help="only jobs you submitted")
    ls.add_argument("--since", help="submitted at or after (ISO 8601)")
    ls.add_argument("--until", help="submitted before (ISO 8601)")
    ls.add_argument("--limit", type=int, default=100)
    ls.set_defaults(handler=cmd_ls)

    show = commands.add_parser(
        "show", parents=[common], help="show a job with its attempts and ranks"
    )
    show.add_argument("job")
    show.set_defaults(handler=cmd_show)

    cancel = commands.add_parser(
        "cancel", parents=[common], help="cancel a job (gracefully if running)"
    )
    cancel.add_argument("job")
    cancel.set_defaults(handler=cmd_cancel)

    teams = commands.add_parser("teams", parents=[common], help="the team tree with guarantees")
    teams.set_defaults(handler=cmd_teams)

    logs = commands.add_parser("logs", parents=[common], help="print a rank's log")
    logs.add_argument("job")
    logs.add_argument("--rank", type=int, default=0)
    logs.add_argument("--attempt", type=int, help="default: the latest")
    logs.add_argument("--tail", type=int, metavar="BYTES", help="start with the last BYTES bytes")
    logs.add_argument(
        "-f", "--follow", action="store_true", help="keep printing until the attempt ends"
    )
    logs.set_defaults(handler=cmd_logs)

    completion = commands.add_parser(
        "completion",
        help="print a shell completion script",
        description='Load it with `eval "$(qm completion bash)"` in ~/.bashrc, or '
        "`source <(qm completion zsh)` in ~/.zshrc.",
    )
    completion.add_argument("shell", choices=SHELLS)
    completion.set_defaults(handler=cmd_completion)
    return parser


def cmd_completion(args: argparse.Namespace) -> int:
    print(completion_script(build_parser(), args.shell), end="")
    return EXIT_OK


def fail(message: str, code: int) -> NoReturn:
    print(f"qm: {message}", file=sys.stderr)
    raise SystemExit(code)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) and args.command[:1] == ["--"]:
        args.command = args.command[1:]
    try:
        code = int(args.handler(args))
        # Flush here, inside the handler for a closed pipe, not at interpreter exit.
        sys.stdout.flush()
        return code
    except CliError as error:
        fail(str(error), error.code)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _closed_pipe()


def _closed_pipe() -> int:
    """The reader of stdout went away (`qm ls | head`): stop without a traceback.

    Python's documented recipe: point stdout at /dev/null so that the flush at exit
    does not fail a second time. SIGPIPE is not reset to its default instead,
    because it would also end qm silently when the server's connection breaks.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_CLOSED_PIPE


if __name__ == "__main__":
    sys.exit(main())
