"""Quartermaster's one settings module, read from the environment.

With no environment at all it runs the embedded default: SQLite under var/,
a Celery broker on local disk, the local runtime and a generated secret key.
Set QM_PRODUCTION=1 for a deployment: then SECRET_KEY is required and the
security settings that `manage.py check --deploy` asks for are on.
"""

from __future__ import annotations

from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from core.env import (
    env_bool,
    env_choice,
    env_float,
    env_int,
    env_list,
    env_str,
    parse_database_url,
    read_or_create_secret,
)

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("QM_VAR_DIR", str(BASE_DIR / "var")) or BASE_DIR / "var")

PRODUCTION = env_bool("QM_PRODUCTION", False)
DEBUG = env_bool("DEBUG", not PRODUCTION)

_secret = env_str("SECRET_KEY")
if _secret is None:
    if PRODUCTION:
        raise ImproperlyConfigured("SECRET_KEY must be set when QM_PRODUCTION is on")
    _secret = read_or_create_secret(VAR_DIR / "secret_key")
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
    "portal",
    "quotas",
    "preemption",
    "telemetry",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "portal.urls"
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
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    Path(DATABASES["default"]["NAME"]).parent.mkdir(parents=True, exist_ok=True)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
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
    # The interactive docs are served from the installed sidecar, never a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# Celery: Redis in production and tests, a broker on local disk by default.
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", "qmdisk://") or "qmdisk://"
if not CELERY_BROKER_URL.startswith(
    ("qmdisk://", "filesystem://", "redis://", "rediss://", "memory://")
):
    raise ImproperlyConfigured(
        f"CELERY_BROKER_URL must start with qmdisk:// (on local disk), redis:// or rediss://, got {CELERY_BROKER_URL!r}"
    )
BROKER_DIR = VAR_DIR / "broker"
if CELERY_BROKER_URL.startswith(("qmdisk://", "filesystem://")):
    for sub in ("out", "processed", "control"):
        (BROKER_DIR / sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(BROKER_DIR / "out"),
        "data_folder_out": str(BROKER_DIR / "out"),
        "processed_folder": str(BROKER_DIR / "processed"),
        "control_folder": str(BROKER_DIR / "control"),
        "store_processed": False,
        "polling_interval": 0.2,
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
QM_CYCLE_SECONDS = env_float("QM_CYCLE_SECONDS", 1.0, minimum=0.1)
QM_SAMPLE_SECONDS = env_float("QM_SAMPLE_SECONDS", 15.0, minimum=1.0)

# Runtimes.
QM_RUNTIME = env_choice("QM_RUNTIME", "local", ("local", "kubernetes"))
QM_RUNS_DIR = Path(env_str("QM_RUNS_DIR", str(VAR_DIR / "runs")) or VAR_DIR / "runs")
QM_CHECKPOINTS_DIR = Path(
    env_str("QM_CHECKPOINTS_DIR", str(VAR_DIR / "checkpoints")) or VAR_DIR / "checkpoints"
)
# The local runtime's virtual nodes: name:flavor:gpus, comma-separated. Empty
# means "the nodes in the database".
QM_LOCAL_NODES = env_str("QM_LOCAL_NODES", "") or ""
QM_K8S_NAMESPACE = env_str("QM_K8S_NAMESPACE", "quartermaster") or "quartermaster"
QM_K8S_NAMESPACE_PER_TEAM = env_bool("QM_K8S_NAMESPACE_PER_TEAM", False)
QM_K8S_KUBECONFIG = env_str("QM_K8S_KUBECONFIG", "") or ""
QM_PUBLIC_URL = env_str("QM_PUBLIC_URL", "http://127.0.0.1:8000") or "http://127.0.0.1:8000"
QM_MAX_ATTEMPTS = env_int("QM_MAX_ATTEMPTS", 5, minimum=1)
QM_RETRY_BACKOFF_SECONDS = env_float("QM_RETRY_BACKOFF_SECONDS", 10.0, minimum=0.0)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO") or "INFO"},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
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
