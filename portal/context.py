"""Template context shared by every page: the navigation and the user's role."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest


def navigation(request: HttpRequest) -> dict[str, Any]:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"nav_role": None}
    if user.is_staff:
        role = "admin"
    elif user.memberships.filter(role="manager").exists():
        role = "manager"
    else:
        role = "researcher"
    return {"nav_role": role}
