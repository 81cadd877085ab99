"""A flavor's own limits are the ones a rank of the sandboxed local runtime gets, for real.

The site's limits (QM_RANK_PIDS_MAX, QM_RANK_MEMORY_MAX, QM_RANK_FILE_SIZE_MAX) are the
default; a flavor may lower (or raise) each for its ranks (quotas.ResourceFlavor's
`rank_*` fields, memory per GPU of the rank). The runtime reads them from the database as
the gang launches (preemption.runtime.flavor_sandbox_limits) and writes them to each
rank's cgroups, where the kernel holds the rank to them: a rank that forks past its
flavor's lower process limit is refused at that limit, not the site's.
"""

from __future__ import annotations

import re
import shlex
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from preemption.runtime import flavor_sandbox_limits
from preemption.runtimes import GangId, GangSpec, LocalRuntime, RankPlacement, parse_inventory
from preemption.runtimes import sandbox as sandboxes
from preemption.runtimes.records import GANG_FILE, read_record
from preemption.runtimes.runner import RunnerAccount
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.django_db]

SITE = sandboxes.SandboxLimits(pids_max=4096, memory_max=8 << 30, file_size_max=1 << 30)

# Forks children that wait, until the kernel refuses one; says how many it had.
FORKER = textwrap.dedent(
    """
    import os, sys, time
    children = 0
    try:
        while children < 10000:
            if os.fork() == 0:
                time.sleep(60)
                os._exit(0)
            children += 1
    except OSError as error:
        print("REFUSED AFTER", children, error.strerror, flush=True)
    else:
        print("NOT LIMITED", flush=True)
    """
)


@pytest.fixture
def runtime(runner_account: RunnerAccount) -> Iterator[LocalRuntime]:
    found = sandboxes.support()
    assert found.available, found.reason
    base = Path(tempfile.mkdtemp(prefix="qm-sandbox-flavor-"))
    base.chmod(0o711)
    runtime = LocalRuntime(
        base / "runs",
        parse_inventory("node-a:h100-80gb:8"),
        runner=runner_account,
        sandbox=sandboxes.SandboxConfig(
            mode="on", limits=SITE, flavor_limits=flavor_sandbox_limits
        ),
    )
    try:
        yield runtime
    finally:
        for observed in runtime.observe():
            runtime.kill(GangId(observed.job_id, observed.attempt))
        shutil.rmtree(base, ignore_errors=True)


def gang(job_id: int, command: str, *, flavor: str, gpus_per_rank: int) -> GangSpec:
    return GangSpec(
        job_id=job_id,
        attempt=1,
        command=command,
        ranks=(RankPlacement(0, "node-a", 0),),
        gpus_per_rank=gpus_per_rank,
        grace_seconds=5.0,
        priority_class="ai-batch-preemptible",
        team="vision",
        flavor=flavor,
        env={},
    )


def cgroup_limits(runtime: LocalRuntime, gang_id: GangId) -> dict[str, int]:
    """The limits the kernel holds rank 0 to, read from its cgroups."""
    record = read_record(runtime.gang_dir(gang_id) / GANG_FILE)
    assert record is not None and record["sandbox"] is not None
    cgroups = record["sandbox"]["cgroups"]
    if "unified" in cgroups:
        leaf = Path(cgroups["unified"]) / "0"
        files = {"pids": leaf / "pids.max", "memory": leaf / "memory.max"}
    else:
        files = {
            "pids": Path(cgroups["pids"]) / "0" / "pids.max",
            "memory": Path(cgroups["memory"]) / "0" / "memory.limit_in_bytes",
        }
    return {name: int(path.read_text()) for name, path in files.items()}


def test_a_flavors_lower_limits_are_the_ones_in_its_ranks_cgroup(
    world: Any, runtime: LocalRuntime
) -> None:
    world.h100.rank_pids_max = 24
    world.h100.rank_memory_per_gpu = 256 << 20
    world.h100.save(update_fields=["rank_pids_max", "rank_memory_per_gpu"])
    limited = gang(501, "echo up; exec sleep 60", flavor="h100-80gb", gpus_per_rank=2)
    site = gang(502, "echo up; exec sleep 60", flavor="a100-40gb", gpus_per_rank=2)

    runtime.launch(limited)
    runtime.launch(site)
    for spec in (limited, site):
        wait_until(lambda spec=spec: b"up" in runtime.read_log(spec.gang, 0), "the rank to start")

    # 256 MiB per GPU, for a rank with two; the flavor sets no file size: the site's.
    assert cgroup_limits(runtime, limited.gang) == {"pids": 24, "memory": 512 << 20}
    record = read_record(runtime.gang_dir(limited.gang) / GANG_FILE)
    assert record is not None
    assert record["sandbox"]["limits"]["file_size_max"] == SITE.file_size_max
    # A flavor that sets nothing keeps the site's limits.
    assert cgroup_limits(runtime, site.gang) == {"pids": 4096, "memory": 8 << 30}


def test_a_rank_that_forks_past_its_flavors_process_limit_is_refused_there(
    world: Any, runtime: LocalRuntime
) -> None:
    world.h100.rank_pids_max = 24
    world.h100.save(update_fields=["rank_pids_max"])
    spec = gang(
        503,
        f"{shlex.quote(sys.executable)} -c {shlex.quote(FORKER)}",
        flavor="h100-80gb",
        gpus_per_rank=1,
    )

    runtime.launch(spec)

    # Until the rank's last line is whole: the keeper may copy it in two parts.
    wait_until(
        lambda: re.search(rb"(REFUSED AFTER|NOT LIMITED).*\n", runtime.read_log(spec.gang, 0)),
        "the rank to reach its limit",
    )
    log = runtime.read_log(spec.gang, 0).decode()
    assert "NOT LIMITED" not in log, log
    children = int(log.split("REFUSED AFTER")[1].split()[0])
    # The init, the shell and the forker itself count too; the site's 4096 never came
    # into play.
    assert 0 < children < 24, log
    assert "Resource temporarily unavailable" in log, log


def test_a_flavors_memory_is_per_gpu_of_the_rank() -> None:
    def own(flavor: str) -> sandboxes.FlavorLimits | None:
        return {"small": sandboxes.FlavorLimits(memory_per_gpu=1 << 30)}.get(flavor)

    config = sandboxes.SandboxConfig(mode="on", limits=SITE, flavor_limits=own)

    assert config.limits_for("small", 4).memory_max == 4 << 30
    assert config.limits_for("small", 0).memory_max == 1 << 30
    assert config.limits_for("small", 4).pids_max == SITE.pids_max
    assert config.limits_for("other", 4) == SITE
    assert config.limits_for("", 4) == SITE
