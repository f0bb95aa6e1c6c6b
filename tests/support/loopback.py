"""Shared by the tests (imported, not a test): a free TCP port on the loopback interface, and
the flags that serve the tiny agent on it."""

from __future__ import annotations

import socket
from pathlib import Path


def free_port() -> int:
    """A port nothing listens on now (the OS picks it; a test binds it right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_args(port: int, model: Path) -> list[str]:
    """`serve` and its flags for a test agent on 127.0.0.1:`port`: the given model, one torch
    thread, no fallback model, ICE on loopback only."""
    return [
        "serve",
        "--port",
        str(port),
        "--model",
        str(model),
        "--threads",
        "1",
        "--fallback-model",
        "none",
        "--ice-host",
        "127.0.0.1",
    ]
