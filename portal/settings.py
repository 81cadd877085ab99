"""Quartermaster's one settings module, read from the environment.

With no environment at all it runs the embedded default: SQLite under var/,
a Celery broker on local disk, the local runtime and a generated secret key,
with DEBUG off (QM_DEBUG=1 turns Django's debug pages on, for development only:
they show settings and URL patterns to whoever hits an error).
Set QM_PRODUCTION=1 for a deployment: then a strong SECRET_KEY is required,
DEBUG must stay off, and the security settings that `manage.py check --deploy`
asks for are on.
"""

from __future__ import annotations

import ipaddress
from datetime import timedelta
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from core.env import (
    SQLITE_ENGINE,
    check_secret_key,
    env_bool,
    env_choice,
    env_float,
    env_int,
    env_list,
    env_mapping,
    env_str,
    parse_database_url,
    private_file,
    private_folder,
    read_or_create_secret,
    var_folder,
)

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("QM_VAR_DIR", str(BASE_DIR / "var")) or BASE_DIR / "var")

PRODUCTION = env_bool("QM_PRODUCTION", False)
# QM_DEBUG is the switch; the plain DEBUG variable is still read for older setups.
DEBUG = env_bool("QM_DEBUG", env_bool("DEBUG", False))
if PRODUCTION and DEBUG:
    raise ImproperlyConfigured(
        "DEBUG is on while QM_PRODUCTION is on: debug pages would show settings, "
        "database and broker URLs to anyone. Unset QM_DEBUG (and DEBUG)."
    )
if not PRODUCTION or VAR_DIR.exists():
    var_folder(VAR_DIR)

_secret = env_str("SECRET_KEY")
if _secret is None:
    if PRODUCTION:
        raise ImproperlyConfigured("SECRET_KEY must be set when QM_PRODUCTION is on")
    _secret = read_or_create_secret(VAR_DIR / "secret_key")
elif PRODUCTION:
    check_secret_key("SECRET_KEY", _secret)
SECRET_KEY = _secret

ALLOWED_HOSTS = env_list(
    "ALLOWED_HOSTS", [] if PRODUCTION else ["127.0.0.1", "localhost", "[::1]", "testserver"]
)
if PRODUCTION and not ALLOWED_HOSTS:
    raise ImproperlyConfigured(
        "ALLOWED_HOSTS must name the portal's hosts when QM_PRODUCTION is on"
    )
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "axes",
    "portal",
    "quotas",
    "preemption",
    "telemetry",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "portal.body_limit.BodyLimitMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, so that it turns a login that django-axes refused into the lockout answer.
    "axes.middleware.AxesMiddleware",
]

# The largest request body, checked at the door for every request
# (portal/body_limit.py): room for a batch of 500 jobs of about 20 KB each.
DATA_UPLOAD_MAX_MEMORY_SIZE = 10 * 1024 * 1024

ROOT_URLCONF = "portal.urls"
DEFAULT_EXCEPTION_REPORTER_FILTER = "portal.errors.SettingsReporterFilter"
WSGI_APPLICATION = "portal.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "portal.context.navigation",
            ],
        },
    },
]

DATABASE_URL = env_str("DATABASE_URL", f"sqlite:///{VAR_DIR / 'quartermaster.sqlite3'}") or ""
DATABASES = {"default": parse_database_url("DATABASE_URL", DATABASE_URL)}
if DATABASES["default"]["ENGINE"] == SQLITE_ENGINE:
    _sqlite = Path(DATABASES["default"]["NAME"])
    _sqlite.parent.mkdir(parents=True, exist_ok=True)
    # SQLite gives its -wal and -shm files the database file's mode, so a database
    # created 0600 here stays unreadable to everyone else, ranks included.
    for _path in (
        _sqlite,
        _sqlite.with_name(_sqlite.name + "-wal"),
        _sqlite.with_name(_sqlite.name + "-shm"),
    ):
        if _path == _sqlite or _path.exists():
            private_file(_path)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
