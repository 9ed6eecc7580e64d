"""A loopback port nothing listens on: for a server or a rendezvous started right after, or to be refused."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """Free when this returns (its socket is closed: a connection to it is refused until something binds it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
