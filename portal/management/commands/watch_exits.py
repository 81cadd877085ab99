"""Listen for the ranks' exits and reconcile their jobs at each.

`make run` (serve_embedded) listens in its own process; a deployment that runs the
web server, the worker and beat as separate processes runs this beside them on the
machine of the local runtime's ranks, so a finished job's GPUs go to the next one at
once rather than at the next periodic pass. Where the runtime cannot tell of exits
(Kubernetes) it says so and exits 0: the periodic passes find every end.

SIGTERM or Ctrl-C stops it.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from preemption.reconcile import listen_for_exits


class Command(BaseCommand):
    help = "Reconcile each job whose ranks exit, as they exit."

    def handle(self, *args: Any, **options: Any) -> None:
        stop = threading.Event()

        def stopped(*_: Any) -> None:
            stop.set()

        signal.signal(signal.SIGINT, stopped)
        signal.signal(signal.SIGTERM, stopped)
        if not listen_for_exits(stop):
            self.stdout.write(
                f"The {settings.QM_RUNTIME} runtime does not announce exits here; "
                "the periodic reconcile passes find every end."
            )