AUTHENTICATION_BACKENDS = [
    # Refuses every login of a locked-out account or address, the right password included.
    "portal.throttling.LoginThrottleBackend",
    "django.contrib.auth.backends.ModelBackend",
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(VAR_DIR / "static")) or VAR_DIR / "static")
if not PRODUCTION:
    # WhiteNoise warns on every start when the folder is missing.
    STATIC_ROOT.mkdir(parents=True, exist_ok=True)
STATICFILES_DIRS = [BASE_DIR / "portal" / "static"]
# Plotly's bundled JavaScript is served from the installed package, never a CDN.
WHITENOISE_USE_FINDERS = True

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "portal.auth.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 100,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "core.api.exception_handler",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Quartermaster API",
    "DESCRIPTION": "Fair-share GPU quotas and graceful, gang-atomic preemption.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    "SCHEMA_PATH_PREFIX": "/api/v1",
    "ENUM_NAME_OVERRIDES": {},
    "DISABLE_ERRORS_AND_WARNINGS": True,
    # `check --deploy` would generate the schema, which runs the selectors and so
    # needs a migrated database; without one every view reads as a schema
    # warning. The test suite generates and walks the schema instead
    # (tests/portal/api/test_api_permissions.py, tests/portal/api/test_api_schemathesis.py).
    "ENABLE_DJANGO_DEPLOY_CHECK": False,
    # The interactive docs are served from the installed sidecar, never a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# Celery: Redis in production and tests, a broker on local disk by default.
# The disk broker ignores the host; naming one spares kombu's warning about it.
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", "qmdisk://localhost//") or "qmdisk://localhost//"
if not CELERY_BROKER_URL.startswith(
    ("qmdisk://", "filesystem://", "redis://", "rediss://", "memory://")
):
    raise ImproperlyConfigured(
        f"CELERY_BROKER_URL must start with qmdisk:// (on local disk), redis:// or rediss://, got {CELERY_BROKER_URL!r}"
    )
BROKER_DIR = VAR_DIR / "broker"
if CELERY_BROKER_URL.startswith(("qmdisk://", "filesystem://")):
    # Task messages are the control plane's alone.
    private_folder(BROKER_DIR)
    for sub in ("out", "processed", "control"):
        (BROKER_DIR / sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(BROKER_DIR / "out"),
        "data_folder_out": str(BROKER_DIR / "out"),
        "processed_folder": str(BROKER_DIR / "processed"),
        "control_folder": str(BROKER_DIR / "control"),
        "store_processed": False,
        "polling_interval": 0.05,
    }
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SOFT_TIME_LIMIT = 60
CELERY_TASK_TIME_LIMIT = 90
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")
CELERY_TIMEZONE = "UTC"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Celery closes a worker's database connections after this many tasks (counted
# twice: before and after each); in between, CONN_MAX_AGE and the health checks
# decide, as for web requests (portal/celery.py).
CELERY_DB_REUSE_MAX = 5000
QM_CYCLE_SECONDS = env_float("QM_CYCLE_SECONDS", 1.0, minimum=0.1)
# How often the reconciler looks at the runtime. A finished rank is noticed at the
# next pass, and its GPUs go to the next job only then: with jobs of seconds, a
# pass a second would leave GPUs idle for a quarter of the time. A pass over
# gangs that changed nothing writes nothing.
QM_RECONCILE_SECONDS = env_float("QM_RECONCILE_SECONDS", 0.25, minimum=0.05)
QM_SAMPLE_SECONDS = env_float("QM_SAMPLE_SECONDS", 15.0, minimum=1.0)
# How often each running job's preemption risk (its cadence hint) is estimated
# again, and over how long a window the measured preemption rates are counted.
QM_RISK_SECONDS = env_float("QM_RISK_SECONDS", 15.0, minimum=1.0)
QM_RISK_WINDOW_SECONDS = env_float("QM_RISK_WINDOW_SECONDS", 86400.0, minimum=60.0)

