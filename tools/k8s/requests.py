"""Record the API requests a Kubernetes client makes, as RBAC would see them.

Used by the RBAC test (the verbs the runtime calls are exactly those granted)
and by the observation benchmark (requests per reconcile cycle).
"""

from __future__ import annotations

import threading
import urllib.parse
from typing import Any

from kubernetes import client

Grant = tuple[str, str, str]  # (API group, resource[/subresource], verb)


def _verb(method: str, name: str | None, query: dict[str, list[str]]) -> str:
    if method == "GET":
        if name is None:
            return "watch" if query.get("watch") == ["true"] else "list"
        return "get"
    if method == "DELETE":
        return "delete" if name else "deletecollection"
    return {"POST": "create", "PATCH": "patch", "PUT": "update"}[method]


def grant_of(method: str, url: str) -> Grant:
    """The RBAC (group, resource, verb) an API request needs."""
    parsed = urllib.parse.urlparse(url)
    parts = parsed.path.strip("/").split("/")
    if parts[0] == "api":
        group, rest = "", parts[2:]
    else:
        group, rest = parts[1], parts[3:]
    if rest[0] == "namespaces" and len(rest) >= 3:
        rest = rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else None
    if len(rest) > 2:
        resource = f"{resource}/{rest[2]}"
        # A subresource is created (eviction) or read (log), never listed.
        return group, resource, "create" if method == "POST" else "get"
    if method == "POST":
        name = None
    return group, resource, _verb(method, name, urllib.parse.parse_qs(parsed.query))


class Recorder:
    """Records every request an ApiClient sends."""

    def __init__(self, api: client.ApiClient) -> None:
        self.grants: set[Grant] = set()
        self.log: list[Grant] = []
        self._lock = threading.Lock()
        send = api.rest_client.request

        def request(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
            grant = grant_of(method, url)
            with self._lock:
                self.grants.add(grant)
                self.log.append(grant)
            return send(method, url, *args, **kwargs)

        api.rest_client.request = request

    def count(self, group: str, resource: str, verb: str) -> int:
        """How many requests so far needed (group, resource, verb)."""
        with self._lock:
            return self.log.count((group, resource, verb))
