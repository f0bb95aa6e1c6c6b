"""One Serve replica = one whole agent: its engine thread, its aiortc peers, its calls.

The replica builds the same aiohttp application the single-process agent serves, on a Unix
socket of its own, and hands Serve an ASGI bridge to it (agent/serve/relay.py). Everything
runs on the replica's user event loop: the bridge, the aiohttp app, aiortc's peers, so media
flows between the client and this replica's node and never through the proxy. The replica
names its calls `<replica id>.<call>` (Config.call_id_prefix), reports its active calls to the
router (fewest-calls placement) and its calls and GPU load to the autoscaler, and drains when
Serve removes it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import tempfile
import time
from typing import Any

import ray
from aiohttp import web
from ray import serve
from ray.serve import metrics as serve_metrics
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

from agent import metrics
from agent.config import Config
from agent.engine.factory import build_engine
from agent.engine.memory_plan import size_limits
from agent.engine.startup import timed_plan
from agent.serve.admission import OfferGate
from agent.serve.options import ServeOptions
from agent.serve.relay import AsgiBridge
from agent.server import create_app, liveness
from agent.transport.captions_http import CAPTIONS
from agent.transport.http import DRAINING, ENGINE, ENGINE_START, SESSIONS
from agent.transport.ice import restrict_ice_hosts

log = logging.getLogger(__name__)

ICE_HOST_ENV = "OMNI_AGENT_ICE_HOST"  # per node (Kubernetes: the pod's host IP), when --ice-host is not set
_REPORT_EVERY_S = 1.0
_WATCH_EVERY_S = 1.0  # how often a replica asks the controller whether it is being removed
_STARTING_LOG_EVERY_S = 30.0  # how often a starting replica logs its engine's phase


def _node_config(config: Config, replica_id: str) -> Config:
    ice_hosts = config.ice_hosts
    if not ice_hosts and os.environ.get(ICE_HOST_ENV):
        ice_hosts = tuple(h for h in os.environ[ICE_HOST_ENV].split(",") if h)
    return dataclasses.replace(config, call_id_prefix=replica_id, ice_hosts=ice_hosts)


@serve.ingress()
class AgentReplica:
    # Serve's ASGI wrapper owns the names `app` and `_asgi_app`: the aiohttp app is `web`.

    async def __init__(self, config: Config, options: ServeOptions) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._began = time.monotonic()
        # The session and context limits this replica's GPU holds (agent/engine/memory_plan.py),
        # sized off the event loop (it reads the checkpoint's config and the device's memory).
        sized, _, planned = await asyncio.to_thread(timed_plan, size_limits, _node_config(config, self.replica_id))
        self.config = config = sized
        self.options = options
        restrict_ice_hosts(config.ice_hosts)
        self.gate = OfferGate(options.max_offers_per_s)
        self._dir = tempfile.mkdtemp(prefix="omni-replica-")
        socket_path = os.path.join(self._dir, "http.sock")
        self.web = create_app(config, build_engine(config, planned=planned))
        self._runner = web.AppRunner(self.web, handle_signals=False)
        await self._runner.setup()
        await web.UnixSite(self._runner, socket_path).start()
        # Ready only once the model is: Serve routes nothing to a replica before __init__ returns.
        # A cold start compiles every step (minutes: docs/ray-serve.md "Start-up"); the timeout
        # is sized for it, since a replica that gives up here is replaced and compiles again.
        await self._wait_for_engine(options.start_timeout_s)
        self.bridge = AsgiBridge(socket_path, self.replica_id, self.gate)
        self._calls_gauge = serve_metrics.Gauge("omni_agent_active_calls", description="calls this replica carries")
        self._gpu_gauge = serve_metrics.Gauge("omni_agent_gpu_utilization_ratio", description="GPU busy ratio")
        self._report = asyncio.ensure_future(self._report_metrics())
        self._watch = asyncio.ensure_future(self._watch_for_stop())
        log.info("replica %s ready (%s)", self.replica_id, socket_path)

    async def _wait_for_engine(self, timeout_s: float) -> None:
        """Until the engine is ready (raises its load's error), saying every _STARTING_LOG_EVERY_S
        which phase it is in: Serve routes no request (no /readyz) to a replica still in its
        constructor, so its log is where a start-up is watched."""
        start, deadline = self.web[ENGINE_START], time.monotonic() + timeout_s
        while not start.done():
            left = deadline - time.monotonic()
            view = self.web[ENGINE].startup
            if left <= 0:  # the start future is not cancelled: the process ends with the replica
                raise TimeoutError(
                    f"replica {self.replica_id}: the engine was not ready in {timeout_s:.0f} s "
                    f"(--replica-start-timeout-s); still in phase {view.phase!r}, done: {view.phases}"
                )
            await asyncio.wait({start}, timeout=min(_STARTING_LOG_EVERY_S, left))
            if not start.done():
                view = self.web[ENGINE].startup
                log.info("replica %s starting: phase %s; done %s", self.replica_id, view.phase, view.phases)
        start.result()

    def __serve_build_asgi_app__(self) -> AsgiBridge:
        return self.bridge

    @property
    def active_calls(self) -> int:
        """Calls carried or being set up: every session whose offer was answered (WebSocket
        sessions have no offer), and every offer past the gate whose answer has not come back.
        So a call counts from the gate on, and a routing report taken while its offer is being
        answered is not short of it (it was, and the router put a third call on a 2-slot replica);
        it counts twice only while the answer crosses the replica's own socket."""
        sessions = tuple(self.web[SESSIONS].values())  # one step: Serve may ask from another thread
        settled = sum(1 for s in sessions if getattr(s, "answered", True))
        return settled + self.bridge.offers_in_flight

    def gpu_util(self) -> float:
        return metrics.REGISTRY.get_sample_value("agent_gpu_utilization_ratio") or 0.0

    def record_routing_stats(self) -> dict[str, Any]:
        """Read by OwnerPinnedRouter: new calls go to the replica with the fewest."""
        return {
            "active_calls": self.active_calls,
            "capacity": self.config.max_sessions,  # this replica's memory plan: routers skip it when full
            "offers": self.gate.offers,
            "draining": self.gate.draining,
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Read by CallsAndGpuPolicy through Serve's aggregated metrics."""
        return {"active_calls": float(self.active_calls), "gpu_util": self.gpu_util()}

    def check_health(self) -> None:
        # Serve's liveness check of this replica (it restarts a failing one): the same answer as
        # the replica's /livez, so an engine thread that died after loading fails it too. A
        # start-up in progress passes (a restart would only begin the compile again) until it
        # has run past the start timeout: then it is stuck, not slow.
        alive, body = liveness(self.web)
        if not alive:
            raise RuntimeError(body.get("error", "the engine thread is not running"))
        engine = self.web[ENGINE]
        if not engine.ready and time.monotonic() - self._began > self.options.start_timeout_s:
            raise RuntimeError(
                f"start-up past {self.options.start_timeout_s:.0f} s, still in phase {engine.startup.phase!r}"
            )

    async def _report_metrics(self) -> None:
        # Ray's metrics carry the deployment and replica labels: one series per replica.
        while True:
            self._calls_gauge.set(self.active_calls)
            self._gpu_gauge.set(self.gpu_util())
            await asyncio.sleep(_REPORT_EVERY_S)

    def _start_draining(self) -> None:
        """Take no new call (the gate answers 503, /healthz and /readyz say draining, the router
        ranks this replica last) and end the caption overlays' streams of the latest call, which
        would otherwise hold Serve's shutdown of this replica back."""
        if self.gate.draining:
            return
        log.info("replica %s draining: %d call(s) to finish", self.replica_id, self.active_calls)
        self.gate.draining = True
        self.web[DRAINING].set()
        self.web[CAPTIONS].release_followers()

    async def _watch_for_stop(self) -> None:
        """Drain as soon as Serve's controller marks this replica STOPPING.

        Serve runs __del__ only after every HTTP request in flight here has ended, and a call's
        SSE stream (a caption overlay through the proxy) lasts as long as the call: until then
        a proxy that has not yet heard of the removal could still place new calls here. So the
        replica reads its own state from the controller (once a second; the Serve version is
        pinned) and starts draining itself; __del__ then only waits for the calls."""
        ctx = serve.get_replica_context()
        try:
            controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except ValueError:  # no controller (not under Serve): __del__ alone drains
            return
        while not self.gate.draining:
            try:
                details = await controller.get_deployment_details.remote(ctx.app_name, ctx.deployment)
                state = next((r.state for r in details.replicas if r.replica_id == self.replica_id), None)
            except Exception:  # noqa: BLE001 - the controller restarting: ask again next second
                state = None
            if state is not None and getattr(state, "value", state) == "STOPPING":
                self._start_draining()
                return
            await asyncio.sleep(_WATCH_EVERY_S)

    async def __del__(self) -> None:
        """Serve removes this replica: take no new call, let the current ones finish, then stop."""
        if not hasattr(self, "bridge"):  # __init__ failed part way: Serve stops the actor anyway
            return
        self._start_draining()
        self._watch.cancel()
        deadline = time.monotonic() + max(0.0, self.options.graceful_shutdown_s - 5.0)
        while self.active_calls and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        log.info("replica %s stopping with %d call(s) left", self.replica_id, self.active_calls)
        self._report.cancel()
        await self.bridge.close()
        await self._runner.cleanup()
        shutil.rmtree(self._dir, ignore_errors=True)


def replica_options(options: ServeOptions, has_gpu: bool) -> dict[str, Any]:
    """Ray actor options for one replica: a whole GPU where there are GPUs."""
    gpus = options.num_gpus if options.num_gpus >= 0 else (1.0 if has_gpu else 0.0)
    return {"num_gpus": gpus, "num_cpus": options.num_cpus} if gpus else {"num_cpus": options.num_cpus}
