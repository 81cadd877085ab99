from django.apps import AppConfig
from django.db.backends.signals import connection_created

from core.timestamps import use_iso_loader


class PortalConfig(AppConfig):
    name = "portal"
    verbose_name = "Portal"

    def ready(self) -> None:
        # Every connection, whichever process opens it: the web server, the workers,
        # the management commands and the tests.
        connection_created.connect(use_iso_loader, dispatch_uid="core.timestamps")
