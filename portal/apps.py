from django.apps import AppConfig
from django.db.backends.signals import connection_created


class PortalConfig(AppConfig):
    name = "portal"
    verbose_name = "Portal"

    def ready(self) -> None:
        from core.timestamps import use_iso_loader

        # Every connection, whichever process opens it: the web server, the workers,
        # the management commands and the tests.
        connection_created.connect(use_iso_loader, dispatch_uid="core.timestamps")
