"""The Django side keeps its imports at the top of each module: an import of
project code inside a function is allowed only in `AppConfig.ready()`, where
Django's app loading demands it, with a comment that says why. (The layers
themselves are kept by import-linter's contracts in pyproject.toml.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "portal", "quotas", "preemption", "telemetry")
PROJECT = {*PACKAGES, "fairshare", "simulation", "gracetrap", "gracetrap_protocol"}


def _function_imports() -> list[tuple[str, int, str, str]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            source = path.read_text()
            for function in ast.walk(ast.parse(source)):
                if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for node in ast.walk(function):
                    if isinstance(node, ast.ImportFrom):
                        names = [node.module or ""] if node.level == 0 else [package]
                    elif isinstance(node, ast.Import):
                        names = [alias.name for alias in node.names]
                    else:
                        continue
                    if any(name.split(".")[0] in PROJECT for name in names):
                        relative = str(path.relative_to(ROOT))
                        found.append((relative, node.lineno, function.name, source))
    return found


def test_project_imports_inside_functions_are_only_the_documented_ones() -> None:
    found = _function_imports()
    assert {(path, function) for path, _, function, _ in found} == {("preemption/apps.py", "ready")}
    # The block of imports opens with its one-line reason.
    path, first, _, source = min(found)
    assert source.splitlines()[first - 2].strip().startswith("# "), f"{path}:{first}"