# Runtimes.
# "mimic" starts nothing: each job holds its GPUs for the seconds of its `sleep SECONDS`
# command and then succeeds (preemption/runtimes/mimic.py). It measures the control plane
# alone, as Kueue's performance test does, and is refused in production.
QM_RUNTIME = env_choice("QM_RUNTIME", "local", ("local", "kubernetes", "mimic"))
if PRODUCTION and QM_RUNTIME == "mimic":
    raise ImproperlyConfigured(
        "QM_RUNTIME=mimic runs no job (it only mimics their running time, for benchmarks) "
        "and is refused while QM_PRODUCTION is on: use local or kubernetes."
    )
QM_RUNS_DIR = Path(env_str("QM_RUNS_DIR", str(VAR_DIR / "runs")) or VAR_DIR / "runs")
QM_CHECKPOINTS_DIR = Path(
    env_str("QM_CHECKPOINTS_DIR", str(VAR_DIR / "checkpoints")) or VAR_DIR / "checkpoints"
)
# The unprivileged user the local runtime runs ranks as (bin/runner-user creates it), and
# the first of the group ids that keep one job's ranks out of another's folders and
# processes (job N runs with group QM_RUNNER_GID_BASE + N; see preemption/runtimes/runner.py).
# Production refuses the local runtime without this user; elsewhere ranks then run as the
# control plane's user, with a warning.
QM_RUNNER_USER = env_str("QM_RUNNER_USER", "qm-runner") or ""
QM_RUNNER_GID_BASE = env_int("QM_RUNNER_GID_BASE", 2**31, minimum=65536)
# The local runtime's virtual nodes: name:flavor:gpus, comma-separated. Empty
# means "the nodes in the database".
QM_LOCAL_NODES = env_str("QM_LOCAL_NODES", "") or ""
# The local runtime's sandbox per rank (preemption/runtimes/sandbox.py): its own PID,
# mount and (per gang) network namespace, a cgroup that the gang's kill empties, and
# these limits per rank. `auto` sandboxes where the machine can and warns where it
# cannot; `on` refuses to launch without one (production should say `on`); `off`
# never sandboxes. Sizes take K, M, G or T (binary units).
QM_LOCAL_SANDBOX = env_choice("QM_LOCAL_SANDBOX", "auto", ("auto", "on", "off"))
QM_RANK_PIDS_MAX = env_int("QM_RANK_PIDS_MAX", 4096, minimum=8)
try:
    from preemption.runtimes.sandbox import parse_size as _parse_size

    QM_RANK_MEMORY_MAX = _parse_size(env_str("QM_RANK_MEMORY_MAX", "64G") or "")
    QM_RANK_FILE_SIZE_MAX = _parse_size(env_str("QM_RANK_FILE_SIZE_MAX", "256G") or "")
except ValueError as _error:
    raise ImproperlyConfigured(f"QM_RANK_MEMORY_MAX or QM_RANK_FILE_SIZE_MAX: {_error}") from None
QM_K8S_NAMESPACE = env_str("QM_K8S_NAMESPACE", "quartermaster") or "quartermaster"
QM_K8S_NAMESPACE_PER_TEAM = env_bool("QM_K8S_NAMESPACE_PER_TEAM", False)
QM_K8S_KUBECONFIG = env_str("QM_K8S_KUBECONFIG", "") or ""
# The ReadWriteMany PersistentVolumeClaim (one of this name in the jobs
# namespace, or in each team's namespace) that every rank mounts for its
# checkpoints. Required in production: without it checkpoints die with pods.
QM_K8S_CHECKPOINT_CLAIM = env_str("QM_K8S_CHECKPOINT_CLAIM", "") or ""
QM_K8S_CHECKPOINT_MOUNT_PATH = env_str("QM_K8S_CHECKPOINT_MOUNT_PATH", "/checkpoints") or ""
if not QM_K8S_CHECKPOINT_MOUNT_PATH.startswith("/") or QM_K8S_CHECKPOINT_MOUNT_PATH == "/":
    raise ImproperlyConfigured(
        f"QM_K8S_CHECKPOINT_MOUNT_PATH must be an absolute path below /, "
        f"got {QM_K8S_CHECKPOINT_MOUNT_PATH!r}"
    )
