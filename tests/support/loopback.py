"""Shared by the tests (imported, not a test): a free TCP port on the loopback interface, and
the flags that serve the tiny agent on it."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Below the kernel's ephemeral range (where bind(0) draws) and above Ray's default worker ports
# (10002-19999): a port from here is given to no process that does not ask for it by number.
_QUIET_LOW = 20000
_TRIES = 200


def free_port() -> int:
    """A loopback port nothing listens on now, from below the kernel's ephemeral range. The
    server that takes it binds it seconds later (an agent loads its model first; Serve starts a
    Ray cluster), and a port bind(0) drew could be drawn by any process's bind(0) in between:
    Ray's workers took a Serve proxy's port so (CI, 2026-12-06: "Failed to bind to address")."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    ports = range(_QUIET_LOW, ephemeral_low)
    for port in random.sample(ports, min(_TRIES, len(ports))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use
                continue
            return port
    raise RuntimeError(f"no free loopback port in {_QUIET_LOW}-{ephemeral_low - 1}")


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
