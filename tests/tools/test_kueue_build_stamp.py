"""The cache check of tools/kueue/build.sh, without building anything.

The script decides from its cache folder alone whether Kueue's runner and
minimalkueue are built: a stamp naming the module and version, both binaries
executable, and the parts of the module's tree the runner is given. These tests
lay such folders out by hand (empty files stand in for the binaries, which the
check never runs) and point ``GO`` at ``false``, so any attempt to build fails at
once instead of going to the module proxy.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "tools" / "kueue" / "build.sh"
VERSION = "v0.17.0"


def run_script(cache: Path, *args: str, version: str = VERSION) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(cache.parent),
        "QM_KUEUE_CACHE": str(cache),
        "QM_KUEUE_VERSION": version,
        "GO": "false",
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=30
    )


def lay_out(cache: Path, version: str = VERSION, stamp: str | None = None) -> Path:
    """A version folder as a finished build leaves it."""
    folder = cache / version
    for binary in ("performance-scheduler-runner", "minimalkueue"):
        path = folder / "bin" / binary
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    src = folder / "src"
    (src / "config/components/crd/bases").mkdir(parents=True)
    (src / "test/performance/scheduler/configs/baseline").mkdir(parents=True)
    (src / "Makefile").write_text("")
    stamp_text = stamp if stamp is not None else f"sigs.k8s.io/kueue@{version}\nsum h1:x\n"
    (folder / ".stamp").write_text(stamp_text)
    return folder


def test_a_complete_folder_is_found_without_go(tmp_path: Path) -> None:
    folder = lay_out(tmp_path / "cache")
    for args in ((), ("--check",)):
        result = run_script(tmp_path / "cache", *args)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == str(folder)


def test_an_empty_cache_is_not_built(tmp_path: Path) -> None:
    result = run_script(tmp_path / "cache", "--check")
    assert result.returncode == 1
    assert "no stamp" in result.stderr
    assert result.stdout == ""


def test_a_stamp_for_another_version_does_not_count(tmp_path: Path) -> None:
    # A folder named for v0.16.0 whose stamp speaks of v0.17.0 was not built for v0.16.0.
    lay_out(tmp_path / "cache", "v0.16.0", stamp="sigs.k8s.io/kueue@v0.17.0\n")
    result = run_script(tmp_path / "cache", "--check", version="v0.16.0")
    assert result.returncode == 1
    assert "expected 'sigs.k8s.io/kueue@v0.16.0'" in result.stderr


@pytest.mark.parametrize(
    ("remove", "reason"),
    [
        ("bin/minimalkueue", "missing binary"),
        ("bin/performance-scheduler-runner", "missing binary"),
        ("src/Makefile", "missing source path"),
        ("src/config/components/crd/bases", "missing source path"),
        (".stamp", "no stamp at"),
    ],
)
def test_a_missing_part_means_not_built(tmp_path: Path, remove: str, reason: str) -> None:
    folder = lay_out(tmp_path / "cache")
    target = folder / remove
    if target.is_dir():
        target.rmdir()
    else:
        target.unlink()
    result = run_script(tmp_path / "cache", "--check")
    assert result.returncode == 1
    assert f"{reason} {folder / remove}" in result.stderr


def test_a_binary_that_is_not_executable_means_not_built(tmp_path: Path) -> None:
    folder = lay_out(tmp_path / "cache")
    (folder / "bin" / "minimalkueue").chmod(0o644)
    result = run_script(tmp_path / "cache", "--check")
    assert result.returncode == 1
    assert "missing binary" in result.stderr


def test_an_unstamped_folder_is_rebuilt_and_a_failed_build_leaves_no_stamp(tmp_path: Path) -> None:
    # Binaries without a stamp are what an interrupted build leaves: the script
    # must build again (here it fails at once, GO being `false`), not trust them.
    folder = lay_out(tmp_path / "cache")
    (folder / ".stamp").unlink()
    result = run_script(tmp_path / "cache")
    assert result.returncode != 0
    assert "building sigs.k8s.io/kueue v0.17.0: no stamp" in result.stderr
    assert not (folder / ".stamp").exists()
    assert run_script(tmp_path / "cache", "--check").returncode == 1
