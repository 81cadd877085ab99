"""Leave the rendezvous port free for the next attempt.

Rank 0 hosts the TCP store that every rank connects to on ``MASTER_PORT``. Whichever
end of a TCP connection closes first keeps a TIME_WAIT entry on its own port for a
minute. When rank 0 exits while other ranks are still connected, those entries sit on
``MASTER_PORT`` and a plain ``bind()`` by the next attempt fails. So rank 0 waits until
every other rank has disconnected, and then resets (rather than closes) its own
remaining connections on that port, which leaves no TIME_WAIT entry anywhere.

This reads ``/proc``; on systems without it the functions do nothing. The trap is
installed into training images beside torch and brings no compiled dependency of its
own, so it reads the two socket tables itself rather than through psutil.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from dataclasses import dataclass

_LISTEN = "0A"
_PROC_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


@dataclass(frozen=True, slots=True)
class _Connection:
    local_port: int
    remote_port: int
    state: str
    inode: int


def _connections() -> list[_Connection]:
    found: list[_Connection] = []
    for table in _PROC_TABLES:
        try:
            with open(table) as handle:
                lines = handle.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            found.append(
                _Connection(
                    local_port=int(fields[1].rsplit(":", 1)[1], 16),
                    remote_port=int(fields[2].rsplit(":", 1)[1], 16),
                    state=fields[3],
                    inode=int(fields[9]),
                )
            )
    return found


def _own_sockets() -> dict[int, int]:
    """Socket inode -> file descriptor, for this process."""
    owned: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return owned
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            owned[int(target[8:-1])] = int(name)
    return owned


def _foreign_peers(port: int, owned: dict[int, int]) -> int:
    """Connections accepted on ``port`` whose other end is not in this process."""
    connections = _connections()
    own_client_ports = {
        c.local_port for c in connections if c.remote_port == port and c.inode in owned
    }
    return sum(
        1
        for c in connections
        if c.local_port == port
        and c.state != _LISTEN
        and c.inode in owned
        and c.remote_port not in own_client_ports
    )


def release_rendezvous_port(port: int, timeout: float) -> bool:
    """Called by rank 0 just before it exits; True when no other rank was still connected.

    Waits up to ``timeout`` seconds for the other ranks to disconnect from ``port``,
    then sets a zero linger time on this process's remaining connections on it so
    that closing them at exit resets them instead of leaving TIME_WAIT entries.
    """
    if not os.path.isdir("/proc/self/fd"):
        return True
    deadline = time.monotonic() + max(0.0, timeout)
    owned = _own_sockets()
    while _foreign_peers(port, owned) and time.monotonic() < deadline:
        time.sleep(0.02)
        owned = _own_sockets()
    clean = _foreign_peers(port, owned) == 0
    for connection in _connections():
        touches_port = port in (connection.local_port, connection.remote_port)
        if touches_port and connection.state != _LISTEN and connection.inode in owned:
            _reset_on_close(owned[connection.inode])
    return clean


def _reset_on_close(fd: int) -> None:
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    finally:
        # The descriptor belongs to the TCP store; only the option was ours to change.
        sock.detach()
