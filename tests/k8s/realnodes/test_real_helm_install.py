"""The project's image, built here, installed with its Helm chart on two real nodes,
and one job driven end to end through the installed portal's API.

``tools.k8s.portal_image`` builds the ``Containerfile`` on a base image made from
Debian's packages (no registry), and the nodes import it. ``helm install`` puts the
chart's web, worker and beat on those nodes with their own service accounts; they
reach PostgreSQL, Redis and the API server through relays on the pods' bridge
(``tools.k8s.relays``: this cluster has no kube-proxy), and the ranks reach the
portal's web pod the same way, at ``portal.publicUrl``. An admin made with
``manage.py createsuperuser`` in the web pod (deploy/README.md, "Check that it
works") then sets up a flavor, the two nodes, a team and its quota through the REST
API, submits a training job of two ranks (the portal image's own Python and
``examples/train_ddp.py``, gracetrap from the image's wheel, torch from the host's
virtual environment mounted read-only: the one thing not in the image) and then a
critical job that needs its GPUs. The installed worker evicts the job's pods; each
real kubelet delivers SIGTERM; the ranks agree on a step, save it and exit 0; the
job resumes from that step once the critical job is done, and finishes.

It takes about 4 minutes of both cores (the image build, the portal's pods, the
job), which beside the PostgreSQL run took ``make test`` past its time, so ``make
test`` leaves it out (marker ``real_helm``); ``make helm-real`` runs it.
"""

from __future__ import annotations

import re
import secrets
import sysconfig
import time
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import requests
import yaml
from kubernetes import client
from kubernetes.stream import stream

from tests.k8s.conftest import Helm, delete_namespace
from tests.k8s.realnodes.conftest import require_real_nodes
from tools.k8s.controlplane import REPO_ROOT, ControlPlane
from tools.k8s.portal_image import PortalImage, build_portal_image
from tools.k8s.realnodes import RealNodes
from tools.k8s.relays import Relays
from tools.k8s.volumes import bound_claim, delete_claim
from tools.k8s.wait import wait_for

CHART = REPO_ROOT / "deploy" / "helm" / "quartermaster"
NODE_NAMES = ("helm-node-0", "helm-node-1")
GPUS_PER_NODE = 2
FLAVOR = "helm-gpu"
FLAVOR_LABEL = "quartermaster.dev/flavor"
RELEASE = "qm"
TEAM = "helm"
PASSWORD = secrets.token_urlsafe(16)
# A Redis database of its own: the installed worker and beat must not meet the
# test session's queues.
REDIS_DB = 11
# The job: two ranks of 2 GPUs, one per node, long enough to be preempted mid-run.
STEPS = 160
STEP_SLEEP = 0.2
SAVE_EVERY = 20

pytestmark = [pytest.mark.real_helm, pytest.mark.timeout(1200)]


@dataclass
class Installed:
    """The installed portal as the test reaches it."""

    url: str
    namespace: str
    jobs_namespace: str
    image: PortalImage
    site_packages: str
    timings: dict[str, float]


@pytest.fixture(scope="module")
def portal_image() -> PortalImage:
    require_real_nodes()
    return build_portal_image()


@pytest.fixture(scope="module")
def site_packages() -> str:
    """The host's virtual environment's packages (torch among them), by their real path."""
    return str(Path(sysconfig.get_paths()["purelib"]).resolve())


