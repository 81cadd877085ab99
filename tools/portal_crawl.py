"""Sign in to a running portal as a person and click through every page they can reach.

The `make run` smoke test (tests/smoke/) uses it against the embedded default, and it
runs by hand against any portal: `python -m tools.portal_crawl http://127.0.0.1:8000
ravi:researcher-demo-pass maria:manager-demo-pass`.

A crawl follows every same-site link of every HTML page it reaches, GET only, breadth
first, up to a page budget. It never follows a link that signs out or that names an
action which changes something (cancel, revoke, delete), so crawling leaves the portal
as it was. Every answer is read to its end, downloads included, so a response that
breaks off mid-body (a streamed export that fails half-way) counts as a failure, as
does any 5xx.
"""

from __future__ import annotations

import re
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from html.parser import HTMLParser
from urllib.parse import urldefrag, urljoin, urlsplit

import requests

# Links a visit would act on, or that lead off the portal's pages: never followed.
NOT_FOLLOWED = re.compile(
    r"logout|/cancel|/revoke|/delete|\.whl$|\.tar\.gz$|^/static/|^/api/docs",
)


@dataclass
class Crawl:
    """What one person's crawl saw: every page fetched with its status, and the failures."""

    user: str
    pages: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


class _Links(HTMLParser):
    """The hrefs of a page's links and the value of its CSRF token field, if any."""

    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []
        self.csrf_token = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "a" and values.get("href"):
            self.hrefs.append(values["href"] or "")
        if tag == "input" and values.get("name") == "csrfmiddlewaretoken":
            self.csrf_token = values.get("value") or ""


def _parse(html: str) -> _Links:
    parser = _Links()
    parser.feed(html)
    return parser


def sign_in(base_url: str, username: str, password: str) -> requests.Session:
    """A session signed in through the portal's own login form, as a browser would."""
    session = requests.Session()
    login = f"{base_url}/login/"
    form = session.get(login, timeout=30)
    form.raise_for_status()
    token = _parse(form.text).csrf_token
    answer = session.post(
        login,
        data={"username": username, "password": password, "csrfmiddlewaretoken": token},
        headers={"Referer": login},
        timeout=30,
    )
    if urlsplit(answer.url).path.rstrip("/") == "/login":
        raise RuntimeError(f"signing in as {username} failed (answer {answer.status_code})")
    return session


def crawl(base_url: str, username: str, password: str, *, max_pages: int = 400) -> Crawl:
    """Sign in as `username` and fetch every page reachable from the dashboard."""
    base_url = base_url.rstrip("/")
    started = time.monotonic()
    result = Crawl(user=username)
    session = sign_in(base_url, username, password)
    queue: deque[str] = deque(["/"])
    queued = {"/"}
    while queue and len(result.pages) < max_pages:
        path = queue.popleft()
        try:
            answer = session.get(base_url + path, timeout=60, allow_redirects=True)
            body = answer.content  # read to the end: a broken-off body raises here
        except requests.RequestException as error:
            result.failures.append(f"GET {path}: {type(error).__name__}: {error}")
            result.pages[path] = 0
            continue
        result.pages[path] = answer.status_code
        if answer.status_code >= 500:
            result.failures.append(f"GET {path} -> {answer.status_code}")
            continue
        if "text/html" not in answer.headers.get("Content-Type", ""):
            continue
        for href in _parse(body.decode(answer.encoding or "utf-8", "replace")).hrefs:
            target, _ = urldefrag(urljoin(base_url + path, href))
            if not target.startswith(base_url + "/"):
                continue
            relative = target[len(base_url) :]
            if relative in queued or NOT_FOLLOWED.search(relative):
                continue
            queued.add(relative)
            queue.append(relative)
    result.seconds = time.monotonic() - started
    return result


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    base_url, people = argv[0], argv[1:]
    failing = 0
    for person in people:
        username, _, password = person.partition(":")
        result = crawl(base_url, username, password)
        print(f"{username}: {len(result.pages)} pages in {result.seconds:.1f} s")
        for failure in result.failures:
            print(f"  FAIL {failure}")
        failing += len(result.failures)
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
