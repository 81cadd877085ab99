"""The engine compiled to C by mypyc, used only where it was built from these very sources.

mypyc, the compiler the mypy project builds mypy itself with, turns typed Python
modules into C extensions that keep their meaning: attribute reads of the model's
classes become field reads, calls between the engine's modules become C calls, and
the strict type checks the engine already passes become the layout. The same plan
comes out two to three times as fast on the engine benchmark's clusters
(``bench/bench_fairshare.py`` prints both engines side by side).

Where the compiled modules live is this module's own business, and why it exists:
setuptools writes extensions next to their sources, where an extension shadows its
``.py`` file, so an edited module would go on running its old compiled self without
a word. Here a build is kept in ``fairshare/_build/<fingerprint>``, the fingerprint a
hash of the compiled modules' sources and of the interpreter's extension tag, and
when the package is imported it looks for the build of the sources it has now. Found,
that folder goes first on the package's search path, so ``fairshare.cycle`` and the
others load from it; the modules it does not hold (the scenario format, the what-if
diff, this one) load from their sources as always. Not found, the engine runs as
plain Python.

``QM_ENGINE`` chooses: ``auto`` (the default) takes the build when there is one,
``compiled`` refuses to import without it (``make test`` and the portal image, so
that what is tested and shipped is the compiled engine), and ``python`` always runs
the sources (for profiling: cProfile sees only Python functions).

``make engine`` builds (``fairshare.native.main``): the compiled folder is kept
in a cache outside the repository too (``QM_ENGINE_CACHE``, by default
``~/.cache/quartermaster/engine``), so a second clone of the same sources copies it
rather than compiling for a minute.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

#: The modules compiled: everything ``plan`` runs. The scenario format and the what-if
#: diff stay Python (they parse and compare; the plan they call is compiled).
COMPILED = (
    "candidates",
    "consolidation",
    "cycle",
    "decisions",
    "elastic",
    "engine",
    "ledger",
    "model",
    "nodes",
    "order",
    "preemption",
    "reclaim_scan",
    "rules",
    "searches",
    "shares",
    "status",
    "tree",
    "work",
)
CHOICES = ("auto", "compiled", "python")
PACKAGE = Path(__file__).resolve().parent
BUILDS = PACKAGE / "_build"
#: Written last into a finished build: a folder without it is an interrupted one.
DONE = "BUILT"
#: mypyc's shared library of the group, a module of the package like the others.
GROUP = "fairshare.compiled"


class EngineBuildError(RuntimeError):
    """The compiled engine could not be built (no C compiler, no Python headers, ...)."""


def extension_suffix() -> str:
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    return suffix if isinstance(suffix, str) else ".so"


def fingerprint() -> str:
    """A hash of the compiled modules' sources and of this interpreter's extension tag."""
    digest = hashlib.sha256(extension_suffix().encode())
    for name in COMPILED:
        digest.update(f"\0{name}\0".encode())
        digest.update((PACKAGE / f"{name}.py").read_bytes())
    return digest.hexdigest()[:20]


def build_folder() -> Path:
    """Where the build of the current sources is, or would be."""
    return BUILDS / fingerprint()


def _complete(folder: Path) -> bool:
    return (folder / DONE).is_file()


def engine_choice() -> str:
    choice = os.environ.get("QM_ENGINE", "auto").strip() or "auto"
    if choice not in CHOICES:
        raise ImportError(f"QM_ENGINE={choice!r}: expected one of {', '.join(CHOICES)}")
    return choice


def search_path(package_path: list[str]) -> list[str]:
    """The package's search path: the build of its current sources first, where one exists.

    Raises ``ImportError`` with ``QM_ENGINE=compiled`` when there is no such build.
    """
    choice = engine_choice()
    if choice == "python":
        return package_path
    folder = build_folder()
    if _complete(folder):
        return [str(folder), *package_path]
    if choice == "compiled":
        raise ImportError(
            f"QM_ENGINE=compiled, but the engine's current sources were not compiled "
            f"(no {folder.relative_to(PACKAGE.parent)}): run `make engine`"
        )
    return package_path


def running_compiled() -> bool:
    """Whether this process plans with the compiled engine."""
    from . import cycle

    return Path(cycle.__file__ or "").suffix != ".py"


def python_sources() -> ModuleType:
    """The engine run from its sources, beside the compiled one: a second copy of the
    package, ``fairshare_sources``, imported with ``QM_ENGINE=python``.

    Its classes are its own, but its functions read the compiled model's objects alike,
    so one snapshot can be planned by both (the tests compare their plans; the engine
    benchmark times both). The tests that look inside the planner (replace a method,
    count a dictionary's lookups) use it too: compiled classes take no such probe.
    """
    name = "fairshare_sources"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, PACKAGE / "__init__.py", submodule_search_locations=[str(PACKAGE)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    before = os.environ.get("QM_ENGINE")
    os.environ["QM_ENGINE"] = "python"
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        if before is None:
            del os.environ["QM_ENGINE"]
        else:
            os.environ["QM_ENGINE"] = before
    return module


# -- building ---------------------------------------------------------------------------


def cache_root() -> Path:
    configured = os.environ.get("QM_ENGINE_CACHE")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "quartermaster" / "engine"


def build() -> Path:
    """Make sure the build of the current sources is in ``fairshare/_build``; return it.

    Copies it from the cache when there, compiles it (into the cache) otherwise, and
    removes the builds of earlier sources from the package.
    """
    target = build_folder()
    if not _complete(target):
        cached = cache_root() / target.name
        if not _complete(cached):
            _compile(cached)
        _install(cached, target)
    for other in BUILDS.iterdir():
        if other != target:
            shutil.rmtree(other, ignore_errors=True)
    return target


def _install(source: Path, target: Path) -> None:
    """Copy a finished build into place, whole or not at all."""
    BUILDS.mkdir(exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".incoming-", dir=BUILDS))
    # Readable by every user, as the sources are (a temporary folder is the owner's alone).
    staging.chmod(0o755)
    try:
        for item in source.iterdir():
            copied = staging / item.name
            shutil.copyfile(item, copied)
            copied.chmod(0o644 if item.name == DONE else 0o755)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _compile(out: Path) -> None:
    """Compile the modules of ``COMPILED`` with mypyc into the folder ``out``."""
    compiler = os.environ.get("CC", "cc").split()[0]
    if shutil.which(compiler) is None:
        raise EngineBuildError(
            f"no C compiler ({compiler!r} not found): install gcc (Debian: apt-get install gcc)"
        )
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.is_file():
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        raise EngineBuildError(
            f"no Python headers ({headers} is missing): install them "
            f"(Debian: apt-get install python{version}-dev)"
        )
    try:
        from mypyc.build import mypycify
        from setuptools import setup  # type: ignore[import-untyped]
    except ImportError as missing:
        raise EngineBuildError(
            f"{missing.name} is not installed: install the development extras (make venv)"
        ) from missing

    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        extensions = mypycify(
            [str(PACKAGE / f"{name}.py") for name in COMPILED],
            target_dir=str(work / "c"),
            group_name=GROUP,
        )
        # From the work folder: setuptools would read the project's pyproject.toml
        # from the current one, and it has nothing to say about these extensions.
        with contextlib.chdir(work):
            setup(
                name="fairshare-compiled",
                ext_modules=extensions,
                script_args=[
                    "--quiet",
                    "build_ext",
                    f"--build-lib={work / 'lib'}",
                    f"--build-temp={work / 'temp'}",
                    f"--parallel={os.cpu_count() or 1}",
                ],
            )
        built = work / "lib" / "fairshare"
        expected = [*COMPILED, GROUP.rpartition(".")[2] + "__mypyc"]
        folder = work / "engine"
        folder.mkdir()
        for name in expected:
            extension = built / f"{name}{extension_suffix()}"
            if not extension.is_file():
                raise EngineBuildError(f"mypyc built no {extension.name}")
            extension.rename(folder / extension.name)
        (folder / DONE).write_text(f"sources {out.name}\n")
        shutil.rmtree(out, ignore_errors=True)
        folder.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    """``make engine``: build, with ``QM_ENGINE=python`` (the package is imported first)."""
    try:
        folder = build()
    except EngineBuildError as error:
        sys.exit(f"fairshare.native: {error}")
    print(folder.relative_to(PACKAGE.parent))
