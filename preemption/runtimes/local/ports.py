"""Ports on this machine: a free one for a gang's rendezvous, and whether one is free.

It only probes sockets and reads the kernel's ephemeral port range.
"""

from __future__ import annotations

import errno
import random
import socket

# The lowest master port the runtime picks (see choose_master_port).
MASTER_PORT_FLOOR = 20000


def ephemeral_port_floor() -> int:
    """The lowest port the kernel hands out to outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as port_range:
            return int(port_range.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(address: str) -> int:
    """A TCP port free on `address` right now, for the gang's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])


def port_is_free(port: int) -> bool:
    """True when a fresh socket can bind the port on every IPv4 and IPv6 address.

    SO_REUSEADDR is set so that connections lingering in TIME_WAIT, which no process owns
    and the kernel clears by itself, do not count as a port still held; a listening
    socket still makes the bind fail.
    """
    families = [(socket.AF_INET, "")]
    if socket.has_ipv6:
        families.append((socket.AF_INET6, "::"))
    for family, address in families:
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind((address, port))
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return False
                if family == socket.AF_INET6:
                    # No usable IPv6 on this machine: the IPv4 check stands alone.
                    continue
                raise
    return True


def choose_master_port(promised: set[int], master_addr: str) -> int:
    """A port for the gang's rendezvous, free now and promised to no other gang here.

    It comes from below the kernel's ephemeral range where that leaves room, so an
    outgoing connection cannot take it between launch and rank 0 binding it. ``promised``
    holds the master ports of the live gangs (index.py).
    """
    ephemeral_floor = ephemeral_port_floor()
    if ephemeral_floor - MASTER_PORT_FLOOR >= 1000:
        for _ in range(100):
            port = random.randrange(MASTER_PORT_FLOOR, ephemeral_floor)
            if port not in promised and port_is_free(port):
                return port
    while True:
        port = free_port(master_addr)
        if port not in promised:
            return port
