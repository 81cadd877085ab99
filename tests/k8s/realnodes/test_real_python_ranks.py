"""Ranks that run Python, torch and gracetrap in real containers, as the drill's do.

Two real nodes named as the drill names its nodes (``drill-node-0`` and
``drill-node-1``, flavor ``drill-gpu``, 4 GPUs each, so that 8 ranks span both).
The ranks run the host's Python, torch and the project rather than an image with
them baked in (gigabytes, for a test): each node gives every container the host's
``/usr``, the Python prefix and the repository read-only, and a folder of the
test read-write, through containerd's base runtime spec, as the NVIDIA toolkit
gives containers the driver's libraries. The runtime's default image name is the
small rank image, tagged so on the nodes. This is what ``manage.py drill
--runtime kubernetes`` needs of the real nodes (docs/real-nodes.md, "The drill on
real pods").
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from preemption.runtimes.kubernetes import KubernetesRuntime, KubernetesRuntimeConfig
from tools.k8s.controlplane import REPO_ROOT
from tools.k8s.gangs import all_in, gang_spec
from tools.k8s.realnodes import RealNodes
from tools.k8s.wait import wait_for


def test_a_rank_container_runs_the_hosts_python_with_torch_and_gracetrap(
    drill_nodes: RealNodes,
    kubeconfig: str,
    drill_namespace: str,
    test_priority_classes: dict[str, int],
    drill_folder: Path,
) -> None:
    runtime = KubernetesRuntime.from_kubeconfig(
        kubeconfig,
        KubernetesRuntimeConfig(
            namespace=drill_namespace,
            default_cpu_per_gpu="450m",
            default_memory_per_gpu="1Gi",
            default_ephemeral_storage_per_gpu="64Mi",
        ),
    )
    out = drill_folder / "out"
    out.mkdir(mode=0o1733)
    out.chmod(0o1733)
    # Imports torch and gracetrap, writes where the node lets it, and finds the
    # repository read-only.
    script = (
        "import gracetrap, os, sys, torch; "
        f"open({str(out / 'rank-0')!r}, 'w').write(str(os.getuid())); "
        f"ro = os.statvfs({str(REPO_ROOT)!r}).f_flag & os.ST_RDONLY; "
        "print('python ok', torch.__version__, os.getuid(), gracetrap.__name__, "
        "'repo-ro' if ro else 'repo-rw')"
    )
    spec = gang_spec(
        921, {"drill-node-1": 1}, command=f"{shlex.quote(sys.executable)} -c {shlex.quote(script)}"
    )
    try:
        runtime.launch(spec)
        wait_for(lambda: all_in(runtime, spec.gang, "exited", 1), timeout=120, what="rank exits")
        log = runtime.read_log(spec.gang, 0).decode(errors="replace")
        print(log)
        assert [o.exit_code for o in runtime.observe(spec.gang)] == [0], log
        found = re.search(r"^python ok \S+ (\d+) gracetrap repo-ro$", log, re.MULTILINE)
        assert found, log
        # As the job's own uid, not root, and what it wrote is on the host.
        uid = int(found.group(1))
        assert uid > 0
        assert (out / "rank-0").read_text() == str(uid)
        runtime.forget(spec.gang)
    finally:
        runtime.close()