# Observe gang pods through a watch (one listing, then changes; re-listed on
# 410 Gone) instead of listing every pod on every reconcile cycle.
QM_K8S_WATCH_PODS = env_bool("QM_K8S_WATCH_PODS", True)
# Job N's ranks run as uid and gid QM_K8S_JOB_UID_BASE + N, and own its checkpoint
# folder (preemption/runtimes/kubernetes/__init__.py, "Checkpoints").
QM_K8S_JOB_UID_BASE = env_int("QM_K8S_JOB_UID_BASE", 2**30, minimum=1)
# CPU, memory and ephemeral storage each rank requests (and is limited to) per GPU
# it holds: "flavor=quantity" pairs, and a default for flavors not named.
QM_K8S_CPU_PER_GPU = env_mapping("QM_K8S_CPU_PER_GPU", {})
QM_K8S_MEMORY_PER_GPU = env_mapping("QM_K8S_MEMORY_PER_GPU", {})
QM_K8S_EPHEMERAL_STORAGE_PER_GPU = env_mapping("QM_K8S_EPHEMERAL_STORAGE_PER_GPU", {})
QM_K8S_DEFAULT_CPU_PER_GPU = env_str("QM_K8S_DEFAULT_CPU_PER_GPU", "4") or "4"
QM_K8S_DEFAULT_MEMORY_PER_GPU = env_str("QM_K8S_DEFAULT_MEMORY_PER_GPU", "16Gi") or "16Gi"
QM_K8S_DEFAULT_EPHEMERAL_STORAGE_PER_GPU = (
    env_str("QM_K8S_DEFAULT_EPHEMERAL_STORAGE_PER_GPU", "20Gi") or "20Gi"
)
# Every rank container's imagePullPolicy: IfNotPresent, Never where nodes hold their
# images and no registry is reachable (an image a node lacks then waits as
# ErrImageNeverPull and fails the attempt at QM_START_TIMEOUT_SECONDS), Always
# where tags move.
QM_K8S_IMAGE_PULL_POLICY = env_str("QM_K8S_IMAGE_PULL_POLICY", "IfNotPresent") or "IfNotPresent"
if QM_K8S_IMAGE_PULL_POLICY not in ("Always", "IfNotPresent", "Never"):
    raise ImproperlyConfigured(
        "QM_K8S_IMAGE_PULL_POLICY must be Always, IfNotPresent or Never, "
        f"got {QM_K8S_IMAGE_PULL_POLICY!r}"
    )