@pytest.fixture(scope="module")
def helm_nodes(
    control_plane: ControlPlane,
    tmp_path_factory: pytest.TempPathFactory,
    portal_image: PortalImage,
    site_packages: str,
) -> Iterator[RealNodes]:
    nodes = RealNodes(
        control_plane,
        tmp_path_factory.mktemp("helm"),
        names=NODE_NAMES,
        gpus=GPUS_PER_NODE,
        flavor=FLAVOR,
        host_mounts=((site_packages, False),),
        image_archives=(portal_image.archive,),
        controllers=("endpointslice-controller", "deployment-controller", "replicaset-controller"),
    )
    nodes.start()
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    """An empty PostgreSQL database of its own, as the chart's prerequisites ask."""
    name = f"qm_helm_{uuid.uuid4().hex[:8]}"
    admin = "postgres://quartermaster:quartermaster@127.0.0.1:5432/postgres"
    with psycopg.connect(admin, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        with psycopg.connect(admin, autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def deployments_ready(apps: client.AppsV1Api, namespace: str) -> bool:
    found = apps.list_namespaced_deployment(namespace).items
    return len(found) == 3 and all(
        (d.status.available_replicas or 0) >= (d.spec.replicas or 1) for d in found
    )


def pod_of(core: client.CoreV1Api, namespace: str, component: str) -> client.V1Pod:
    pods = core.list_namespaced_pod(
        namespace, label_selector=f"app.kubernetes.io/component={component}"
    ).items
    running = [
        p for p in pods if p.status.phase == "Running" and p.metadata.deletion_timestamp is None
    ]
    assert len(running) == 1, [(p.metadata.name, p.status.phase) for p in pods]
    return running[0]


def describe(core: client.CoreV1Api, namespace: str) -> str:
    """The namespace's pods, each container's state and the last lines of its log,
    for a failure's message."""
    lines = []
    for pod in core.list_namespaced_pod(namespace).items:
        lines.append(f"{pod.metadata.name}: {pod.status.phase} on {pod.spec.node_name}")
        statuses = [
            *(pod.status.init_container_statuses or []),
            *(pod.status.container_statuses or []),
        ]
        for status in statuses:
            lines.append(f"  {status.name}: {status.state}")
            try:
                log = core.read_namespaced_pod_log(
                    pod.metadata.name, namespace, container=status.name, tail_lines=20
                )
            except client.ApiException as error:
                log = f"(no log: {error.reason})"
            lines.append("    " + log.replace("\n", "\n    "))
    return "\n".join(lines)


@pytest.fixture(scope="module")
def installed(
    k8s_api: client.ApiClient,
    control_plane: ControlPlane,
    helm: Helm,
    helm_nodes: RealNodes,
    portal_image: PortalImage,
    database: str,
    site_packages: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Installed]:
    core, apps = client.CoreV1Api(k8s_api), client.AppsV1Api(k8s_api)
    token = uuid.uuid4().hex[:6]
    namespace, jobs_namespace = f"qm-helm-system-{token}", f"qm-helm-jobs-{token}"
    timings: dict[str, float] = {}
    assert control_plane.state is not None
    api_port = control_plane.state.apiserver_port
    folder = tmp_path_factory.mktemp("helm-checkpoints")
    volume = folder / "volume"
    volume.mkdir()
    volume.chmod(0o1733)
    with Relays(helm_nodes.dns_address) as relays:
        postgres = relays.add("127.0.0.1", 5432)
        redis = relays.add("127.0.0.1", 6379)
        api = relays.add("127.0.0.1", api_port)
        # The web pod's address is known only once it runs; its relay's port is
        # needed before (publicUrl), so it is taken now and filled in below.
        web_port = relays.reserve()
        url = f"http://{helm_nodes.dns_address}:{web_port}"
        for name, labels in (
            (namespace, {}),
            (jobs_namespace, {"pod-security.kubernetes.io/enforce": "restricted"}),
        ):
            core.create_namespace({"metadata": {"name": name, "labels": labels}})
        claim_volume = bound_claim(k8s_api, jobs_namespace, "qm-checkpoints", host_path=volume)
        core.create_namespaced_secret(
            namespace,
            {
                "metadata": {"name": "quartermaster-secrets"},
                "stringData": {
                    "SECRET_KEY": secrets.token_urlsafe(50),
                    "DATABASE_URL": (
                        "postgres://quartermaster:quartermaster@"
                        f"{helm_nodes.dns_address}:{postgres}/{database}"
                    ),
                    "CELERY_BROKER_URL": f"redis://{helm_nodes.dns_address}:{redis}/{REDIS_DB}",
                },
            },
        )
        on_helm_nodes = {FLAVOR_LABEL: FLAVOR}
        repository, tag = portal_image.name.rsplit(":", 1)
        values = {
            "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
            "portal": {
                "publicUrl": url,
                "allowedHosts": [helm_nodes.dns_address],
                "csrfTrustedOrigins": [url],
                "proxyCount": 0,
                "extraEnv": [
                    # No kube-proxy here: the API server's relay stands for the
                    # kubernetes Service (its certificate names the bridge address).
                    {"name": "KUBERNETES_SERVICE_HOST", "value": helm_nodes.dns_address},
                    {"name": "KUBERNETES_SERVICE_PORT", "value": str(api)},
                    # The relay speaks plain HTTP where an ingress would end TLS.
                    {"name": "SECURE_SSL_REDIRECT", "value": "false"},
                ],
            },
            "runtime": {
                "jobsNamespace": jobs_namespace,
                "createJobsNamespace": False,
                "startTimeoutSeconds": 180,
                "defaultCpuPerGpu": "500m",
                "defaultMemoryPerGpu": "1Gi",
                "defaultEphemeralStoragePerGpu": "256Mi",
                "imagePullPolicy": "Never",
                "events": {"cidrs": [f"{helm_nodes.dns_address}/32"], "port": web_port},
            },
            "web": {"replicas": 1, "workers": 2, "nodeSelector": on_helm_nodes},
            "worker": {"replicas": 1, "concurrency": 2, "nodeSelector": on_helm_nodes},
            "beat": {"nodeSelector": on_helm_nodes},
        }
        values_file = folder / "values.yaml"
        values_file.write_text(yaml.safe_dump(values))
        try:
            started = time.monotonic()
            result = helm.run(
                "install", RELEASE, str(CHART), "--namespace", namespace,
                "--values", str(values_file), "--kubeconfig", control_plane.state.kubeconfig,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
            timings["helm install"] = time.monotonic() - started
            try:
                wait_for(
                    lambda: deployments_ready(apps, namespace),
                    timeout=420,
                    interval=2,
                    what="web, worker and beat available",
                )
            except TimeoutError as error:
                raise AssertionError(f"{error}\n{describe(core, namespace)}") from None
            timings["portal ready"] = time.monotonic() - started
            web = pod_of(core, namespace, "web")
            relays.add(web.status.pod_ip, 8000, port=web_port)
            yield Installed(url, namespace, jobs_namespace, portal_image, site_packages, timings)
        finally:
            helm.run(
                "uninstall", RELEASE, "--namespace", namespace, "--wait",
                "--kubeconfig", control_plane.state.kubeconfig,
            )  # fmt: skip
            delete_claim(k8s_api, jobs_namespace, "qm-checkpoints", claim_volume)
            delete_namespace(core, jobs_namespace, timeout=120)
            delete_namespace(core, namespace, timeout=120)


def exec_in(k8s_api: client.ApiClient, pod: client.V1Pod, command: list[str]) -> str:
    return str(
        stream(
            client.CoreV1Api(k8s_api).connect_get_namespaced_pod_exec,
            pod.metadata.name,
            pod.metadata.namespace,
            command=command,
            container=pod.spec.containers[0].name,
            stderr=True,
            stdin=False,
            stdout=True,
            tty=False,
        )
    )


class Api:
    """The installed portal's REST API, as an admin's script calls it."""

    def __init__(self, url: str, token: str = "") -> None:
        self.url = url
        self.session = requests.Session()
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        answer = self.session.request(method, f"{self.url}/api/v1/{path}", json=body, timeout=30)
        assert answer.status_code < 300, f"{method} {path}: {answer.status_code} {answer.text}"
        return answer.json() if answer.content else None

    def submit(
        self,
        name: str,
        priority_class: str,
        ranks: int,
        image: str,
        command: str,
        env: dict[str, str] | None = None,
    ) -> Any:
        """A job of the team on the nodes' flavor, ``ranks`` ranks of a node's GPUs each."""
        body = {
            "name": name,
            "team": TEAM,
            "flavor": FLAVOR,
            "priority_class": priority_class,
            "ranks": ranks,
            "gpus_per_rank": GPUS_PER_NODE,
            "image": image,
            "command": command,
            "env": env or {},
        }
        return self.call("post", "jobs/", body)


def test_the_installed_portal_preempts_and_resumes_a_job_on_real_pods(
    k8s_api: client.ApiClient, installed: Installed, helm_nodes: RealNodes
) -> None:
    core = client.CoreV1Api(k8s_api)
    web = pod_of(core, installed.namespace, "web")
    made = exec_in(
        k8s_api,
        web,
        [
            "env", f"DJANGO_SUPERUSER_PASSWORD={PASSWORD}",
            "python", "manage.py", "createsuperuser", "--noinput",
            "--username", "admin", "--email", "admin@example.org",
        ],
    )  # fmt: skip
    assert "Superuser created" in made, made
    login = Api(installed.url).call(
        "post", "tokens/login/", {"username": "admin", "password": PASSWORD, "name": "helm test"}
    )
    api = Api(installed.url, login["token"])

    api.call("post", "flavors/", {"name": FLAVOR})
    for name in NODE_NAMES:
        api.call("post", "nodes/", {"name": name, "flavor": FLAVOR, "gpus": GPUS_PER_NODE})
    team = api.call("post", "teams/", {"slug": TEAM, "name": "Helm"})
    api.call(
        "patch",
        f"teams/{team['id']}/priority-classes/",
        {
            "priority_classes": ["ai-batch-preemptible", "ai-prod-critical"],
            "default_priority_class": "ai-batch-preemptible",
        },
    )
    capacity = len(NODE_NAMES) * GPUS_PER_NODE
    api.call("post", "quotas/", {"team": TEAM, "flavor": FLAVOR, "guarantee": capacity})
    policy = api.call("get", "scheduling-policy/")
    if policy.get("priority_min_runtime_seconds"):
        api.call("patch", "scheduling-policy/", {"priority_min_runtime_seconds": 0})

    version = tomllib.loads((REPO_ROOT / "gracetrap" / "pyproject.toml").read_text())["project"][
        "version"
    ]
    wheel = f"/opt/quartermaster/wheels/gracetrap-{version}-py3-none-any.whl"
    env = {"PYTHONPATH": f"{wheel}:{installed.site_packages}"}
    train = (
        f"python /app/examples/train_ddp.py --steps {STEPS} --step-sleep {STEP_SLEEP} "
        f"--save-every {SAVE_EVERY}"
    )
    job = api.submit("trainer", "ai-batch-preemptible", 2, installed.image.name, train, env)

    def detail() -> dict[str, Any]:
        return dict(api.call("get", f"jobs/{job['id']}/"))

    def checkpointed() -> dict[str, Any] | None:
        found = detail()
        return found if found["state"] == "running" and found["checkpoint_step"] else None

    try:
        running = wait_for(checkpointed, timeout=300, interval=2, what="the job's first checkpoint")
    except TimeoutError as error:
        raise AssertionError(
            f"{error}: {detail()}\n{describe(core, installed.jobs_namespace)}"
        ) from None
    first = running["attempts"][0]
    assert {rank["node"] for rank in first["ranks"]} == set(NODE_NAMES)
    pods = core.list_namespaced_pod(installed.jobs_namespace).items
    assert {p.spec.node_name for p in pods if p.status.phase == "Running"} == set(NODE_NAMES)

    critical = api.submit(
        "critical",
        "ai-prod-critical",
        1,
        installed.image.name,
        "python -c 'import time; time.sleep(3)'",
    )

    def finished() -> dict[str, Any] | None:
        found = detail()
        return found if found["state"] in ("succeeded", "failed", "cancelled") else None

    try:
        done = wait_for(
            finished, timeout=420, interval=3, what="the job to finish after its preemption"
        )
    except TimeoutError as error:
        raise AssertionError(
            f"{error}: {detail()}\n{describe(core, installed.jobs_namespace)}"
        ) from None
    assert done["state"] == "succeeded", done
    attempts = sorted(done["attempts"], key=lambda a: a["number"])
    assert len(attempts) == 2, attempts
    preempted, resumed = attempts
    assert preempted["end_reason"] == "preempted", preempted
    assert f"preempted by job {critical['id']} of {TEAM} (ai-prod-critical" in (
        preempted["preempted_because"] or ""
    ), preempted
    # Every rank caught its kubelet's SIGTERM (or its gang's word), saved, and exited 0.
    assert [r["exit_code"] for r in preempted["ranks"]] == [0, 0], preempted["ranks"]
    step = preempted["checkpoint_step"]
    assert step is not None and 0 < step < STEPS, preempted
    # The second attempt's rank 0 log, read through the installed web pod: its first
    # step is the one after the checkpoint.
    answer = api.call("get", f"jobs/{job['id']}/logs/?rank=0&attempt=2")
    steps = re.findall(r"^STEP (\d+) RANK 0 ", answer["text"], re.MULTILINE)
    assert steps, answer
    assert int(steps[0]) == step + 1 and int(steps[-1]) == STEPS - 1, (
        f"attempt 2 ran steps {steps[0]} to {steps[-1]} after a checkpoint at {step}:\n"
        + answer["text"][:4000]
        + "\nattempt 1:\n"
        + api.call("get", f"jobs/{job['id']}/logs/?rank=0&attempt=1&tail=4000")["text"]
    )
    assert resumed["end_reason"] == "succeeded", resumed
    assert [r["exit_code"] for r in resumed["ranks"]] == [0, 0], resumed["ranks"]
    assert api.call("get", f"jobs/{critical['id']}/")["state"] == "succeeded"
    print(
        "helm install on real nodes: "
        + ", ".join(f"{what} {seconds:.1f} s" for what, seconds in installed.timings.items())
        + f"; image {installed.image.size_bytes / 2**20:.0f} MiB (archive), built in "
        + f"{installed.image.base_seconds + installed.image.build_seconds:.1f} s"
        + f"{' (cached)' if installed.image.cached else ''}; checkpoint step {step}"
    )
