"""The password validator that ends a user's API tokens when their password changes.

A module of its own, apart from portal.auth, because it calls a service and
portal.services imports portal.auth (for hashing tokens): here it can import
the service at the top."""

from __future__ import annotations

from typing import Any

from portal.services import api_tokens_revoke_all


class RevokeTokensOnPasswordChange:
    """Revokes a user's API tokens whenever their password changes.

    Listed in AUTH_PASSWORD_VALIDATORS for Django's one hook that every password
    change passes through: `AbstractBaseUser.save()` calls each validator's
    `password_changed` after `set_password()`, whether the change came from the
    portal, the admin's password form or `manage.py changepassword`. Django
    already ends the user's sessions then; this ends their tokens too. It refuses
    no password."""

    def validate(self, password: str, user: Any = None) -> None:
        return None

    def password_changed(self, password: str, user: Any = None) -> None:
        if user is None or user.pk is None:
            return
        api_tokens_revoke_all(user=user)

    def get_help_text(self) -> str:
        return ""