# Per-team image allow-list, "team=prefix|prefix,team2=prefix": a team named
# here may run only images starting with one of its prefixes.
QM_K8S_IMAGE_ALLOWLIST = {
    team: tuple(prefix for prefix in prefixes.split("|") if prefix)
    for team, prefixes in env_mapping("QM_K8S_IMAGE_ALLOWLIST", {}).items()
}
# Where ranks reach the portal's events URL (CIDRs and port), the only egress
# the jobs namespace's NetworkPolicy allows beyond the gang itself and DNS.
QM_K8S_EVENTS_CIDRS = env_list("QM_K8S_EVENTS_CIDRS", [])
QM_K8S_EVENTS_PORT = env_int("QM_K8S_EVENTS_PORT", 443, minimum=1)
QM_PUBLIC_URL = env_str("QM_PUBLIC_URL", "http://127.0.0.1:8000") or "http://127.0.0.1:8000"
# A rank still waiting this long after launch on something that will not come
# (an image it cannot pull, a node that cannot take it) fails the attempt.
QM_START_TIMEOUT_SECONDS = env_float("QM_START_TIMEOUT_SECONDS", 300.0, minimum=1.0)
# How much of the end of each rank's log is kept once its attempt ends, for
# runtimes that forget logs with their pods (Kubernetes).
QM_LOG_TAIL_BYTES = env_int("QM_LOG_TAIL_BYTES", 4 << 20, minimum=0)
# How much of each rank's log the local runtime keeps: its first and its last
# bytes, with a line saying how much was cut between them (capped_log.py).
QM_RANK_LOG_HEAD_BYTES = env_int("QM_RANK_LOG_HEAD_BYTES", 64 << 20, minimum=1 << 16)
QM_RANK_LOG_TAIL_BYTES = env_int("QM_RANK_LOG_TAIL_BYTES", 64 << 20, minimum=1 << 16)
# How far into a live Kubernetes log a read may reach (the pod log API has no
# offset, so a read streams from the start).
QM_K8S_LOG_SCAN_BYTES = env_int("QM_K8S_LOG_SCAN_BYTES", 64 << 20, minimum=1 << 20)
QM_MAX_ATTEMPTS = env_int("QM_MAX_ATTEMPTS", 5, minimum=1)
QM_RETRY_BACKOFF_SECONDS = env_float("QM_RETRY_BACKOFF_SECONDS", 10.0, minimum=0.0)
# A runtime call that failed for a reason that may pass (a launcher that did
# not start, an API server that answered 503) is tried again after this many
# seconds, doubling each time, and a launch gives up after QM_RUNTIME_TRIES.
QM_RUNTIME_RETRY_SECONDS = env_float("QM_RUNTIME_RETRY_SECONDS", 2.0, minimum=0.0)
QM_RUNTIME_TRIES = env_int("QM_RUNTIME_TRIES", 8, minimum=1)
# How long a job runs before the scheduler may preempt it, per reason; a priority
# class may set its own. These and QM_USAGE_* are the scheduling policy until an admin
# first changes it (quotas.models.SchedulingPolicy, /api/v1/scheduling-policy/). Priority and reclaim: none, so that urgent work and
# guarantees come first; fair share: a minute, so that GPUs handed out in one
# cycle are not taken back in the next; consolidation: ten minutes, so that no
# job is moved twice in quick succession.
QM_PRIORITY_MIN_RUNTIME_SECONDS = env_float("QM_PRIORITY_MIN_RUNTIME_SECONDS", 0.0, minimum=0.0)
QM_FAIR_SHARE_MIN_RUNTIME_SECONDS = env_float(
    "QM_FAIR_SHARE_MIN_RUNTIME_SECONDS", 60.0, minimum=0.0
)
QM_RECLAIM_MIN_RUNTIME_SECONDS = env_float("QM_RECLAIM_MIN_RUNTIME_SECONDS", 0.0, minimum=0.0)
QM_CONSOLIDATION_MIN_RUNTIME_SECONDS = env_float(
    "QM_CONSOLIDATION_MIN_RUNTIME_SECONDS", 600.0, minimum=0.0
)
# Decayed usage: how strongly each team's recent GPU use beyond its guarantee lowers
# its share of the spare GPUs (0: weight alone), and its half-life (Slurm's default,
# a week). Guarantees never depend on it.
QM_USAGE_STRENGTH = env_float("QM_USAGE_STRENGTH", 0.0, minimum=0.0)
QM_USAGE_HALF_LIFE_SECONDS = env_float("QM_USAGE_HALF_LIFE_SECONDS", 7 * 86_400.0, minimum=1.0)
# Topology levels, outermost first, each read from a node label (on Kubernetes the
# node's own label; on the local runtime the Node row's labels): level=label-key pairs.
QM_TOPOLOGY_LABELS: dict[str, str] = {}
for _entry in env_list(
    "QM_TOPOLOGY_LABELS",
    ["block=topology.quartermaster.io/block", "rack=topology.quartermaster.io/rack"],
):
    _level, _, _key = _entry.partition("=")
    if not _level.strip() or not _key.strip():
        raise ImproperlyConfigured(
            f"QM_TOPOLOGY_LABELS: expected level=label-key pairs, got {_entry!r}"
        )
    QM_TOPOLOGY_LABELS[_level.strip()] = _key.strip()
