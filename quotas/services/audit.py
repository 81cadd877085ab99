"""The audit row every configuration write leaves when a person acted, and the UNSET
marker of a field a change leaves alone. Shared by the services of this package;
it writes only the audit row, inside the caller's transaction.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AbstractBaseUser

from quotas.models import AuditEntry, Team

UNSET: Any = object()


def audit(
    *,
    actor: AbstractBaseUser | None,
    action: str,
    obj: Any,
    team: Team | None,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    reason: str = "",
) -> None:
    AuditEntry.objects.create(
        actor=actor if actor is not None and actor.is_authenticated else None,
        action=action,
        object_type=type(obj)._meta.model_name,
        object_id=str(obj.pk),
        object_repr=str(obj)[:200],
        team=team,
        before=before,
        after=after,
        reason=reason.strip()[:300],
    )
