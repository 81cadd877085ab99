"""The compiled engine is used only where it was built from the sources it stands for.

The tests here point ``fairshare.native`` at a copy of the engine's sources in a
temporary folder, so that they can edit a source or leave a build unfinished without
touching the package in use. That the suite itself plans with the compiled engine, and
that it plans as its sources do, is tested beside the scenarios and the properties.
"""

from __future__ import annotations

import ast
import copy
import copyreg
import dataclasses
import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import fairshare
from fairshare import native

ROOT = Path(native.__file__).resolve().parent.parent
EXAMPLES = ROOT / "fairshare" / "examples"


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A copy of the engine's sources, with a finished build of them (an empty one: what
    these tests judge is which folder the package would look in)."""
    copy = tmp_path / "fairshare"
    shutil.copytree(native.PACKAGE, copy, ignore=shutil.ignore_patterns("_build", "__pycache__"))
    monkeypatch.setattr(native, "PACKAGE", copy)
    monkeypatch.setattr(native, "BUILDS", copy / "_build")
    build = native.build_folder()
    build.mkdir(parents=True)
    (build / native.DONE).write_text("sources\n")
    monkeypatch.delenv("QM_ENGINE", raising=False)
    return copy


def test_the_build_of_the_current_sources_goes_first_on_the_packages_path(package):
    assert native.search_path([str(package)]) == [str(native.build_folder()), str(package)]


def test_an_edited_source_is_never_hidden_behind_the_build_of_its_old_self(package, monkeypatch):
    built = native.build_folder()
    cycle = package / "cycle.py"
    cycle.write_text(cycle.read_text() + "\n# edited\n")
    assert native.build_folder() != built
    assert native.search_path([str(package)]) == [str(package)]
    monkeypatch.setenv("QM_ENGINE", "compiled")
    with pytest.raises(ImportError, match=r"were not compiled.*run `make engine`"):
        native.search_path([str(package)])


def test_an_unfinished_build_is_not_used(package):
    (native.build_folder() / native.DONE).unlink()
    assert native.search_path([str(package)]) == [str(package)]


def test_the_sources_are_run_when_asked_for_even_beside_their_build(package, monkeypatch):
    monkeypatch.setenv("QM_ENGINE", "python")
    assert native.search_path([str(package)]) == [str(package)]


def test_an_unknown_choice_of_engine_is_refused_by_name(package, monkeypatch):
    monkeypatch.setenv("QM_ENGINE", "fast")
    with pytest.raises(ImportError, match="QM_ENGINE='fast': expected one of auto, compiled"):
        native.search_path([str(package)])


@pytest.fixture
def private_umask():
    """A builder whose own files are private (umask 077), as some accounts are."""
    before = os.umask(0o077)
    yield
    os.umask(before)


def test_a_build_found_in_the_cache_is_copied_in_not_compiled_again(
    package, tmp_path, monkeypatch, private_umask
):
    shutil.rmtree(native.BUILDS)
    (native.BUILDS / "0123456789abcdef0123").mkdir(parents=True)
    cache = tmp_path / "cache"
    cached = cache / native.fingerprint()
    cached.mkdir(parents=True)
    (cached / native.DONE).write_text("sources\n")
    (cached / f"cycle{native.extension_suffix()}").write_bytes(b"compiled")
    monkeypatch.setenv("QM_ENGINE_CACHE", str(cache))

    def no_compiling(out: Path) -> None:
        raise AssertionError(f"compiled {out} though the cache holds it")

    monkeypatch.setattr(native, "_compile", no_compiling)
    assert native.build() == native.build_folder()
    assert (native.build_folder() / f"cycle{native.extension_suffix()}").read_bytes() == b"compiled"
    # The build of earlier sources is gone from the package; the cache keeps its own.
    assert [p.name for p in native.BUILDS.iterdir()] == [native.fingerprint()]
    # What the package loads code from is readable by all (the portal may run as another
    # user than the one who built it) and writable by its owner alone.
    for path in (native.build_folder(), *native.build_folder().iterdir()):
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o444 == 0o444 and not mode & 0o022, (path, oct(mode))


def test_a_process_that_asks_for_the_compiled_engine_plans_with_it_or_says_why():
    """In a fresh interpreter, as the portal's worker would start: with the build that
    ``make engine`` left, the planner is an extension module; with ``QM_ENGINE=python``
    it is the source file."""
    probe = "import fairshare.cycle as c, fairshare.native as n; print(n.running_compiled())"
    for choice, expected in (("compiled", "True"), ("python", "False")):
        shown = subprocess.run(
            [sys.executable, "-c", probe],
            cwd=ROOT,
            env={"PATH": "/usr/bin:/bin", "QM_ENGINE": choice},
            capture_output=True,
            text=True,
            check=False,
        )
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.strip() == expected


# Builtins that consume a generator whole, or stop early without anything changing
# in between: an eager list gives them the same items.
CONSUMERS = {"any", "all", "sum", "min", "max", "sorted", "tuple", "list", "set", "frozenset"}


def test_no_compiled_module_hands_a_generator_expression_on():
    """mypyc builds every generator expression as a whole list before it is read. Where
    one is handed to a function that reads it while changing what it depends on (a
    victim scan judged by the usage its taken victims left), the compiled engine would
    plan otherwise than its sources; such code is written as a generator function, and
    everything else as a list."""
    handed_on = []
    for name in native.COMPILED:
        path = native.PACKAGE / f"{name}.py"
        tree = ast.parse(path.read_text())
        consumed = {
            id(call.args[0])
            for call in ast.walk(tree)
            if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id in CONSUMERS
            and len(call.args) == 1
        }
        handed_on += [
            f"{path.name}:{node.lineno}"
            for node in ast.walk(tree)
            if isinstance(node, ast.GeneratorExp) and id(node) not in consumed
        ]
    assert handed_on == []


def test_the_models_values_copy_and_pickle_as_values():
    """A snapshot, a plan and a what-if answer survive ``copy`` and ``pickle`` (a caller
    may hand them to another process) as equal values, compiled as well as from the
    sources: compiled, a frozen dataclass refuses the attribute writes that the default
    way of rebuilding an object makes."""
    document = json.loads((EXAMPLES / "two-teams.json").read_text())
    changes = json.loads((EXAMPLES / "lower-guarantee.json").read_text())
    for engine in (fairshare, native.python_sources()):
        snapshot = engine.snapshot_from_dict(document)
        quota_changes = engine.changes_from_list(changes)
        values = [
            snapshot,
            engine.plan(snapshot),
            engine.diff(snapshot, quota_changes),
            *quota_changes,
            engine.QuotaChange("vision", "h100"),
            engine.Resize("train-1", 4, (("n0", 4),), "grown from 2 to 4 ranks"),
        ]
        for value in values:
            for rebuilt in (
                copy.copy(value),
                copy.deepcopy(value),
                pickle.loads(pickle.dumps(value)),
            ):
                assert type(rebuilt) is type(value)
                assert rebuilt == value
        assert pickle.loads(pickle.dumps(engine.UNSET)) is engine.UNSET
        # Every dataclass of the model is rebuilt so, not only those met above.
        model = engine.model
        frozen = {
            value
            for value in vars(model).values()
            if isinstance(value, type) and dataclasses.is_dataclass(value)
        }
        assert len(frozen) == 15
        assert all(copyreg.dispatch_table.get(cls) for cls in frozen)
    assert native.running_compiled()
