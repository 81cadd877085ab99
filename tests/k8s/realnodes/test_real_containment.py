"""Containment on real kubelets: one team's rank cannot reach another team's checkpoints,
GPUs, disk or time, in real containers.

tests/security/test_security_k8s_checkpoints.py makes the same attacks with the
node agent running ranks as host processes; here containerd, runc and a real
kubelet v1.34 run them, so what is proven is what a production node does:

* the checkpoint claim is a PersistentVolume both nodes mount (a hostPath volume,
  since both nodes are this machine), its root owned by root with mode 1733 as
  deploy/checkpoints.yaml asks. A real kubelet applies no ``fsGroup`` to such a
  volume, so the runtime's init container alone must give each job its folder;
* team B's image is hostile: its ``/bin/sh`` runs first in the init container,
  which sees the claim's root, and tries from there to list the volume, list,
  read and overwrite team A's folder and plant a file in it, before doing what it
  was asked. Its rank then tries to reach A's folder from where it runs;
* a rank that fills its container's disk past its ``ephemeral-storage`` limit
  is evicted by the kubelet's eviction manager, alone, and its job says so;
* a process that double-forks and calls ``setsid`` dies with its pod: the
  container's PID namespace ends with its PID 1, which the host's process table
  shows (no process of the job's uid remains);
* an image absent from a node whose pull policy is ``Never`` waits as
  ``ErrImageNeverPull``, which fails the attempt at the start timeout;
* a drain's eviction of one rank (the Eviction API, as ``kubectl drain``
  calls it) is told apart from the runtime's own, and the gang guard stops the
  other rank gracefully.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from kubernetes import client

from preemption.models import Attempt, Job, JobState, Rank
from preemption.reconcile import reconcile_jobs
from preemption.runtimes.base import GangId, GangSpec, RuntimePermanentError
from preemption.runtimes.kubernetes import KubernetesRuntime
from preemption.runtimes.kubernetes.config import DEFAULT_JOB_UID_BASE, pod_name
from preemption.runtimes.kubernetes.policies import namespace_labels
from preemption.runtimes.kubernetes.spec import CHECKPOINT_FOLDER_CONTAINER, job_uid
from tests.k8s.test_k8s_disruption import _admitted_job
from tools.k8s import images
from tools.k8s.gangs import all_in, gang_spec
from tools.k8s.realnodes import RealNodes
from tools.k8s.volumes import bound_claim, delete_claim
from tools.k8s.wait import wait_for

MakeRuntime = Callable[..., KubernetesRuntime]
CLAIM = "qm-checkpoints"
MOUNT = "/checkpoints"
NODES = ("real-node-0", "real-node-1")
PROBE_REPOSITORY = "quartermaster.test/probe"
PROBE_TOOLS = ("dash", "cat", "sleep", "date", "ls", "mkdir", "setsid")
# Team A's folder, named as the control plane names them; team B's image knows it
# (the worst case: the names are not secret).
VICTIM_FOLDER = "job-951-5ca1ab1e0001"
OWN_FOLDER = "job-952-5ca1ab1e0002"

# The hostile image's /bin/sh: a script run by dash. Where the runtime mounts the
# claim's root (the init container) it first attacks team A's folder, each try's
# output and exit code on its own lines, then does what it was asked, as the real
# shell would.
HOSTILE_SH = f"""#!/usr/bin/dash
if [ "$3" = {CHECKPOINT_FOLDER_CONTAINER} ] && [ -n "$QM_CHECKPOINT_VOLUME" ]; then
    volume="$QM_CHECKPOINT_VOLUME"
    victim="$volume/{VICTIM_FOLDER}"
    echo "probe as uid $(cat /proc/self/status | while read key a b; do
        [ "$key" = Uid: ] && echo "$a"; done)"
    ls "$volume" 2>&1; echo "list-volume exit $?"
    ls "$victim" 2>&1; echo "list-other exit $?"
    cat "$victim/step_1.pt" 2>&1; echo "read-other exit $?"
    (echo poisoned > "$victim/step_1.pt") 2>&1; echo "overwrite-other exit $?"
    (echo planted > "$victim/state.json") 2>&1; echo "plant-other exit $?"
