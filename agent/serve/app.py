"""The Serve application: AgentReplica deployments behind Serve's HTTP proxy.

`omni-agent serve --ray --replicas N` calls `run`; `serve run deploy/ray/serve.yaml` calls
`app_builder` with the file's `args` (Config fields and ServeOptions fields, by name).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import signal
import time
from typing import Any, Mapping

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from agent.config import Config
from agent.serve.autoscaling import CallsAndGpuPolicy
from agent.serve.options import ServeOptions, options_from
from agent.serve.replica import AgentReplica, replica_options
from agent.serve.router import OwnerPinnedRouter
from agent.transport.ice import parse_ice_server

log = logging.getLogger(__name__)

APP_NAME = "omni-agent"
ROUTER_PATH = f"{OwnerPinnedRouter.__module__}:{OwnerPinnedRouter.__name__}"
POLICY_PATH = f"{CallsAndGpuPolicy.__module__}:{CallsAndGpuPolicy.__name__}"


def _cluster_has_gpu() -> bool:
    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def deployment_settings(options: ServeOptions, has_gpu: bool) -> dict[str, Any]:
    """Serve deployment options (the same keys a Serve config file's `deployments:` entry takes)."""
    settings: dict[str, Any] = {
        "ray_actor_options": replica_options(options, has_gpu),
        "max_ongoing_requests": options.max_ongoing_requests,
        "graceful_shutdown_timeout_s": options.graceful_shutdown_s,
        # Serve calls the replica's __del__ (where it starts refusing offers) only after a loop
        # that waits this long between counts of in-flight HTTP requests; Serve's 2 s default
        # is a window in which a stale proxy could still place a new call on a stopping replica.
        "graceful_shutdown_wait_loop_s": 0.2,
        "health_check_period_s": options.health_check_period_s,
        "health_check_timeout_s": options.health_check_timeout_s,
        "request_router_config": RequestRouterConfig(
            request_router_class=ROUTER_PATH,
            request_routing_stats_period_s=options.stats_period_s,
            request_routing_stats_timeout_s=max(1.0, options.stats_period_s * 2),
        ),
    }
    if options.autoscale:
        settings["autoscaling_config"] = AutoscalingConfig(
            min_replicas=options.replicas,
            initial_replicas=options.replicas,
            max_replicas=max(options.replicas, options.max_replicas),
            upscale_delay_s=options.upscale_delay_s,
            downscale_delay_s=options.downscale_delay_s,
            look_back_period_s=options.look_back_s,
            metrics_interval_s=min(10.0, options.look_back_s / 2),
            policy=AutoscalingPolicy(
                policy_function=POLICY_PATH,
                policy_kwargs={
                    "target_calls_per_replica": options.target_calls_per_replica,
                    "gpu_util_high": options.gpu_util_high,
                },
            ),
        )
    else:
        settings["num_replicas"] = options.replicas
    return settings


def build(config: Config, options: ServeOptions) -> serve.Application:
    """The application to pass to serve.run (or to return from a Serve config's import path)."""
    # --device cuda asks for a GPU per replica even before GPU nodes join (KubeRay adds them).
    has_gpu = config.device == "cuda" or (config.device == "auto" and _cluster_has_gpu())
    deployment = serve.deployment(AgentReplica, name="agent").options(**deployment_settings(options, has_gpu))
    return deployment.bind(config, options)


def app_builder(args: Mapping[str, Any]) -> serve.Application:
    """`import_path: agent.serve.app:app_builder` in a Serve config; args name Config/ServeOptions fields."""
    names = {f.name for f in dataclasses.fields(Config)}
    values = {k: v for k, v in args.items() if k in names}
    for name in ("ice_hosts", "cors_origins"):
        if name in values:
            values[name] = tuple(values[name])
    if "ice_servers" in values:  # the --ice-server form ("url[,username,credential]"), a list of them
        values["ice_servers"] = tuple(parse_ice_server(s) for s in values["ice_servers"])
    unknown = set(args) - names - {f.name for f in dataclasses.fields(ServeOptions)}
    if unknown:
        raise ValueError(f"unknown args in the Serve config: {sorted(unknown)}")
    # Limits the file leaves out are sized from each replica's GPU memory (agent/engine/memory_plan.py).
    values.setdefault("sized_from_memory", tuple(n for n in ("max_sessions", "context_limit") if n not in values))
    return build(Config(**values), options_from(args))


# Serve's controller kills a proxy whose start-up answer takes over 5 s, or whose health check
# takes over 10 s three times in a row, and restarts it: on a node whose cores the replicas'
# engine threads keep busy (a CPU host, a compile at start-up) a live proxy misses those, and
# `serve.start` then fails on the killed one (seen on a loaded 2-core machine). Longer limits,
# read by the Ray processes this run starts (a cluster at RAY_ADDRESS keeps its own).
PROXY_CHECK_TIMEOUTS = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30",
}


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(config: Config, options: ServeOptions) -> None:
    """`omni-agent serve --ray`: a local Ray (or RAY_ADDRESS's cluster), the proxy on --host/--port."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # ray 2.60 otherwise writes ~/.ray/auth_token
    for name, seconds in PROXY_CHECK_TIMEOUTS.items():
        os.environ.setdefault(name, seconds)
    # SIGTERM ends the run like Ctrl-C, so the local Ray this process started goes with it.
    signal.signal(signal.SIGTERM, _interrupt)
    started_ray = not ray.is_initialized()
    if started_ray:
        address = os.environ.get("RAY_ADDRESS")
        # Serving on loopback: keep Ray's own traffic there too (no route may exist beyond it).
        node_ip = "127.0.0.1" if not address and _is_loopback(config.host) else None
        ray.init(address=address, _node_ip_address=node_ip)
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(build(config, options), name=APP_NAME, route_prefix="/")
        print(f"omni-agent: {options.replicas} Ray Serve replica(s) on http://{config.host}:{config.port}", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        if started_ray:
            ray.shutdown()
