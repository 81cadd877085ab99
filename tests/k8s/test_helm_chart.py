"""The Helm chart (deploy/helm/quartermaster) and the Containerfile it runs.

Helm is built from the Go module proxy (tools/k8s/build-helm.sh, cached). The
chart is linted, rendered with default and namespace-per-team values, and the
rendered objects are applied to the test control plane with server-side apply
and strict field validation. The API server then answers the questions that
matter: what each component's service account may do (SubjectAccessReview,
checked against every Kubernetes call preemption/runtimes/kubernetes/ makes),
the jobs namespace's NetworkPolicy, and whether the pods of every Deployment
pass the "restricted" Pod Security admission.

The test control plane has no CNI, so NetworkPolicies are checked as objects,
not enforced.
"""

from __future__ import annotations

import copy
import re
import shlex
import subprocess
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, dynamic
from kubernetes.client.exceptions import ApiException

from preemption.runtimes.kubernetes.config import MANAGED_BY, MANAGED_BY_LABEL
from tests.k8s.conftest import BUILD_HELM, Helm, delete_namespace

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "deploy" / "helm" / "quartermaster"
RUNTIME_PACKAGE = REPO_ROOT / "preemption" / "runtimes" / "kubernetes"
CONTAINERFILE = REPO_ROOT / "Containerfile"
EVENTS_CIDR = "10.20.0.0/16"
FIELD_MANAGER = "qm-helm-test"


class StrictLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping.

    A plain load keeps the last value silently, while kubectl and other strict
    clients refuse such a manifest.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
        duplicates = {key for key in keys if keys.count(key) > 1}
        assert not duplicates, f"duplicate keys {duplicates} at {node.start_mark}"
        return super().construct_mapping(node, deep=deep)


