"""Django admin for every app's records, one module per domain.

Django's admin discovery imports `portal.admin`; importing the modules here
registers their ModelAdmins.
"""

from portal.admin import preemption, quotas, telemetry, tokens

__all__ = ["preemption", "quotas", "telemetry", "tokens"]
