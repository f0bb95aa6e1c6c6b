"""How the agent is laid out on Ray Serve: replicas, admission per replica, autoscaling.

Config (agent/config.py) stays the agent's one configuration, the same in every replica;
ServeOptions is the shape of the deployment around it (how many agents, when to add one).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any, Mapping

from agent.engine.startup import COLD_START_S


@dataclass(frozen=True)
class ServeOptions:
    replicas: int = 1  # fixed replica count (the number of GPUs); the start when autoscaling
    autoscale: bool = False
    max_replicas: int = 0  # autoscaling ceiling; 0 = replicas (no growth)
    target_calls_per_replica: float = 4.0  # the policy adds replicas above this many calls each
    gpu_util_high: float = 0.9  # ... or when the replicas' mean GPU utilisation passes this
    upscale_delay_s: float = 5.0
    # Scale down slowly: a replica is only worth removing once calls have stayed low a while.
    downscale_delay_s: float = 600.0
    look_back_s: float = 30.0  # the window Serve averages replica metrics over
    # A removed replica first drains (no new calls, current ones go on); longer than any call.
    graceful_shutdown_s: float = 3600.0
    max_offers_per_s: float = 20.0  # new calls a replica accepts per second (the design's rate per GPU)
    num_gpus: float = -1.0  # per replica; -1 = one where the cluster has GPUs, else none
    num_cpus: float = 1.0  # per replica when it has no GPU (tests use a fraction)
    # Requests a replica handles at once: open SSE streams count, so far above Serve's default 5.
    max_ongoing_requests: int = 256
    stats_period_s: float = 1.0  # how often replicas report active calls to the router
    health_check_period_s: float = 2.0  # how often Serve asks each replica check_health()
    # How long a replica may take to answer one check; three misses in a row and Serve stops it,
    # with every call it carries. A replica that died is known at once (its actor's death), so
    # this only judges a live one that is slow: at 5 s a loaded test machine (a CPU hog, a
    # compile, a second agent) had both replicas, calls and all, stopped in mid-test. Serve's
    # own default.
    health_check_timeout_s: float = 30.0
    # How long a replica's engine may take to start (load, compile, capture) before the replica
    # gives up and Serve replaces it. A replica that gives up loses its compile and the next one
    # starts it over, so this covers a cold start (COLD_START_S, docs/ray-serve.md "Start-up"):
    # at 300 s a real model compiling its steps was replaced in a loop.
    start_timeout_s: float = COLD_START_S


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    d = ServeOptions()
    p.add_argument("--ray", action="store_true", help="run as Ray Serve replicas (needs the `serve` extra)")
    p.add_argument("--replicas", type=int, default=d.replicas, help="with --ray: agent replicas (one per GPU)")
    p.add_argument("--autoscale", action="store_true", help="with --ray: add/remove replicas on calls and GPU load")
    p.add_argument("--max-replicas", type=int, default=d.max_replicas, help="with --autoscale: ceiling")
    p.add_argument(
        "--target-calls-per-replica",
        type=float,
        default=d.target_calls_per_replica,
        help="with --autoscale: calls per replica above which one is added",
    )
    p.add_argument(
        "--max-offers-per-s",
        type=float,
        default=d.max_offers_per_s,
        help="with --ray: new calls per second a replica accepts (503 + Retry-After beyond)",
    )
    p.add_argument(
        "--replica-start-timeout-s",
        dest="start_timeout_s",
        type=float,
        default=d.start_timeout_s,
        help="with --ray: how long a replica's engine may take to load and compile before Serve replaces it "
        "(covers a cold compile; see docs/ray-serve.md)",
    )


def options_from(values: Mapping[str, Any]) -> ServeOptions:
    """ServeOptions from parsed flags or a Serve config file's args (unknown keys ignored)."""
    names = {f.name for f in fields(ServeOptions)}
    return ServeOptions(**{k: v for k, v in values.items() if k in names})