def render(helm: Helm, release: str, namespace: str, *values: str) -> list[dict[str, Any]]:
    """``helm template`` of the chart, as a list of objects (no key given twice)."""
    args = ["template", release, str(CHART), "--namespace", namespace]
    for value in values:
        args += ["--set", value]
    result = helm.run(*args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.load_all(result.stdout, Loader=StrictLoader) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def containers(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every container (init containers too) of every Deployment, by container name."""
    found = {}
    for deployment in by_kind(objects, "Deployment").values():
        spec = deployment["spec"]["template"]["spec"]
        for container in spec.get("initContainers", []) + spec["containers"]:
            found[container["name"]] = container
    return found


def test_helm_lint_passes_with_default_and_namespace_per_team_values(helm: Helm):
    for extra in ([], ["--set", "runtime.namespacePerTeam=true"]):
        result = helm.run("lint", "--strict", str(CHART), *extra)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


def test_helm_is_cached_by_version(helm: Helm):
    """A second build returns the cached binary at once, and it is the version asked for."""
    again = subprocess.run(
        ["bash", str(BUILD_HELM)], capture_output=True, text=True, timeout=30, check=True
    )
    assert again.stdout.strip() == helm.binary
    assert again.stderr == ""  # nothing was built
    version = helm.run("version", "--short")
    assert re.match(r"v3\.\d+\.\d+", version.stdout), version.stdout
    assert Path(helm.binary).parent.parent.name == version.stdout.split("+")[0].strip()


def test_secrets_are_referenced_never_rendered(helm: Helm):
    objects = render(helm, "quartermaster", "quartermaster-system")
    assert not by_kind(objects, "Secret")
    config = by_kind(objects, "ConfigMap")["quartermaster"]["data"]
    assert not {"SECRET_KEY", "DATABASE_URL", "CELERY_BROKER_URL"} & set(config)
    for name, container in containers(objects).items():
        env = {e["name"]: e for e in container["env"]}
        for key in ("SECRET_KEY", "DATABASE_URL", "CELERY_BROKER_URL"):
            assert set(env[key]) == {"name", "valueFrom"}, (name, key)
            assert env[key]["valueFrom"]["secretKeyRef"]["name"] == "quartermaster-secrets"


def test_settings_come_from_values(helm: Helm):
    objects = render(
        helm,
        "qm",
        "portal",
        "runtime.jobsNamespace=gangs",
        "runtime.checkpoints.claimName=ckpt",
        "runtime.checkpoints.create=true",
        "runtime.checkpoints.storageClassName=nfs-rwx",
        f"runtime.events.cidrs={{{EVENTS_CIDR}}}",
        "runtime.cpuPerGpu.h100=12",
        "runtime.imagePullPolicy=Never",
        "runtime.imageAllowlist.vision={registry.example.org/vision/,ghcr.io/vision/}",
        "secrets.databaseUrl.name=pg",
        "web.replicas=4",
        "ingress.enabled=true",
        "ingress.tlsSecretName=portal-tls",
    )
    config = by_kind(objects, "ConfigMap")["qm-quartermaster"]["data"]
    assert config["QM_K8S_NAMESPACE"] == "gangs"
    assert config["QM_K8S_CHECKPOINT_CLAIM"] == "ckpt"
    assert config["QM_K8S_EVENTS_CIDRS"] == EVENTS_CIDR
    assert config["QM_K8S_CPU_PER_GPU"] == "h100=12"
    assert config["QM_K8S_IMAGE_PULL_POLICY"] == "Never"
    assert config["QM_K8S_IMAGE_ALLOWLIST"] == "vision=registry.example.org/vision/|ghcr.io/vision/"
    claim = by_kind(objects, "PersistentVolumeClaim")["ckpt"]
    assert claim["metadata"]["namespace"] == "gangs"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["storageClassName"] == "nfs-rwx"
    deployments = by_kind(objects, "Deployment")
    assert deployments["qm-quartermaster-web"]["spec"]["replicas"] == 4
    assert deployments["qm-quartermaster-beat"]["spec"]["replicas"] == 1
    assert deployments["qm-quartermaster-beat"]["spec"]["strategy"] == {"type": "Recreate"}
    env = {e["name"]: e for e in containers(objects)["web"]["env"]}
    assert env["DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "pg"
    ingress = by_kind(objects, "Ingress")["qm-quartermaster-web"]
    assert ingress["spec"]["tls"][0]["secretName"] == "portal-tls"


def test_numbers_reach_the_portal_as_the_integers_it_reads(helm: Helm):
    """Helm reads every number of values.yaml as a float and ``quote`` writes a large
    one in exponent form ("1.073741824e+09"), which the portal's settings refuse at
    start: every pod of an install crashed so until the chart wrote them as integers."""
    config = by_kind(render(helm, "quartermaster", "quartermaster-system"), "ConfigMap")
    data = config["quartermaster"]["data"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert data["QM_K8S_JOB_UID_BASE"] == str(values["runtime"]["jobUidBase"]) == "1073741824"
    assert data["QM_START_TIMEOUT_SECONDS"] == str(values["runtime"]["startTimeoutSeconds"])
    assert data["QM_K8S_EVENTS_PORT"] == str(values["runtime"]["events"]["port"])
    assert data["QM_PROXY_COUNT"] == str(values["portal"]["proxyCount"])
    larger = by_kind(
        render(helm, "quartermaster", "quartermaster-system", "runtime.jobUidBase=2000000000"),
        "ConfigMap",
    )
    assert larger["quartermaster"]["data"]["QM_K8S_JOB_UID_BASE"] == "2000000000"


def test_the_web_probes_ask_for_a_host_the_portal_serves(helm: Helm):
    """The kubelet sends the pod's address as the Host of an HTTP probe, which no
    ALLOWED_HOSTS names: the portal answers it 400 and the pod never becomes ready
    (as the install on real nodes found). The probes name publicUrl's host."""
    objects = render(
        helm, "quartermaster", "quartermaster-system",
        "portal.publicUrl=https://qm.example.net", "portal.allowedHosts={qm.example.net}",
    )  # fmt: skip
    web = containers(objects)["web"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert web[probe]["httpGet"]["httpHeaders"] == [{"name": "Host", "value": "qm.example.net"}]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["secrets.databaseUrl.name="], "at '/secrets/databaseUrl/name'"),
        (["runtime.checkpoints.claimName="], "runtime.checkpoints.claimName"),
        # The cluster's default class is usually a block volume: never assumed.
        (["runtime.checkpoints.create=true"], "ReadWriteMany StorageClass"),
        # A secret's value has no place in values, only its Secret's name.
        (["secrets.databaseUrl.value=postgres://u:p@db/qm"], "'value' not allowed"),
        # Two beats would start every schedule cycle twice.
        (["beat.replicas=2"], "at '/beat': additional properties 'replicas' not allowed"),
        (["web.replicas=-1"], "at '/web/replicas'"),
        (["podSecurityContext.runAsNonRoot=false"], "at '/podSecurityContext/runAsNonRoot'"),
        (["runtime.jobsNamespace=Team_A"], "at '/runtime/jobsNamespace'"),
        (["runtime.events.cidrs={10.0.0.0}"], "at '/runtime/events/cidrs/0'"),
        (["runtime.imagePullPolicy=Sometimes"], "at '/runtime/imagePullPolicy'"),
        # The ranks report their trap events there: a host the portal does not serve
        # would answer each of them 400.
        (
            ["portal.publicUrl=http://10.0.0.1:8000"],
            "portal.publicUrl: its host 10.0.0.1 must be among portal.allowedHosts",
        ),
    ],
)
def test_bad_values_are_refused_with_the_reason(helm: Helm, values: list[str], message: str):
    args = ["template", "qm", str(CHART)]
    for value in values:
        args += ["--set", value]
    result = helm.run(*args)
    assert result.returncode != 0
    assert message in result.stderr


