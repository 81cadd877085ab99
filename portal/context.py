"""Template context shared by every page: the navigation and the user's role."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest

from core.access import navigation_role


def navigation(request: HttpRequest) -> dict[str, Any]:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"nav_role": None}
    roles = (
        [] if user.is_staff else list(user.memberships.values_list("role", flat=True).distinct())
    )
    return {
        "nav_role": navigation_role(is_admin=bool(user.is_staff), roles=roles),
        # Admins submit to any team and members to theirs: the job form is offered to them.
        "can_submit": bool(user.is_staff or roles),
    }
