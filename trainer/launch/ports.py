"""TCP ports for a server another process will bind later (``ray start``'s components, torchrun's store): free now,
and out of the way of the ports the kernel hands to outgoing connections meanwhile.

A port from ``bind(port 0)`` comes from the kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``,
32768-60999 by default), the same range every ``connect()`` draws its local port from. Released for a server that
binds it seconds later, it may be taken by any outgoing connection in between (Ray's processes open many), and the
server then fails with EADDRINUSE. :func:`free_ports` takes ports below that range instead, where no connection
is given one, and falls back to the kernel's choice only where there is no room below it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
EPHEMERAL_DEFAULT = (32768, 60999)  # Linux's default ip_local_port_range (Documentation/networking/ip-sysctl.rst)
FLOOR = 20000  # the lowest port taken: below it lie many services' well-known ports (and Ray's 10001-19999)
TRIES = 200  # random ports tried per port wanted before falling back to the kernel's choice


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range ``(low, high)``, inclusive; Linux's default where ``path`` cannot be
    read or does not hold two port numbers."""
    try:
        low, high = (int(word) for word in path.read_text().split())
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT
    return (low, high) if 0 < low <= high < 65536 else EPHEMERAL_DEFAULT


def free_ports(count: int, address: str = "", below: int | None = None) -> list[int]:
    """``count`` distinct TCP ports free on ``address`` ("" = every IPv4 address of this host) at the time of the
    call: each bound (all at once, so they differ), then released. Taken at random from ``FLOOR`` up to ``below``
    (default: the low end of :func:`ephemeral_range`); from the kernel (``bind`` to port 0) where that range has no
    room. Raises ``OSError`` when ``address`` is not this host's or no port can be had."""
    top = ephemeral_range()[0] if below is None else below
    held: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            _bind_below(sock, address, top)
        return [int(sock.getsockname()[1]) for sock in held]
    finally:
        for sock in held:
            sock.close()


def _bind_below(sock: socket.socket, address: str, top: int) -> None:
    """Bind ``sock`` on ``address`` to a random free port in [``FLOOR``, ``top``), or to the kernel's choice when
    that range is empty or :data:`TRIES` ports of it were taken."""
    rng = random.SystemRandom()
    if top - FLOOR > 0:
        for _ in range(TRIES):
            try:
                sock.bind((address, rng.randrange(FLOOR, top)))
                return
            except OSError:
                continue
    sock.bind((address, 0))
