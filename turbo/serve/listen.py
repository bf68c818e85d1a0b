"""Where a server listens: the bound socket (`listening`) and its URL (`address`), for the local
server (main.py) and Ray Serve's proxy (ray_app.py) alike."""

from __future__ import annotations

import socket


def listening(host: str, port: int) -> socket.socket:
    """The bound socket (a port in use is one line here, not uvicorn's log and exit 1)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"serve.host={host} serve.port={port}: cannot listen there ({e.strerror or e})") from None
    sock.set_inheritable(True)
    return sock


def address(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