def test_notes_say_what_to_do_next(helm: Helm, kubeconfig: str):
    """NOTES.txt, as ``helm install`` prints it (a client-side dry run: nothing is created)."""

    def notes(*values: str) -> str:
        args = ["install", "qm", str(CHART), "-n", "portal", "--dry-run=client"]
        args += ["--kubeconfig", kubeconfig]
        for value in values:
            args += ["--set", value]
        result = helm.run(*args)
        assert result.returncode == 0, result.stderr
        return result.stdout.split("NOTES:", 1)[1]

    plain = notes()
    assert "kubectl -n portal rollout status deploy/qm-quartermaster-web" in plain
    assert "manage.py createsuperuser" in plain
    assert "quartermaster-secrets/DATABASE_URL" in plain
    assert "create it\n   yourself" in plain
    # Ranks that cannot reach the events URL are a broken install: say so.
    assert "WARNING: runtime.events.cidrs is empty" in plain
    ready = notes(
        f"runtime.events.cidrs={{{EVENTS_CIDR}}}",
        "runtime.checkpoints.create=true",
        "runtime.checkpoints.storageClassName=nfs-rwx",
        "ingress.enabled=true",
        "ingress.tlsSecretName=tls",
    )
    assert "WARNING" not in ready and "create it" not in ready
    assert "https://quartermaster.example.org/" in ready


# -- the Containerfile against the chart ----------------------------------------------


def containerfile_instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, arguments = line.partition(" ")
            pairs.append((instruction.upper(), arguments.strip()))
    return pairs


