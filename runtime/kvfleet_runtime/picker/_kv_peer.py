"""Who is at the other end of a KV-event connection (issue 44): a subscription must not take a
view of the fleet from a process that is not the replica.

vLLM's publisher binds a ZMQ PUB socket (`tcp://*:PORT`, or `ipc://PATH`) and cannot be changed
without patching vLLM, so ZMQ CURVE (which needs the publisher's keys) is out. What the router
can do alone is check, at every connection its SUB socket makes (the socket monitor's CONNECTED
event carries the connection's file descriptor), which user owns the other end:

- `ipc://PATH`: the kernel says (`SO_PEERCRED`, the peer process' uid). Another user cannot
  have bound PATH first when its folder is the fleet user's own (mode 0700, the laptop set-up's
  `$XDG_RUNTIME_DIR`).
- `tcp://` on loopback: the server side of this very connection is a row of /proc/net/tcp (its
  local address is our peer address, its remote address ours), whose uid column is the owner
  of the process that accepted it. A process of another user that bound the port before vLLM
  (the laptop-mode impersonation of issue 44) is refused.
- any other address: not checked here (another pod: the NetworkPolicy lets only the fleet reach
  it, and a process inside the replica's pod is the replica's).

A connection that fails the check is not trusted: its events are not applied and the replica's
view stays empty (affinity decides for it), with one log line per endpoint and reason.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from pathlib import Path

__all__ = ["peer_refusal"]

_PROC_NET = Path("/proc/net")


def peer_refusal(fd: int, expected_uid: int) -> str | None:
    """Why the connection on `fd` is not from a process of `expected_uid`; None when it is, or
    when its peer is not on this host (not ours to check)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError as exc:
        return f"cannot inspect the connection ({exc.strerror or exc})"
    try:
        if sock.family == socket.AF_UNIX:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                    struct.calcsize("3i"))
            _pid, uid, _gid = struct.unpack("3i", creds)
            return None if uid == expected_uid else f"the ipc peer runs as uid {uid}"
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return f"unexpected socket family {sock.family!r}"
        ours, theirs = sock.getsockname()[:2], sock.getpeername()[:2]
    except OSError as exc:
        return f"cannot inspect the connection ({exc.strerror or exc})"
    finally:
        sock.close()
    if not ipaddress.ip_address(theirs[0]).is_loopback:
        return None
    uid = _tcp_owner(server=theirs, client=ours)
    if uid is None:
        return "cannot find the loopback peer in /proc/net/tcp"
    return None if uid == expected_uid else f"the loopback peer runs as uid {uid}"


def _tcp_owner(*, server: tuple[str, int], client: tuple[str, int]) -> int | None:
    """The uid column of the row whose local address is `server` and remote is `client`."""
    want = (_address(*server), _address(*client))
    for table in ("tcp", "tcp6"):
        try:
            lines = (_PROC_NET / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 7 and (_parse(fields[1]), _parse(fields[2])) == want:
                return int(fields[7])
    return None


def _address(host: str, port: int) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    ip = ipaddress.ip_address(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped, port
    return ip, port


def _parse(field: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int] | None:
    # /proc/net/tcp{,6}: "0100007F:1F90", the address as the kernel's 32-bit words in host order.
    hex_ip, _, hex_port = field.partition(":")
    try:
        raw = bytes.fromhex(hex_ip)
        port = int(hex_port, 16)
    except ValueError:
        return None
    words = b"".join(struct.pack("=I", w) for w in struct.unpack(f">{len(raw) // 4}I", raw))
    host = socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)
    return _address(host, port)
