"""The TCP connections of a process group and of its store, found in ``/proc``.

An abort must fail a collective or a formation blocked on a dead or stopped peer at
once, and gloo offers no call for it: the agent shuts down the connections a
generation's group opened (``group_sockets``), and a formation's watcher the
store's (``shut_down_store_connections``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


def sockets() -> dict[int, int]:
    """This process's sockets: descriptor number → inode."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(name)] = int(target[8:-1])
    return out


def _tcp_sockets() -> dict[int, tuple[int, int, str]]:
    """Every TCP socket of the host's network namespace: inode → (local port,
    remote port, state; "0A" is listening)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    local, remote = (int(c.rsplit(":", 1)[1], 16) for c in cols[1:3])
                    out[int(cols[9])] = (local, remote, cols[3])
        except FileNotFoundError:
            pass
    return out


def shut_down_store_connections(port: int) -> int:
    """Shuts down this process's connections to or from the store on ``port`` (the
    client's, and the server's side where this process serves it); returns how many.
    Each descriptor is duplicated and its inode checked first, so a number closed
    and reused meanwhile is left alone; shutdown(2) acts on the socket, so closing
    the duplicate leaves the store's own descriptor open."""
    tcp = _tcp_sockets()
    count = 0
    for fd, inode in sockets().items():
        local, remote, state = tcp.get(inode, (0, 0, "0A"))
        if state == "0A" or port not in (local, remote):
            continue
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            if os.fstat(dup).st_ino != inode:
                continue
            with socket.socket(fileno=dup) as conn:
                dup = -1  # the socket object closes it
                conn.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            pass
        finally:
            if dup >= 0:
                os.close(dup)
    return count


def group_sockets(before: Mapping[int, int], store_port: int) -> list[tuple[int, int]]:
    """The connections a gloo process group opened since ``before``, as (descriptor,
    inode): not its listener (shutting that down ends the process: gloo's accept
    loop treats the error as fatal) and not the store's connections."""
    tcp = _tcp_sockets()
    out = []
    for fd, inode in sockets().items():
        if before.get(fd) == inode or inode not in tcp:
            continue
        local, remote, state = tcp[inode]
        if state != "0A" and store_port not in (local, remote):
            out.append((fd, inode))
    return out