# Webhooks: networks an admin opens to them (comma-separated CIDRs; everything
# that is not public is closed otherwise), and the time one delivery may take
# in all, from connecting to the answer's head.
QM_WEBHOOK_ALLOW_NETS = env_list("QM_WEBHOOK_ALLOW_NETS", [])
for _net in QM_WEBHOOK_ALLOW_NETS:
    try:
        ipaddress.ip_network(_net, strict=False)
    except ValueError:
        raise ImproperlyConfigured(
            f"QM_WEBHOOK_ALLOW_NETS: {_net!r} is not an IP network such as 10.1.2.0/24"
        ) from None
QM_WEBHOOK_DEADLINE_SECONDS = env_float("QM_WEBHOOK_DEADLINE_SECONDS", 5.0, minimum=0.1)
if QM_WEBHOOK_DEADLINE_SECONDS > 15:
    # A delivery run has 20 s (inside the task's 30 s limit); a longer deadline would fit none.
    raise ImproperlyConfigured("QM_WEBHOOK_DEADLINE_SECONDS must be at most 15")
# The trap's events: how many one rank of an attempt may store, and how fast a
# reported checkpoint step may run ahead of the job's last one.
QM_TRAP_EVENTS_PER_RANK = env_int("QM_TRAP_EVENTS_PER_RANK", 10_000, minimum=1)
QM_TRAP_MAX_STEPS_PER_SECOND = env_float("QM_TRAP_MAX_STEPS_PER_SECOND", 1000.0, minimum=1.0)
# How long storing an event may wait for a row the reconciler holds before the
# POST is answered 503 (the trap's log line still brings the event in later).
QM_TRAP_EVENT_LOCK_TIMEOUT_SECONDS = env_float(
    "QM_TRAP_EVENT_LOCK_TIMEOUT_SECONDS", 5.0, minimum=0.01
)

# Login throttling (portal/throttling.py): this many wrong passwords from one
# address lock that address out for the lockout time (AXES_LOCKOUT_PARAMETERS,
# with the containment settings below).
AXES_FAILURE_LIMIT = env_int("QM_LOGIN_FAILURE_LIMIT", 10, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("QM_LOGIN_LOCKOUT_MINUTES", 15, minimum=1))
AXES_LOCKOUT_CALLABLE = "portal.throttling.lockout_response"
# How many reverse proxies (an ingress, a load balancer) stand in front of the
# web server; each appends the address it saw to X-Forwarded-For.
QM_PROXY_COUNT = env_int("QM_PROXY_COUNT", 0, minimum=0)
AXES_CLIENT_IP_CALLABLE = "portal.throttling.client_address"
# Failures are what is counted; a row per successful sign-in would only grow.
AXES_DISABLE_ACCESS_LOG = True
# axes keeps a failed login's form data (the password masked); the CSRF token is masked too.
AXES_SENSITIVE_PARAMETERS = ["username", "ip_address", "csrfmiddlewaretoken"]
AXES_VERBOSE = False

# API tokens expire: a new one lasts QM_TOKEN_DEFAULT_DAYS unless its creator
# asks for another lifetime, which may not exceed QM_TOKEN_MAX_DAYS.
QM_TOKEN_DEFAULT_DAYS = env_int("QM_TOKEN_DEFAULT_DAYS", 30, minimum=1)
QM_TOKEN_MAX_DAYS = env_int("QM_TOKEN_MAX_DAYS", 365, minimum=1)
if QM_TOKEN_DEFAULT_DAYS > QM_TOKEN_MAX_DAYS:
    raise ImproperlyConfigured(
        f"QM_TOKEN_DEFAULT_DAYS ({QM_TOKEN_DEFAULT_DAYS}) exceeds QM_TOKEN_MAX_DAYS ({QM_TOKEN_MAX_DAYS})"
    )