fi
exec /usr/bin/dash "$@"
"""

# Team A's rank keeps a checkpoint; team B's rank tries A's folder from its own
# filesystem, then writes its own checkpoint.
KEEP_COMMAND = 'echo "weights of A" > "$QM_CHECKPOINT_DIR/step_1.pt" && echo kept'
PROBE_COMMAND = f"""cat "{MOUNT}/{VICTIM_FOLDER}/step_1.pt" 2>&1; echo "rank-read-other exit $?"
(echo planted > "{MOUNT}/{VICTIM_FOLDER}/state.json") 2>&1; echo "rank-plant-other exit $?"
echo "weights of B" > "$QM_CHECKPOINT_DIR/step_1.pt"; echo "write-own exit $?"
cat "$QM_CHECKPOINT_DIR/step_1.pt"
"""


def _probe_files(wrapper: Path | None) -> dict[str, Path]:
    """Image path -> host file: the host's tools with their libraries, and /bin/sh:
    the wrapper, or else dash itself."""
    files: dict[str, Path] = {}
    for tool in PROBE_TOOLS:
        found = shutil.which(tool)
        assert found is not None, f"the host has no {tool} for the probe image"
        real = Path(found).resolve()
        files[f"usr/bin/{tool}"] = real
        for library in images._library_closure(real):
            files[images._canonical(library)] = library.resolve()
    files["usr/bin/sh"] = wrapper or files["usr/bin/dash"]
    return files


def probe_image(work: Path, *, hostile: bool) -> images.BuiltImage:
    """An image of the host's shell and tools (the rank image's, with ls, mkdir and
    setsid); a hostile one's /bin/sh is HOSTILE_SH. Cached by content like the rank
    image."""
    wrapper = None
    if hostile:
        wrapper = work / "hostile-sh"
        wrapper.write_text(HOSTILE_SH)
    files = _probe_files(wrapper)
    hasher = hashlib.sha256()
    for path, source in sorted(files.items()):
        hasher.update(path.encode() + b"\0" + hashlib.sha256(source.read_bytes()).digest())
    symlinks = {"bin": "usr/bin", "lib": "usr/lib", "lib64": "usr/lib64", "sbin": "usr/sbin"}
    dirs = {"tmp": 0o1777, "proc": 0o555, "sys": 0o555, "dev": 0o755, "etc": 0o755}

    def build(name: str, archive: Path) -> None:
        layer = images._layer(files, symlinks, dirs)
        images._oci_archive(name, layer, ["/bin/sh"], archive)

    return images._cached(PROBE_REPOSITORY, hasher.hexdigest(), build)


@pytest.fixture(scope="module")
def tools_images(real_nodes: RealNodes) -> dict[str, str]:
    """The names of the honest ("tools") and the hostile image, imported into every
    real node's containerd."""
    with tempfile.TemporaryDirectory(prefix="qm-probe-") as work:
        built = {
            "tools": probe_image(Path(work), hostile=False),
            "hostile": probe_image(Path(work), hostile=True),
        }
    for node, image in [(n, i) for n in real_nodes.nodes for i in built.values()]:
        result = subprocess.run(
            [
                *("ctr", "--address", str(node.socket), "--namespace", "k8s.io"),
                *("images", "import", str(image.archive)),
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
    return {kind: image.name for kind, image in built.items()}


@pytest.fixture
def restricted(k8s_api: client.ApiClient, namespace: str) -> str:
    """The test's namespace, enforcing the "restricted" Pod Security Standard."""
    client.CoreV1Api(k8s_api).patch_namespace(
        namespace, {"metadata": {"labels": namespace_labels()}}
    )
    return namespace


@pytest.fixture
def volume(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The checkpoint volume's folder on this machine (both nodes' host): root-owned,
    mode 1733, below folders every job's uid may pass through."""
    base = Path(tempfile.mkdtemp(prefix="qm-ckpt-", dir="/var/tmp"))
    base.chmod(0o711)
    folder = base / "volume"
    folder.mkdir()
    folder.chmod(0o1733)
    yield folder
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def claim(k8s_api: client.ApiClient, restricted: str, volume: Path) -> Iterator[str]:
    """A ReadWriteMany claim bound to a hostPath PersistentVolume at ``volume``, bound
    by hand as the test control plane runs no binder (tools.k8s.volumes)."""
    name = bound_claim(k8s_api, restricted, CLAIM, host_path=volume)
    yield CLAIM
    delete_claim(k8s_api, restricted, CLAIM, name)


@pytest.fixture
def small_runtime(make_runtime: MakeRuntime, real_nodes: RealNodes) -> MakeRuntime:
    """Runtimes with per-GPU requests two nodes of a 2-core machine can hold, set as an
    operator would (QM_K8S_DEFAULT_CPU_PER_GPU...): no other change to the runtime."""

    def make(**settings: Any) -> KubernetesRuntime:
        settings.setdefault("default_image", real_nodes.rank_image)
        settings.setdefault("default_cpu_per_gpu", "50m")
        settings.setdefault("default_memory_per_gpu", "32Mi")
        settings.setdefault("default_ephemeral_storage_per_gpu", "32Mi")
        return make_runtime(**settings)

    return make


def _job(
    job_id: int, node: str, *, team: str, folder: str | None, command: str, image: str
) -> GangSpec:
    """A one-rank gang of ``team`` on ``node`` checkpointing to ``folder`` of the claim."""
    base = gang_spec(job_id, {node: 1}, command=command, grace_seconds=3)
    env = dict(base.env)
    if folder is not None:
        env["QM_CHECKPOINT_DIR"] = f"{MOUNT}/{folder}"
    return dataclasses.replace(base, team=team, env=env, image=image)


def _digest(folder: Path) -> str:
    """Every file's name and content under ``folder``, hashed."""
    hasher = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        hasher.update(str(path.relative_to(folder)).encode() + b"\0")
        if path.is_file():
            hasher.update(path.read_bytes())
    return hasher.hexdigest()


def _init_log(core: client.CoreV1Api, namespace: str, gang: GangId) -> str:
    return str(
        core.read_namespaced_pod_log(
            pod_name(gang, 0), namespace, container=CHECKPOINT_FOLDER_CONTAINER
        )
    )


def _wait_exited(runtime: KubernetesRuntime, gang: GangId, size: int = 1) -> None:
    try:
        wait_for(lambda: all_in(runtime, gang, "exited", size), timeout=60, what="ranks exited")
    except TimeoutError as error:
        namespace = runtime.settings.namespace
        events = runtime.core.list_namespaced_event(namespace).items
        said = "\n".join(f"{e.involved_object.name}: {e.reason}: {e.message}" for e in events)
        raise AssertionError(f"{error}: {runtime.observe(gang)}\n{said}") from None


def _log_with(runtime: KubernetesRuntime, gang: GangId, rank: int, needle: bytes) -> bytes:
    """The rank's log once it holds ``needle``: containerd finishes writing a log a
    moment after its container ends."""
    try:
        wait_for(
            lambda: needle in runtime.read_log(gang, rank),
            timeout=30,
            interval=0.2,
            what=f"{needle!r} in the log of rank {rank}",
        )
    except TimeoutError as error:
        # Whether the container ended by its own exit or by the kill tells a lost log
        # line from a signal that never reached it.
        pod = runtime.core.read_namespaced_pod(pod_name(gang, rank), runtime.settings.namespace)
        states = [status.state for status in pod.status.container_statuses or []]
        log = runtime.read_log(gang, rank)[-2000:]
        raise AssertionError(f"{error}: container states {states}; log {log!r}") from None
    return runtime.read_log(gang, rank)


def test_a_hostile_rank_of_another_team_cannot_list_read_overwrite_or_plant_in_a_jobs_folder(
    small_runtime: MakeRuntime,
    real_nodes: RealNodes,
    tools_images: dict[str, str],
    k8s_api: client.ApiClient,
    restricted: str,
    claim: str,
    volume: Path,
) -> None:
    core = client.CoreV1Api(k8s_api)
    runtime = small_runtime(checkpoint_claim=claim, checkpoint_mount_path=MOUNT)
    keeper = _job(
        951, NODES[0], team="vision", folder=VICTIM_FOLDER, command=KEEP_COMMAND,
        image=tools_images["tools"],
    )  # fmt: skip
    runtime.launch(keeper)
    _wait_exited(runtime, keeper.gang)
    assert [o.exit_code for o in runtime.observe(keeper.gang)] == [0]
    assert b"kept" in _log_with(runtime, keeper.gang, 0, b"kept")
    uid_a = job_uid(DEFAULT_JOB_UID_BASE, 951)
    victim = volume / VICTIM_FOLDER
    # The init container, as the job's uid, made the folder: the kubelet applied no
    # fsGroup to this volume, and made no folder as root.
    assert (victim.stat().st_uid, victim.stat().st_gid) == (uid_a, uid_a)
    assert victim.stat().st_mode & 0o7777 == 0o700
    assert (victim / "step_1.pt").read_text() == "weights of A\n"
    before = _digest(victim)

    attacker = _job(
        952,
        NODES[1],
        team="nlp",
        folder=OWN_FOLDER,
        command=PROBE_COMMAND,
        image=tools_images["hostile"],
    )
    runtime.launch(attacker)
    _wait_exited(runtime, attacker.gang)
    uid_b = job_uid(DEFAULT_JOB_UID_BASE, 952)
    probed = _init_log(core, restricted, attacker.gang)
    print(probed)
    attempts = dict(re.findall(r"^(\S+) exit (\d+)$", probed, re.MULTILINE))
    assert f"probe as uid {uid_b}" in probed
    # ls exits 2 and cat 1 on a refused open; the shell 2 on a refused redirection.
    assert attempts == {
        "list-volume": "2",
        "list-other": "2",
        "read-other": "1",
        "overwrite-other": "2",
        "plant-other": "2",
    }, probed
    refusals = re.findall(r"Permission denied", probed)
    assert len(refusals) == 5, probed
    assert "weights of A" not in probed and VICTIM_FOLDER + "\n" not in probed

    ranked = _log_with(runtime, attacker.gang, 0, b"weights of B").decode()
    print(ranked)
    # From the rank's own filesystem A's folder is not there at all: only B's folder
    # of the volume is mounted, where B's trap writes.
    assert re.search(r"No such file or directory\nrank-read-other exit 1", ranked), ranked
    assert re.search(r"Directory nonexistent\nrank-plant-other exit 2", ranked), ranked
    assert "write-own exit 0\nweights of B" in ranked
    assert [o.exit_code for o in runtime.observe(attacker.gang)] == [0]

    # Nothing of A changed; B's own checkpoint is where it belongs, owned by B.
    assert _digest(victim) == before
    assert sorted(p.name for p in victim.iterdir()) == ["step_1.pt"]
    own = volume / OWN_FOLDER
    assert (own.stat().st_uid, own.stat().st_mode & 0o7777) == (uid_b, 0o700)
    assert (own / "step_1.pt").read_text() == "weights of B\n"
    assert (own / "step_1.pt").stat().st_uid == uid_b
    runtime.forget(keeper.gang)
    runtime.forget(attacker.gang)


def test_a_job_pointed_at_another_jobs_folder_never_runs(
    small_runtime: MakeRuntime,
    tools_images: dict[str, str],
    k8s_api: client.ApiClient,
    restricted: str,
    claim: str,
    volume: Path,
) -> None:
    runtime = small_runtime(checkpoint_claim=claim, checkpoint_mount_path=MOUNT)
    image = tools_images["tools"]
    keeper = _job(
        953, NODES[0], team="vision", folder=VICTIM_FOLDER, command=KEEP_COMMAND, image=image
    )
    runtime.launch(keeper)
    _wait_exited(runtime, keeper.gang)
    before = _digest(volume / VICTIM_FOLDER)
    # The same folder as the checkpoint dir of a job of another team.
    squatter = _job(
        954, NODES[1], team="nlp", folder=VICTIM_FOLDER,
        command='cat "$QM_CHECKPOINT_DIR/step_1.pt"; echo ran', image=image,
    )  # fmt: skip
    runtime.launch(squatter)
    _wait_exited(runtime, squatter.gang)
    [observed] = runtime.observe(squatter.gang)
    assert observed.exit_code == 1
    assert runtime.read_log(squatter.gang, 0) == b""
    said = _init_log(client.CoreV1Api(k8s_api), restricted, squatter.gang)
    assert f"cannot make the checkpoint folder {VICTIM_FOLDER} as uid" in said, said
    assert _digest(volume / VICTIM_FOLDER) == before
    runtime.forget(keeper.gang)
    runtime.forget(squatter.gang)


def test_a_gang_setting_nvidia_visible_devices_is_refused_before_any_pod_exists(
    small_runtime: MakeRuntime, k8s_api: client.ApiClient, restricted: str
) -> None:
    runtime = small_runtime()
    spec = gang_spec(955, {NODES[0]: 1, NODES[1]: 1})
    spec = dataclasses.replace(spec, env={**spec.env, "NVIDIA_VISIBLE_DEVICES": "all"})
    with pytest.raises(RuntimePermanentError, match="qm-955-1 sets NVIDIA_VISIBLE_DEVICES"):
        runtime.launch(spec)
    core = client.CoreV1Api(k8s_api)
    assert core.list_namespaced_pod(restricted).items == []
    assert (
        core.list_namespaced_config_map(restricted, label_selector="quartermaster.dev/gang").items
        == []
    )


# Rank 0 writes about 50 MB into its container's writable layer (cat grows a file
# fourfold: the image has no dd), then waits; rank 1 only waits.
FILL_COMMAND = r"""if [ "$RANK" = 0 ]; then
    cd /tmp
    echo 0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef > a
    i=0
    while [ $i -lt 9 ]; do cat a a a a > b; cat b > a; i=$((i + 1)); done
    cat a > c
    echo "filled"
fi
while :; do sleep 0.2; done
"""
QUIET_COMMAND = "echo quiet; while :; do sleep 0.2; done"


def test_a_rank_filling_its_disk_past_its_limit_is_evicted_alone_and_its_job_says_why(
    world: Any,
    small_runtime: MakeRuntime,
    k8s_api: client.ApiClient,
    restricted: str,
) -> None:
    core = client.CoreV1Api(k8s_api)
    runtime = small_runtime(default_ephemeral_storage_per_gpu="16Mi")
    job, attempt = _admitted_job(world, list(NODES))
    Job.objects.filter(pk=job.pk).update(command=FILL_COMMAND)
    gang = GangId(job.pk, 1)
    bystander = gang_spec(957, {NODES[0]: 1}, command=QUIET_COMMAND, grace_seconds=3)
    bystander = dataclasses.replace(bystander, team="nlp")
    runtime.launch(bystander)
    reconcile_jobs(runtime=runtime)  # launches the filling job
    wait_for(lambda: all_in(runtime, bystander.gang, "running", 1), timeout=60, what="bystander")
    began = time.monotonic()

    def evicted() -> bool:
        pod = core.read_namespaced_pod(pod_name(gang, 0), restricted)
        return pod.status.reason == "Evicted"

    wait_for(evicted, timeout=120, interval=1, what="the kubelet to evict the filling rank")
    waited = time.monotonic() - began
    pod = core.read_namespaced_pod(pod_name(gang, 0), restricted)
    print(f"evicted {waited:.0f} s after launch: {pod.status.message}")
    assert "ephemeral" in pod.status.message
    assert "16Mi" in pod.status.message
    # The kubelet sets no DisruptionTarget condition here, only the pod's reason; the
    # runtime reports it, and the gang guard stops the job's other rank.
    assert runtime.disruptions(gang) == {0: f"Evicted: {pod.status.message.strip()}"}
    deadline = time.monotonic() + 60
    while Attempt.objects.get(pk=attempt.pk).ended_at is None:
        assert time.monotonic() < deadline, "the attempt never ended"
        reconcile_jobs(runtime=runtime)
        time.sleep(0.3)
    attempt.refresh_from_db()
    assert attempt.end_reason == Attempt.EndReason.GANG_GUARD
    ranks = list(Rank.objects.filter(attempt=attempt).order_by("index"))
    print(f"ranks: {[(r.state, r.exit_code, r.end_reason) for r in ranks]}")
    assert [r.end_reason for r in ranks] == [Rank.EndReason.DISK_LIMIT, ""]
    assert ranks[1].state == "exited" and ranks[1].signal_sent_at is not None
    job.refresh_from_db()
    words = "rank 0 was evicted by its node: it wrote more than its ephemeral-storage limit"
    assert f"gang guard: {words}" in job.waiting_reason, job.waiting_reason

    # The other team's job, on the same node, runs on untouched.
    [quiet] = runtime.observe(bystander.gang)
    assert quiet.phase == "running" and quiet.signal_sent_at is None
    bystander_pod = core.read_namespaced_pod(pod_name(bystander.gang, 0), restricted)
    assert bystander_pod.status.phase == "Running" and bystander_pod.status.reason is None
    assert runtime.disruptions(bystander.gang) == {}
    runtime.kill(bystander.gang)
    runtime.forget(bystander.gang)


ESCAPE_COMMAND = r"""(setsid sleep 1007 </dev/null >/dev/null 2>&1 &)
echo escaped
while :; do sleep 0.2; done
"""


def _processes_of(uid: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["uids", "cmdline"]):
        uids = process.info["uids"]
        if uids is not None and uid in (uids.real, uids.effective):
            found.append(process)
    return found


def test_a_double_forked_setsid_process_does_not_outlive_its_pod(
    small_runtime: MakeRuntime, tools_images: dict[str, str], restricted: str
) -> None:
    runtime = small_runtime(default_image=tools_images["tools"])
    spec = gang_spec(958, {NODES[0]: 1}, command=ESCAPE_COMMAND, grace_seconds=3)
    runtime.launch(spec)
    wait_for(lambda: all_in(runtime, spec.gang, "running", 1), timeout=60, what="rank running")
    _log_with(runtime, spec.gang, 0, b"escaped")
    uid = job_uid(DEFAULT_JOB_UID_BASE, 958)
    wait_for(
        lambda: any(p.info["cmdline"] == ["sleep", "1007"] for p in _processes_of(uid)),
        timeout=10,
        what="the escaped process on the host",
    )
    [escaped] = [p for p in _processes_of(uid) if p.info["cmdline"] == ["sleep", "1007"]]
    # In a session and process group of its own: the rank's process group, which the
    # entrypoint passes SIGTERM to, does not hold it.
    assert os.getsid(escaped.pid) == escaped.pid == os.getpgid(escaped.pid)

    runtime.signal(spec.gang, 3)
    _wait_exited(runtime, spec.gang)
    wait_for(lambda: not _processes_of(uid), timeout=10, interval=0.1, what="no process of uid")
    assert not psutil.pid_exists(escaped.pid) or escaped.status() == psutil.STATUS_ZOMBIE
    runtime.forget(spec.gang)


def test_an_image_a_node_lacks_with_pull_policy_never_fails_the_attempt_at_the_start_timeout(
    world: Any,
    small_runtime: MakeRuntime,
    k8s_api: client.ApiClient,
    restricted: str,
    settings: Any,
) -> None:
    settings.QM_START_TIMEOUT_SECONDS = 3
    runtime = small_runtime(image_pull_policy="Never")
    job, attempt = _admitted_job(world, list(NODES), image="registry.invalid/vision/absent:1")
    reconcile_jobs(runtime=runtime)
    gang = GangId(job.pk, 1)
    pod = client.CoreV1Api(k8s_api).read_namespaced_pod(pod_name(gang, 0), restricted)
    assert [c.image_pull_policy for c in pod.spec.containers] == ["Never"]
    wait_for(
        lambda: {o.waiting_reason for o in runtime.observe(gang)} == {"ErrImageNeverPull"},
        timeout=60,
        what="the kubelets to refuse to pull",
    )
    deadline = time.monotonic() + 60
    while Attempt.objects.get(pk=attempt.pk).ended_at is None:
        assert time.monotonic() < deadline, "the stuck attempt never ended"
        reconcile_jobs(runtime=runtime)
        time.sleep(0.3)
    attempt.refresh_from_db()
    assert attempt.end_reason == Attempt.EndReason.GANG_GUARD
    job.refresh_from_db()
    assert job.state == JobState.REQUEUED
    assert "rank 0 could not start: ErrImageNeverPull for over 3 s" in job.waiting_reason


RANK_COMMAND = r"""trap 'echo "caught-term $(date +%s.%N)"; exit 0' TERM
echo "started"
while :; do sleep 0.1; done
"""
# Takes 3 s to stop, as a checkpoint does (within the eviction's 5 s grace): a rank that
# ends the instant it is signalled may already be gone when a loaded machine looks.
SLOW_STOP_RANK_COMMAND = r"""trap 'echo "caught-term $(date +%s.%N)"; sleep 3; exit 0' TERM
echo "started"
while :; do sleep 0.1; done
"""


def test_a_drain_evicting_one_rank_is_not_taken_for_our_own_signal_and_the_guard_stops_the_rest(
    small_runtime: MakeRuntime, k8s_api: client.ApiClient, restricted: str
) -> None:
    core = client.CoreV1Api(k8s_api)
    runtime = small_runtime()
    spec = gang_spec(959, {NODES[0]: 1, NODES[1]: 1}, command=RANK_COMMAND, grace_seconds=3)
    runtime.launch(spec)
    gang = spec.gang
    wait_for(lambda: all_in(runtime, gang, "running", 2), timeout=60, what="ranks running")
    for rank in (0, 1):
        _log_with(runtime, gang, rank, b"started")

    # kubectl drain real-node-0: an Eviction of the pods there, with no grace given
    # (the pod's own terminationGracePeriodSeconds applies).
    core.create_namespaced_pod_eviction(
        pod_name(gang, 0),
        restricted,
        {"apiVersion": "policy/v1", "kind": "Eviction",
         "metadata": {"name": pod_name(gang, 0), "namespace": restricted}},
    )  # fmt: skip
    wait_for(
        lambda: runtime.observe(gang)[0].phase in ("terminating", "exited"),
        timeout=30,
        what="the drained rank to stop",
    )
    assert runtime.disruptions(gang)[0] == "EvictionByEvictionAPI"
    drained = runtime.observe(gang)[0]
    assert drained.signal_sent_at is None, "a drain's eviction was taken as our own signal"
    assert runtime.guard_victims() == [gang]
    assert runtime.enforce_gang_guard(lambda _: 3) == [gang]
    _wait_exited(runtime, gang, 2)
    caught = _log_with(runtime, gang, 1, b"caught-term")
    assert b"caught-term" in caught
    status = core.read_namespaced_pod(pod_name(gang, 1), restricted).status
    assert status.container_statuses[0].state.terminated.exit_code == 0
    assert [o.exit_code for o in runtime.observe(gang)] == [0, 0]
    assert runtime.observe(gang)[1].signal_sent_at is not None
    assert runtime.guard_victims() == []
    runtime.forget(gang)


def test_every_rank_evicted_with_no_signal_on_record_is_not_our_own_signal(
    small_runtime: MakeRuntime, k8s_api: client.ApiClient, restricted: str
) -> None:
    """Every rank evicted and no signal on the gang's record: a drain of every rank,
    not the runtime's own signal, which writes the record before its first eviction
    (tests/k8s/realnodes/test_real_drain.py has the runtime's own eviction seen by a
    restarted worker). No rank is left for the guard to stop."""
    core = client.CoreV1Api(k8s_api)
    runtime = small_runtime()
    spec = gang_spec(
        960, {NODES[0]: 1, NODES[1]: 1}, command=SLOW_STOP_RANK_COMMAND, grace_seconds=5
    )
    runtime.launch(spec)
    gang = spec.gang
    wait_for(lambda: all_in(runtime, gang, "running", 2), timeout=60, what="ranks running")
    for rank in (0, 1):
        _log_with(runtime, gang, rank, b"started")
    for rank in (0, 1):
        core.create_namespaced_pod_eviction(
            pod_name(gang, rank),
            restricted,
            {"apiVersion": "policy/v1", "kind": "Eviction",
             "metadata": {"name": pod_name(gang, rank), "namespace": restricted},
             "deleteOptions": {"gracePeriodSeconds": 5}},
        )  # fmt: skip
    other = small_runtime()
    observed = other.observe(gang)
    assert [o.phase for o in observed] == ["terminating", "terminating"], observed
    assert all(o.signal_sent_at is None for o in observed), observed
    assert other.taken_ranks(gang) == {0: "EvictionByEvictionAPI", 1: "EvictionByEvictionAPI"}
    assert other.guard_victims() == []
    _wait_exited(other, gang, 2)
    other.forget(gang)
