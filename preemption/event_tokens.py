"""The trap's credentials: one events token per attempt.

A token is an HMAC of the attempt's id and a random key stored on the attempt,
keyed by the portal's SECRET_KEY (Django's `salted_hmac`). The database holds
only the random key, so a copy of the database alone cannot post events, and
the admin has no token to show. The token is derived rather than drawn once
and hashed because a launch that fails half-way is tried again: the ranks that
did start keep a token that must stay valid, and a derived token is the same
at every try.

A token is accepted only while its attempt is open: it expires with the
attempt, whatever the runtime still has in its environment or Secret.
"""

from __future__ import annotations

import hmac

from django.conf import settings
from django.utils.crypto import salted_hmac

from preemption.models import Attempt, Job

KEY_SALT = "quartermaster.trap-events"


def _derive(attempt: Attempt, secret: str) -> str:
    value = f"{attempt.pk}:{attempt.events_key}"
    return salted_hmac(KEY_SALT, value, secret=secret, algorithm="sha256").hexdigest()


def attempt_events_token(attempt: Attempt) -> str:
    """The token the runtime hands to every rank of `attempt` as QM_EVENTS_TOKEN."""
    return _derive(attempt, settings.SECRET_KEY)


def _matches(attempt: Attempt, token: str) -> bool:
    if not attempt.events_key:
        return False
    # Tokens made before a SECRET_KEY rotation stay valid while the old key is
    # listed in SECRET_KEY_FALLBACKS, as Django does for sessions.
    for secret in (settings.SECRET_KEY, *getattr(settings, "SECRET_KEY_FALLBACKS", [])):
        # Compare in constant time so the token cannot be guessed byte by byte.
        if hmac.compare_digest(_derive(attempt, secret).encode(), token.encode("utf-8", "replace")):
            return True
    return False


def attempt_for_token(job: Job, token: str) -> Attempt | None:
    """The attempt of `job` whose token this is (open or ended), or None."""
    for attempt in Attempt.objects.filter(job=job).order_by("-number"):
        if _matches(attempt, token):
            return attempt
    return None