# Containment: what one researcher or team may take of the shared control
# plane (README, "Security model").
# Jobs waiting to run (pending or requeued) that one person may have, and that
# one team may have where an admin set no limit on it or a team above it
# (quotas.Team.max_queued_jobs, inherited down the tree like priority classes).
QM_MAX_QUEUED_JOBS_PER_USER = env_int("QM_MAX_QUEUED_JOBS_PER_USER", 1000, minimum=1)
QM_MAX_QUEUED_JOBS_PER_TEAM = env_int("QM_MAX_QUEUED_JOBS_PER_TEAM", 2000, minimum=1)
QM_MAX_WEBHOOKS_PER_TEAM = env_int("QM_MAX_WEBHOOKS_PER_TEAM", 10, minimum=1)
# API requests per signed-in user and per anonymous address (portal/throttling.py),
# as N/second, N/minute, N/hour or N/day. The counts live in Django's cache, a
# per-process one unless CACHES names a shared one. The trap's events endpoint
# has its own per-rank limit (QM_TRAP_EVENTS_PER_RANK) and is not throttled here.
_RATE_PERIODS = ("second", "minute", "hour", "day")
QM_API_RATE_USER = env_str("QM_API_RATE_USER", "1200/minute") or ""
QM_API_RATE_ANON = env_str("QM_API_RATE_ANON", "120/minute") or ""
for _name, _rate in (
    ("QM_API_RATE_USER", QM_API_RATE_USER),
    ("QM_API_RATE_ANON", QM_API_RATE_ANON),
):
    _count, _, _period = _rate.partition("/")
    if not (_count.isdigit() and int(_count) > 0 and _period in _RATE_PERIODS):
        raise ImproperlyConfigured(
            f"{_name} must be a count per period such as 1200/minute "
            f"(second, minute, hour or day), got {_rate!r}"
        )
REST_FRAMEWORK["DEFAULT_THROTTLE_CLASSES"] = [
    "portal.throttling.UserRequestThrottle",
    "portal.throttling.AnonRequestThrottle",
]
# Whether /api/schema/ and /api/docs/ need a signed-in user: the schema lists
# every endpoint and field, which an outsider has no need of.
QM_API_SCHEMA_REQUIRES_SIGN_IN = env_bool("QM_API_SCHEMA_REQUIRES_SIGN_IN", True)
# A changed password revokes the user's API tokens, as it ends their sessions.
AUTH_PASSWORD_VALIDATORS.append({"NAME": "portal.password_hooks.RevokeTokensOnPasswordChange"})
# A login is locked out per address: ten wrong passwords from one address lock
# that address out (for every account, so it cannot guess its way across
# accounts either), while the account stays open from everywhere else. Locking
# the account itself would let anyone lock its owner out from afar.
AXES_LOCKOUT_PARAMETERS = ["ip_address"]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "filters": {"one_line_refusals": {"()": "portal.errors.OneLineRefusals"}},
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "filters": ["one_line_refusals"],
        }
    },
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO") or "INFO"},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        # Lockouts and repeated failures are warnings; every sign-in is not news.
        "axes": {"level": "WARNING"},
        # Django's own console handler (on with DEBUG) would print every record a
        # second time; the root handler above prints them once.
        "django": {"handlers": [], "level": "INFO", "propagate": True},
    },
}

if PRODUCTION:
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^metrics$"]
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000, minimum=0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SECURE_CONTENT_TYPE_NOSNIFF = True
    X_FRAME_OPTIONS = "DENY"