def ignored_by_containerignore(path: str) -> bool:
    patterns = [
        line.strip()
        for line in (REPO_ROOT / ".containerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    first = path.strip("/").split("/")[0]
    return any(pattern.strip("/") in (path.strip("/"), first) for pattern in patterns)


def test_containerfile_copies_paths_that_exist_and_are_not_ignored():
    instructions = containerfile_instructions()
    copies = [args for instruction, args in instructions if instruction == "COPY"]
    assert copies
    for args in copies:
        words = shlex.split(args)
        if any(word.startswith("--from=") for word in words):
            continue
        sources = [w for w in words if not w.startswith("--")][:-1]
        for source in sources:
            assert (REPO_ROOT / source).exists(), source
            if source != ".":
                assert not ignored_by_containerignore(source), source
    # What the portal needs at run time is in the build context.
    for needed in ("manage.py", "templates", "examples", "portal", "gracetrap", "pyproject.toml"):
        assert (REPO_ROOT / needed).exists()
        assert not ignored_by_containerignore(needed), needed
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    for package in re.findall(r'"([a-z_]+)\*"', pyproject):
        assert not ignored_by_containerignore(package), package


def test_containerfile_runs_what_the_chart_runs(helm: Helm):
    instructions = containerfile_instructions()
    runtime_stage = instructions[
        max(i for i, (ins, _) in enumerate(instructions) if ins == "FROM") :
    ]
    settings = dict(runtime_stage)
    # The image's user is the chart's numeric non-root uid (runAsNonRoot can
    # only be verified for a numeric user).
    assert settings["USER"] == "10001:10001"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 10001
    assert values["podSecurityContext"]["runAsGroup"] == 10001
    # manage.py sits in the working directory the chart's migrate command uses.
    assert settings["WORKDIR"] == "/app"
    assert re.search(r"COPY \. /app", CONTAINERFILE.read_text())
    env = dict(re.findall(r"([A-Z_]+)=(\S+)", settings["ENV"]))
    assert env["PYTHONPATH"] == "/app:/app/gracetrap/src"
    assert env["PATH"].startswith("/opt/venv/bin:")
    objects = render(helm, "quartermaster", "quartermaster-system")
    config = by_kind(objects, "ConfigMap")["quartermaster"]["data"]
    assert env["QM_VAR_DIR"] == config["QM_VAR_DIR"]
    commands = {name: c["command"] for name, c in containers(objects).items()}
    cmd = yaml.safe_load(settings["CMD"])
    assert commands["web"][:2] == cmd[:2] == ["gunicorn", "portal.wsgi"]
    assert commands["worker"][:4] == ["celery", "-A", "portal", "worker"]
    assert commands["beat"][:4] == ["celery", "-A", "portal", "beat"]
    assert commands["migrate"] == ["python", "manage.py", "migrate", "--noinput"]
    # Every program the chart starts is installed in the image's virtualenv:
    # the image installs pyproject's dependencies, which provide them.
    dependencies = tomllib.loads(pyproject())["project"]["dependencies"]
    names = {re.split(r"[<>=\[ ]", d)[0].lower() for d in dependencies}
    assert {"gunicorn", "celery"} <= names
    assert (REPO_ROOT / "portal" / "wsgi.py").exists() and (
        REPO_ROOT / "portal" / "celery.py"
    ).exists()
    # The mounts the read-only root filesystem needs are where the image writes.
    for container in containers(objects).values():
        assert {m["mountPath"] for m in container["volumeMounts"]} == {config["QM_VAR_DIR"], "/tmp"}
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # The gracetrap wheel is built into the image.
    assert any(
        ins == "RUN" and "pip wheel" in args and "./gracetrap" in args for ins, args in instructions
    )
    wheels = "/opt/quartermaster/wheels"
    assert any(ins == "RUN" and f"-w {wheels}" in args for ins, args in instructions)
    assert ("COPY", f"--from=build {wheels} {wheels}") in runtime_stage


def pyproject() -> str:
    return (REPO_ROOT / "pyproject.toml").read_text()


# -- applied to the control plane -------------------------------------------------------

# How the runtime's client calls map to RBAC: the resource (group, resource,
# subresource) and whether it is cluster-scoped.
RESOURCES: dict[str, tuple[str, str, str, bool]] = {
    "pod": ("", "pods", "", False),
    "pod_eviction": ("", "pods", "eviction", False),
    "pod_log": ("", "pods", "log", False),
    "config_map": ("", "configmaps", "", False),
    "secret": ("", "secrets", "", False),
    "service": ("", "services", "", False),
    "network_policy": ("networking.k8s.io", "networkpolicies", "", False),
    "node": ("", "nodes", "", True),
    "namespace": ("", "namespaces", "", True),
    "priority_class": ("scheduling.k8s.io", "priorityclasses", "", True),
}


@pytest.fixture(scope="module")
def runtime_calls() -> set[tuple[str, str, bool]]:
    """(verb, client resource name, across namespaces) of every API call the runtime makes."""
    source = "\n".join(path.read_text() for path in sorted(RUNTIME_PACKAGE.glob("*.py")))
    calls = set()
    pattern = r"\b(?:core|networking|scheduling)\.(create|delete|patch|list|read|replace)_(\w+)"
    for verb, rest in re.findall(pattern, source):
        across = rest.endswith("_for_all_namespaces")
        name = rest.removesuffix("_for_all_namespaces").removeprefix("namespaced_")
        calls.add(({"read": "get"}.get(verb, verb), name, across))
    # observe() follows pods with a watch on the same listing.
    if "watch.Watch().stream(" in source:
        calls.add(("watch", "pod", False))
        calls.add(("watch", "pod", True))
    assert ("create", "pod", False) in calls and ("list", "node", False) in calls
    unknown = {name for _, name, _ in calls} - set(RESOURCES)
    assert not unknown, f"add RBAC for {unknown} to the chart and to RESOURCES"
    return calls


def may(
    api: client.ApiClient,
    account: tuple[str, str],
    verb: str,
    resource: str,
    namespace: str | None,
) -> bool:
    """Whether the real authorizer lets service account (namespace, name) do this."""
    group, plural, subresource, _ = RESOURCES[resource]
    sa_namespace, name = account
    review = client.AuthorizationV1Api(api).create_subject_access_review(
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": f"system:serviceaccount:{sa_namespace}:{name}",
                "groups": [
                    "system:serviceaccounts",
                    f"system:serviceaccounts:{sa_namespace}",
                    "system:authenticated",
                ],
                "resourceAttributes": {
                    "verb": verb,
                    "group": group,
                    "resource": plural,
                    "subresource": subresource,
                    "namespace": namespace or "",
                },
            },
        }
    )
    return bool(review.status.allowed)


