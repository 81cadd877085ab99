"""Where a webhook may point, and how a notice is posted there.

A webhook URL is chosen by a team manager, and the control plane posts to it
from inside the cluster, so a URL is a way to reach whatever the control plane
can reach: the cloud's metadata service, Redis, the database, the kubelet.
Before registration and again before every delivery the host is resolved and
every address it resolves to must be publicly routable; an address is refused
if it is loopback, private, link-local (metadata services live there),
multicast, reserved, unspecified, shared (carrier-grade NAT) or otherwise not
global, whether written as IPv4, IPv6, or IPv4 inside IPv6 (mapped, 6to4,
NAT64). An admin may open specific networks with QM_WEBHOOK_ALLOW_NETS.

The post then connects to the address that was checked, never to a second
resolution of the name, so a DNS answer that changes between the check and
the connection (DNS rebinding) cannot redirect it. HTTPS still verifies the
certificate against the URL's host name.

http.client (the standard library's HTTP/1.1 client) does the protocol, and
does not follow redirects. What it lacks is an overall deadline: its timeout
applies to each read, so a receiver that drips one byte at a time can hold a
connection for ever. A timer shuts the socket down when the delivery's
deadline passes, which ends any read in progress at once.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# IPv6 prefixes that carry an IPv4 address a gateway would forward to.
NAT64 = ipaddress.ip_network("64:ff9b::/96")


class DestinationRefused(Exception):
    """The URL points (or now resolves) somewhere a webhook may not go."""


class DeliveryTimeout(Exception):
    """The receiver did not answer within the delivery's deadline."""


@dataclass(frozen=True)
class Destination:
    """A checked URL: its parts, and the one address a post will connect to."""

    scheme: str
    host: str
    port: int
    target: str
    address: str

    @property
    def origin(self) -> str:
        """Scheme and host, the most of a webhook URL that may be logged."""
        return f"{self.scheme}://{self.host}"


def parse_networks(values: Iterable[str]) -> list[Network]:
    """The allow-list's networks; raises ValueError naming a bad entry."""
    networks: list[Network] = []
    for value in values:
        try:
            networks.append(ipaddress.ip_network(value.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{value!r} is not an IP network such as 10.1.2.0/24") from None
    return networks


def _embedded_ipv4(address: Address) -> ipaddress.IPv4Address | None:
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def why_not_public(address: Address) -> str | None:
    """Why a webhook may not reach `address` (None when it may)."""
    inner = _embedded_ipv4(address)
    if inner is not None:
        reason = why_not_public(inner)
        return f"{reason} (inside {address})" if reason else None
    for test, name in (
        (address.is_loopback, "a loopback address"),
        (address.is_link_local, "a link-local address (where metadata services live)"),
        (address.is_multicast, "a multicast address"),
        (address.is_unspecified, "the unspecified address"),
        (address.is_reserved, "a reserved address"),
        (address.is_private, "a private address"),
        # fec0::/10, deprecated by RFC 3879 but still routed inside some sites;
        # Python counts it neither private nor reserved, and calls it global.
        (
            isinstance(address, ipaddress.IPv6Address) and address.is_site_local,
            "a site-local address",
        ),
    ):
        if test:
            return name
    if not address.is_global:
        return "not a public address"
    return None


def _allowed(address: Address, allow: list[Network]) -> bool:
    return any(address.version == net.version and address in net for net in allow)


def check_destination(url: str, *, allow: list[Network]) -> Destination:
    """Resolve `url`'s host and return where a post will connect, or raise
    DestinationRefused saying why it may not."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise DestinationRefused(f"The URL is malformed: {exc}.") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise DestinationRefused("Only http and https URLs can receive notices.")
    host = parts.hostname
    if not host:
        raise DestinationRefused("The URL has no host.")
    if parts.username is not None or parts.password is not None:
        raise DestinationRefused("Credentials in the URL are not allowed; use the secret.")
    port = port or (443 if scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise DestinationRefused(f"The host {host} cannot be resolved.") from None
    addresses: list[Address] = []
    for info in infos:
        # Drop an IPv6 zone ("fe80::1%eth0"); the address alone decides.
        text = str(info[4][0]).split("%", 1)[0]
        address = ipaddress.ip_address(text)
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise DestinationRefused(f"The host {host} cannot be resolved.")
    for address in addresses:
        if _allowed(address, allow):
            continue
        reason = why_not_public(address)
        if reason is not None:
            raise DestinationRefused(
                f"The host {host} resolves to {address}, {reason}; webhooks may reach only "
                "public addresses (an admin may open a network with QM_WEBHOOK_ALLOW_NETS)."
            )
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return Destination(scheme, host, port, target, str(addresses[0]))


def _connect(destination: Destination, timeout: float, expired: threading.Event) -> socket.socket:
    sock = socket.create_connection((destination.address, destination.port), timeout)
    if expired.is_set():
        sock.close()
        raise DeliveryTimeout("the deadline passed while connecting")
    return sock


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to the checked address; the Host header still names the host."""

    def __init__(self, destination: Destination, timeout: float, expired: threading.Event) -> None:
        super().__init__(destination.host, destination.port, timeout=timeout)
        self.destination = destination
        self.expired = expired

    def connect(self) -> None:
        self.sock = _connect(self.destination, self.timeout, self.expired)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """As above, over TLS, verifying the certificate against the URL's host."""

    def __init__(self, destination: Destination, timeout: float, expired: threading.Event) -> None:
        self.tls = ssl.create_default_context()
        super().__init__(destination.host, destination.port, timeout=timeout, context=self.tls)
        self.destination = destination
        self.expired = expired

    def connect(self) -> None:
        # The plain socket is in place first, so the deadline can cut a slow handshake too.
        self.sock = _connect(self.destination, self.timeout, self.expired)
        self.sock = self.tls.wrap_socket(self.sock, server_hostname=self.destination.host)


def post(destination: Destination, body: bytes, headers: dict[str, str], *, deadline: float) -> int:
    """POST `body` and return the status code, all within `deadline` seconds
    (connecting, sending, and reading the answer's head). Redirects are not
    followed: a 3xx is just a status. Raises DeliveryTimeout or OSError."""
    started = time.monotonic()
    expired = threading.Event()
    cls = _PinnedHTTPSConnection if destination.scheme == "https" else _PinnedHTTPConnection
    connection = cls(destination, deadline, expired)

    def cut() -> None:
        expired.set()
        sock = connection.sock
        if sock is not None:
            # Already closed or never connected: nothing left to cut.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(deadline, cut)
    timer.daemon = True
    timer.start()
    try:
        connection.request("POST", destination.target, body=body, headers=headers)
        response = connection.getresponse()
        status = response.status
        if expired.is_set():
            raise DeliveryTimeout(f"no answer within {deadline:g} s")
        return status
    except DeliveryTimeout:
        raise
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set() or time.monotonic() - started >= deadline:
            raise DeliveryTimeout(f"no answer within {deadline:g} s") from None
        if isinstance(exc, OSError):
            raise
        raise OSError(f"bad answer: {type(exc).__name__}") from None
    finally:
        timer.cancel()
        connection.close()
