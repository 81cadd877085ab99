"""The portal's settings for one pytest process, which may be one of several (`make test`
runs the suite on pytest-xdist workers).

pytest-django already gives each worker its own test database (`test_<name>_gw0`, ...).
Everything else the settings derive from QM_VAR_DIR (runs, checkpoints, the reconcile
lock, the exit listener's marker, the gang cgroups named after the runs' root) would be
shared by the workers, so a worker takes a folder of its own under it, `<QM_VAR_DIR>/gw0`,
before the settings read it. The variable is changed in the environment, so the processes
a test starts (a Celery worker, `manage.py`, ranks) use the same folder as the test.

Those processes read `portal.settings`, as they do without xdist: this module sits in
the tests folder, which they need not be able to import (tests/conftest.py hands this
module's name to the workers themselves when xdist starts them).
"""

import os
from pathlib import Path

_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    _base = Path(os.environ.get("QM_VAR_DIR") or Path(__file__).resolve().parents[1] / "var")
    # A process this one started inherits the worker's folder already.
    if _base.name != _WORKER:
        os.environ["QM_VAR_DIR"] = str(_base / _WORKER)

from portal.settings import *  # noqa: E402, F403

if os.environ.get("DJANGO_SETTINGS_MODULE") == __name__:
    os.environ["DJANGO_SETTINGS_MODULE"] = "portal.settings"