def apply(
    dyn: dynamic.DynamicClient, body: dict[str, Any], *, dry_run: bool = False
) -> dict[str, Any]:
    """Server-side apply with strict field validation: an unknown or duplicate field is an error."""
    resource = dyn.resources.get(api_version=body["apiVersion"], kind=body["kind"])
    result = dyn.server_side_apply(
        resource,
        body=body,
        namespace=body["metadata"].get("namespace"),
        field_manager=FIELD_MANAGER,
        force_conflicts=True,
        dry_run="All" if dry_run else None,
        query_params=[("fieldValidation", "Strict")],
    )
    return dict(result.to_dict())


def pod_from(deployment: dict[str, Any], namespace: str) -> dict[str, Any]:
    template = copy.deepcopy(deployment["spec"]["template"])
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{deployment['metadata']['name']}-check",
            "namespace": namespace,
            "labels": template["metadata"]["labels"],
        },
        "spec": template["spec"],
    }


class Installed:
    def __init__(self, release: str, namespace: str, jobs: str, objects: list[dict[str, Any]]):
        self.release = release
        self.namespace = namespace
        self.jobs = jobs
        self.objects = objects
        self.fullname = f"{release}-quartermaster"

    def account(self, component: str) -> tuple[str, str]:
        return (self.namespace, f"{self.fullname}-{component}")


