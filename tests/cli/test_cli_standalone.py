"""`qm` on its own, without a server: it loads none of the portal's code, its
installed entry point is this package, and it prints shell completion scripts
that a real bash uses."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QM = [sys.executable, "-m", "qmcli"]
SUBCOMMANDS = ["login", "submit", "ls", "show", "cancel", "teams", "logs", "completion"]
SERVER_SIDE = {"django", "rest_framework", "celery", "kombu", "kubernetes", "torch"}
PROJECT_APPS = {"portal", "quotas", "preemption", "telemetry", "fairshare", "simulation", "drills"}


def _qm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*QM, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(ROOT / "var")},
    )


def test_help_loads_no_server_code() -> None:
    """`qm --help` imports only the client: no Django, Celery or portal module."""
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from qmcli.cli import main\n"
            "try:\n"
            "    main(['--help'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})), file=sys.stderr)\n",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    assert probe.returncode == 0, probe.stderr
    assert "submit" in probe.stdout and "completion" in probe.stdout
    loaded = set(probe.stderr.split())
    assert "qmcli" in loaded
    assert loaded.isdisjoint(SERVER_SIDE | PROJECT_APPS), loaded & (SERVER_SIDE | PROJECT_APPS)
    # The HTTP client loads only for commands that call the server.
    assert "requests" not in loaded and "urllib3" not in loaded


def test_the_installed_script_is_this_package() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["qm"].partition(":")
    assert module == "qmcli.cli"
    assert callable(getattr(importlib.import_module(module), function))
    included = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "qmcli*" in included["packages"]["find"]["include"]


def _complete(script: str, *words: str) -> list[str]:
    """What bash offers for the last of `words` after sourcing the script."""
    line = " ".join(f"'{w}'" for w in ["qm", *words])
    driver = (
        f"{script}\n"
        f"COMP_WORDS=({line}); COMP_CWORD={len(words)}\n"
        "_qm_complete\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", driver], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return [w for w in done.stdout.splitlines() if w]


def test_bash_completion_offers_subcommands_options_and_choices() -> None:
    printed = _qm("completion", "bash")
    assert printed.returncode == 0, printed.stderr
    script = printed.stdout
    assert "complete -F _qm_complete qm" in script
    assert all(name in script for name in SUBCOMMANDS)

    assert _complete(script, "") == [*SUBCOMMANDS, "-h", "--help"]
    assert _complete(script, "s") == ["submit", "show"]
    assert _complete(script, "ls", "--st") == ["--state"]
    assert _complete(script, "ls", "--state", "pre") == ["preempting"]
    assert _complete(script, "submit", "--gpus") == ["--gpus-per-rank"]
    assert _complete(script, "submit", "--team", "") == []  # a team slug is typed, not listed
    assert _complete(script, "completion", "") == ["-h", "--help", "bash", "zsh"]
    # After `--` the words are the job's own command: qm's options are not offered.
    assert "--json" not in _complete(script, "submit", "--team", "t", "--", "python", "--")


def test_zsh_completion_describes_every_subcommand() -> None:
    printed = _qm("completion", "zsh")
    assert printed.returncode == 0, printed.stderr
    script = printed.stdout
    assert script.startswith("#compdef qm\n")
    for name in SUBCOMMANDS:
        assert f"\n        '{name}:" in script  # listed with its help for _describe
        assert f"\n        ({name})\n" in script  # and its own branch of options
    assert (
        ":state:(pending admitted running preempting requeued succeeded failed cancelled)'"
        in script
    )
    assert "'*::command:_normal'" in script  # the job's command completes as a command


@pytest.mark.parametrize("shell", ["fish", ""])
def test_completion_for_an_unknown_shell_is_a_usage_error(shell: str) -> None:
    refused = _qm("completion", shell)
    assert refused.returncode == 2
    assert refused.stdout == ""
    assert "invalid choice" in refused.stderr and "bash" in refused.stderr
