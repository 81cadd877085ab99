"""The wheel users download from the portal builds, installs into a fresh venv and works."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from gracetrap_gang import REPO

TORCH = "torch==2.13.0"
# Torch's wheels (about 3 GB with their CUDA libraries) are kept between runs here, so
# only the first run on a machine downloads them.
WHEELHOUSE = Path(
    os.environ.get("QM_WHEELHOUSE", Path.home() / ".cache" / "quartermaster" / "wheels")
)

# Offline: the build backend comes from the project venv instead of the index.
PIP_WHEEL = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]

SMOKE = """
import sys, tempfile, torch, gracetrap
assert "django" not in sys.modules
directory = tempfile.mkdtemp()
model = torch.nn.Linear(3, 2)
optimizer = torch.optim.Adam(model.parameters())
with gracetrap.Trap(directory, {"model": model, "optimizer": optimizer}) as trap:
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    trap.save(4)
weights = model.weight.detach().clone()
torch.nn.init.zeros_(model.weight)
with gracetrap.Trap(directory, {"model": model, "optimizer": optimizer}) as trap:
    assert trap.resume() == 5
assert torch.equal(model.weight, weights)
print("gracetrap", gracetrap.__version__, "works with torch", torch.__version__)
"""


def _run(command: list[str], timeout: float) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.mark.slow
def test_wheel_builds_and_installs_into_a_fresh_venv(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    _run(
        [*PIP_WHEEL, "-w", str(dist), str(REPO / "gracetrap")],
        timeout=300,
    )
    (wheel,) = dist.glob("gracetrap-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in (
        *("__init__", "trap", "base", "saving", "stopping", "staging", "gloo", "environment"),
        *("checkpoints", "events", "protocol", "state", "ports"),
    ):
        assert f"gracetrap/{module}.py" in names
    assert "gracetrap/py.typed" in names
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [
        line
        for line in zipfile.ZipFile(wheel).read(metadata).decode().splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    assert [line.split()[1] for line in requires] == ["torch>=2.4"], requires

    if not any(WHEELHOUSE.glob("torch-2.13.0-*.whl")):
        WHEELHOUSE.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "pip", "download", "-d", str(WHEELHOUSE), TORCH], 1800)

    venv = tmp_path / "venv"
    try:
        _run([sys.executable, "-m", "venv", str(venv)], timeout=120)
        python = str(venv / "bin" / "python")
        sources = ["--find-links", str(WHEELHOUSE), "--find-links", str(dist)]
        wanted = ["gracetrap", TORCH]
        _run(
            [python, "-m", "pip", "install", "--no-index", "--no-compile", "-q", *sources, *wanted],
            timeout=900,
        )
        listed = _run([python, "-m", "pip", "list", "--format=freeze"], timeout=60)
        assert "gracetrap==0.1.0" in listed.split() and TORCH in listed.split()
        assert "Django" not in listed
        output = _run([python, "-c", SMOKE], timeout=300)
        assert "gracetrap 0.1.0 works with torch 2.13.0" in output
    finally:
        # A venv with torch is gigabytes: never keep it in pytest's retained temp dirs.
        shutil.rmtree(venv, ignore_errors=True)