@pytest.fixture(
    scope="module", params=[False, True], ids=["one-jobs-namespace", "namespace-per-team"]
)
def installed(
    request: pytest.FixtureRequest, helm: Helm, k8s_api: client.ApiClient
) -> Iterator[Installed]:
    """The chart rendered and applied; the release namespace enforces "restricted" too."""
    per_team = bool(request.param)
    suffix = uuid.uuid4().hex[:8]
    release, namespace, jobs = f"qm{suffix}", f"qm-helm-{suffix}", f"qm-helm-jobs-{suffix}"
    objects = render(
        helm,
        release,
        namespace,
        f"runtime.jobsNamespace={jobs}",
        f"runtime.namespacePerTeam={str(per_team).lower()}",
        f"runtime.events.cidrs={{{EVENTS_CIDR}}}",
        "runtime.checkpoints.create=true",
        "runtime.checkpoints.storageClassName=quartermaster-checkpoints",
        "ingress.enabled=true",
    )
    core = client.CoreV1Api(k8s_api)
    core.create_namespace(
        {
            "metadata": {
                "name": namespace,
                "labels": {"pod-security.kubernetes.io/enforce": "restricted"},
            }
        }
    )
    dyn = dynamic.DynamicClient(k8s_api)
    try:
        # Namespaces first: everything else lives in one.
        ordered = sorted(objects, key=lambda o: o["kind"] != "Namespace")
        for body in ordered:
            # Workloads go through validation and admission without running.
            apply(dyn, body, dry_run=body["kind"] == "Deployment")
        yield Installed(release, namespace, jobs, objects)
    finally:
        rbac = client.RbacAuthorizationV1Api(k8s_api)
        for body in objects:
            name = body["metadata"]["name"]
            try:
                if body["kind"] == "ClusterRole":
                    rbac.delete_cluster_role(name)
                elif body["kind"] == "ClusterRoleBinding":
                    rbac.delete_cluster_role_binding(name)
            except ApiException as error:
                if error.status != 404:
                    raise
        for name in (namespace, jobs):
            # The test control plane runs no PVC protection controller, which
            # would drop the claim's finalizer once no pod uses it.
            for claim in core.list_namespaced_persistent_volume_claim(name).items:
                core.patch_namespaced_persistent_volume_claim(
                    claim.metadata.name, name, {"metadata": {"finalizers": None}}
                )
            try:
                delete_namespace(core, name)
            except ApiException as error:
                if error.status != 404:
                    raise


def test_chart_applies_server_side_with_least_privilege_per_component(
    installed: Installed, k8s_api: client.ApiClient, runtime_calls: set[tuple[str, str, bool]]
):
    objects = installed.objects
    per_team = any(
        o["kind"] == "ClusterRoleBinding" and o["metadata"]["name"].endswith("-jobs")
        for o in objects
    )
    web, worker, beat = (installed.account(c) for c in ("web", "worker", "beat"))
    team_namespace = "qm-team-vision"
    jobs_namespaces = [installed.jobs, team_namespace] if per_team else [installed.jobs]

    # The worker may make every call the runtime makes, where it makes it.
    for verb, name, across in sorted(runtime_calls):
        cluster_scoped = RESOURCES[name][3]
        if name == "namespace":
            assert may(k8s_api, worker, verb, name, None) is per_team
        elif cluster_scoped:
            assert may(k8s_api, worker, verb, name, None), (verb, name)
        elif across:
            # Listing across namespaces only happens in namespace-per-team mode.
            assert may(k8s_api, worker, verb, name, None) is per_team, (verb, name)
        else:
            for where in jobs_namespaces:
                assert may(k8s_api, worker, verb, name, where), (verb, name, where)

    # And nothing beyond: no reads of Secrets, nothing in the portal's namespace
    # (in one-namespace mode), no writes to nodes or RBAC.
    for where in jobs_namespaces:
        for verb in ("get", "list", "watch"):
            assert not may(k8s_api, worker, verb, "secret", where)
        assert not may(k8s_api, worker, "update", "pod", where)
    assert not may(k8s_api, worker, "patch", "node", None)
    if not per_team:
        assert not may(k8s_api, worker, "create", "pod", team_namespace)
        assert not may(k8s_api, worker, "list", "pod", None)

    # The web process reads rank logs and nothing else: it can neither
    # create nor delete pods, anywhere.
    for where in [*jobs_namespaces, installed.namespace, None]:
        for verb in ("create", "delete", "patch"):
            assert not may(k8s_api, web, verb, "pod", where), (verb, where)
        assert not may(k8s_api, web, "create", "pod_eviction", where)
        assert not may(k8s_api, web, "create", "namespace", where)
    for where in jobs_namespaces:
        assert may(k8s_api, web, "get", "pod_log", where)
        assert may(k8s_api, web, "list", "config_map", where)
        assert not may(k8s_api, web, "create", "config_map", where)
        assert not may(k8s_api, web, "get", "secret", where)
    assert may(k8s_api, web, "list", "config_map", None) is per_team
    assert not may(k8s_api, web, "list", "priority_class", None)

    # Beat only schedules tasks: it may do nothing at all, and gets no token.
    for verb, name, _ in runtime_calls:
        for where in [*jobs_namespaces, None]:
            assert not may(k8s_api, beat, verb, name, where), (verb, name, where)
    accounts = {sa["metadata"]["name"]: sa for sa in objects if sa["kind"] == "ServiceAccount"}
    assert accounts[beat[1]]["automountServiceAccountToken"] is False


