"""The portal's settings with the test database in a file, for `make test`'s second
pytest run: the pages, the API, the exports and the scheduling cycle again on the
embedded default's SQLite (SQLITE_TESTS in the Makefile).

Run as `DATABASE_URL=sqlite:///<file> QM_SQLITE_TEST_NAME=<file> pytest --ds
tests.sqlite_settings ...`; pytest-django would otherwise use an in-memory database,
whose locking differs from the file database `make run` uses. Under pytest-xdist each
worker gets `<file>_gw0`, ... from pytest-django, and a QM_VAR_DIR of its own from
tests/worker_settings.py."""

import os

from tests.worker_settings import *  # noqa: F403
from tests.worker_settings import DATABASES

DATABASES["default"]["TEST"] = {"NAME": os.environ["QM_SQLITE_TEST_NAME"]}
