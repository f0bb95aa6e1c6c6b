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


# The degradation ladder acts on this machine's speed (the P95 of first-response latency): on
# a loaded runner it turns replies text-only and stops speculative starts, so a test about
# anything else would see a different agent depending on the load beside it. Test agents get
# thresholds no machine reaches; tests of the ladder set their own (test_ladder_rtc.py).
LADDER_NEVER_MS = 1e9
LADDER_OFF_ARGS = (
    "--text-only-p95-ms",
    str(LADDER_NEVER_MS),
    "--fallback-p95-ms",
    str(LADDER_NEVER_MS),
    "--speculation-p95-ms",
    str(LADDER_NEVER_MS),
)


def serve_args(port: int, model: Path) -> list[str]:
    """`serve` and its flags for a test agent on 127.0.0.1:`port`: the given model, one torch
    thread, no fallback model, ICE on loopback only, the ladder out of reach (LADDER_NEVER_MS)."""
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
        *LADDER_OFF_ARGS,
    ]