def test_jobs_namespace_enforces_restricted_and_denies_by_default(
    installed: Installed, k8s_api: client.ApiClient
):
    core = client.CoreV1Api(k8s_api)
    labels = core.read_namespace(installed.jobs).metadata.labels
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    claim = core.read_namespaced_persistent_volume_claim("qm-checkpoints", installed.jobs)
    assert claim.spec.access_modes == ["ReadWriteMany"]

    policies = client.NetworkingV1Api(k8s_api).list_namespaced_network_policy(installed.jobs).items
    assert [p.metadata.name for p in policies] == ["quartermaster-ranks"]
    spec = policies[0].spec
    # Every rank pod the runtime creates is selected ...
    assert spec.pod_selector.match_labels == {MANAGED_BY_LABEL: MANAGED_BY}
    assert sorted(spec.policy_types) == ["Egress", "Ingress"]
    # ... no one may reach it (its own gang's policy, made by the runtime, adds
    # its ranks) ...
    assert not spec.ingress
    # ... and it may reach DNS and the portal's events URL, nothing else.
    assert len(spec.egress) == 2
    dns, events = spec.egress
    assert {(p.protocol, p.port) for p in dns.ports} == {("UDP", 53), ("TCP", 53)}
    assert dns.to[0].pod_selector.match_labels == {"k8s-app": "kube-dns"}
    assert [peer.ip_block.cidr for peer in events.to] == [EVENTS_CIDR]
    assert [(p.protocol, p.port) for p in events.ports] == [("TCP", 443)]


def test_every_portal_pod_passes_restricted_pod_security_admission(
    installed: Installed, k8s_api: client.ApiClient
):
    core = client.CoreV1Api(k8s_api)
    deployments = by_kind(installed.objects, "Deployment")
    assert set(deployments) == {f"{installed.fullname}-{c}" for c in ("web", "worker", "beat")}
    for deployment in deployments.values():
        pod = pod_from(deployment, installed.namespace)
        # A dry run goes through the API server's admission, PodSecurity
        # "restricted" included (the namespace enforces it).
        created = core.create_namespaced_pod(installed.namespace, pod, dry_run="All")
        assert created.spec.security_context.run_as_non_root is True
        for container in created.spec.containers + (created.spec.init_containers or []):
            assert container.security_context.capabilities.drop == ["ALL"]
            assert container.security_context.allow_privilege_escalation is False

    # The same admission refuses a pod that keeps its capabilities: the check
    # above could fail.
    pod = pod_from(deployments[f"{installed.fullname}-web"], installed.namespace)
    del pod["spec"]["containers"][0]["securityContext"]["capabilities"]
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod(installed.namespace, pod, dry_run="All")
    assert refused.value.status == 403
    assert "violates PodSecurity" in refused.value.body


def test_strict_field_validation_refuses_an_unknown_field(
    installed: Installed, k8s_api: client.ApiClient
):
    """The apply above would have failed on a misspelt field: show that it does."""
    dyn = dynamic.DynamicClient(k8s_api)
    deployment = copy.deepcopy(
        by_kind(installed.objects, "Deployment")[f"{installed.fullname}-beat"]
    )
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContex"] = {}
    with pytest.raises(ApiException) as refused:
        apply(dyn, deployment, dry_run=True)
    # kube-apiserver answers an apply it cannot type with 500, but says why.
    assert refused.value.status in (400, 422, 500)
    assert ".securityContex: field not declared in schema" in refused.value.body
