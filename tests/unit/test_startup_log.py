"""The engine's start-up log (agent/engine/startup.py): what it says while the engine starts.

Pins:
- StartupLog: the running phase is STARTING before any, then the last begun; phases are listed in
  the order they finished, READY last (and the running phase once ready);
- each finished phase sets agent_startup_seconds{phase} to its seconds (read back from the registry);
- PhaseBegun/PhaseDone cross a spawn-context queue (the engine process's outbox) unchanged, and a
  StartupLog fed from the other end says what one fed directly says;
- the process engine's reader thread turns ("startup", event) messages into its log, READY once
  the child's ("ready", ...) comes, without a child process;
- compile phases: one per compiled step, seconds summed over buckets, the cache's answer in the
  detail when the compiler reports one (and no failure when it does not);
- timed_plan hands back the plan's result and a PLAN phase;
- a real thread engine on the tiny model reports load, then build, then ready, and while it is
  held after its build, /readyz (503) and /healthz carry the phase and the finished phases;
- Serve's replica start timeout covers the documented cold start, and its flag sets it; the
  KubeRay startupProbe allows that and as long again (a first start's download).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import queue
import threading
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web
from support.realtime_helpers import agent_config

from agent.config import Config
from agent.engine.api import Voices
from agent.engine.factory import build_engine
from agent.engine.process import ProcessEngine
from agent.engine.startup import (
    BUILD,
    COLD_START_S,
    LOAD,
    PLAN,
    READY,
    STARTING,
    PhaseBegun,
    PhaseDone,
    PhaseTimer,
    StartupLog,
    compile_phases,
    timed_plan,
)
from agent.metrics import REGISTRY
from agent.serve.options import ServeOptions, add_serve_flags, options_from
from agent.server import create_app
from agent.transport.http import ENGINE_START

ROOT = Path(__file__).resolve().parents[2]
_HOLD_S = 60.0  # a held start gives up after this, so a failing test never leaves a thread waiting


def _gauge(phase: str) -> float | None:
    return REGISTRY.get_sample_value("agent_startup_seconds", {"phase": phase})


def test_phases_in_order_and_the_running_one() -> None:
    log = StartupLog()
    timer = PhaseTimer(log.apply)
    assert log.phase == STARTING and log.view().finished == ()
    log.apply(PhaseDone(PLAN, 0.25))
    timer.begin(LOAD)
    assert log.phase == LOAD
    timer.end(LOAD, "cpu")
    assert log.phase == LOAD  # the last begun, until the next begins
    timer.begin(BUILD)
    assert log.phase == BUILD and log.view().phases.keys() == {PLAN, LOAD}
    timer.end(BUILD)
    timer.record(PhaseDone("compile:thinker_decode", 1.5, "cache miss"))
    log.ready()
    view = log.view()
    assert view.phase == READY
    assert [name for name, _ in view.finished] == [PLAN, LOAD, BUILD, "compile:thinker_decode", READY]
    assert view.phases[PLAN] == 0.25 and view.phases["compile:thinker_decode"] == 1.5


def test_each_finished_phase_sets_its_gauge() -> None:
    log = StartupLog()
    timer = PhaseTimer(log.apply)
    timer.begin(LOAD)
    load = timer.end(LOAD)
    timer.record(PhaseDone("compile:gauge_probe", 7.0))
    ready = log.ready()
    assert _gauge(LOAD) == load.seconds
    assert _gauge("compile:gauge_probe") == 7.0
    assert _gauge(READY) == ready.seconds
    assert _gauge("compile:never_ran") is None  # only phases that finished have a series


def test_events_cross_the_engine_process_queue_unchanged() -> None:
    outbox = multiprocessing.get_context("spawn").Queue()
    timer = PhaseTimer(lambda event: outbox.put(("startup", event)))
    timer.begin(LOAD)
    sent = [PhaseBegun(LOAD), timer.end(LOAD, "cuda, bfloat16"), PhaseDone("compile:talker_step", 3.0, "cache hit")]
    timer.record(sent[-1])
    received = [outbox.get(timeout=10) for _ in sent]
    outbox.close()
    assert [kind for kind, _ in received] == ["startup"] * 3
    assert [event for _, event in received] == sent
    assert all(type(got) is type(want) for (_, got), want in zip(received, sent))
    log = StartupLog()
    for _, event in received:
        log.apply(event)
    assert log.view().finished == ((LOAD, sent[1].seconds), ("compile:talker_step", 3.0))


async def test_the_process_engine_reader_keeps_the_log() -> None:
    engine = ProcessEngine(Config(), (None, None), 8, False, 1)  # type: ignore[arg-type]  (never started)
    engine._loop = asyncio.get_running_loop()
    engine._ready = engine._loop.create_future()
    engine._outbox = queue.Queue()  # what the child would send, in its order
    for message in (
        ("startup", PhaseBegun(LOAD)),
        ("startup", PhaseDone(LOAD, 2.0)),
        ("startup", PhaseBegun(BUILD)),
    ):
        engine._outbox.put(message)
    reader = threading.Thread(target=engine._read, daemon=True)
    reader.start()
    while engine.startup.phase != BUILD:
        await asyncio.sleep(0.01)
    assert engine.startup.phases == {LOAD: 2.0} and not engine.ready
    engine._outbox.put(("startup", PhaseDone(BUILD, 5.0)))
    engine._outbox.put(("ready", Voices()))
    await asyncio.wait_for(engine._ready, 10)
    engine._outbox.put(("stopped",))
    reader.join(10)
    view = engine.startup
    assert view.phase == READY and [name for name, _ in view.finished] == [LOAD, BUILD, READY]


class _Compiler:
    def compile_seconds(self) -> dict[str, dict[int, float]]:
        return {"thinker_decode": {1: 2.0, 2: 3.0}, "code2wav": {1: 4.0}}


class _ReportingCompiler(_Compiler):
    def cache_report(self) -> dict[str, str]:
        return {"thinker_decode": "hit", "code2wav": "miss"}


def test_compile_phases_per_step_with_the_cache_answer_when_there_is_one() -> None:
    assert compile_phases(None) == []
    plain = {p.phase: p for p in compile_phases(_Compiler())}
    assert list(plain) == ["compile:thinker_decode", "compile:code2wav"]
    assert plain["compile:thinker_decode"].seconds == 5.0 and "cache" not in plain["compile:thinker_decode"].detail
    reported = {p.phase: p for p in compile_phases(_ReportingCompiler())}
    assert reported["compile:thinker_decode"].detail.startswith("cache hit")
    assert reported["compile:code2wav"].detail.startswith("cache miss") and reported["compile:code2wav"].seconds == 4.0


def test_timed_plan_returns_the_plan_and_its_phase() -> None:
    sized, made, done = timed_plan(lambda config: (config + "-sized", "plan"), "config")  # type: ignore[arg-type,operator]
    assert (sized, made, done.phase) == ("config-sized", "plan", PLAN) and done.seconds >= 0


async def test_a_tiny_thread_engine_reports_its_phases_and_readyz_says_where_it_is(tiny_model_dir: Path) -> None:
    release, held = threading.Event(), threading.Event()

    def hold(runner: Any) -> Any:  # after the runner's build, before the engine serves
        held.set()
        release.wait(_HOLD_S)
        return runner

    config = agent_config(tiny_model_dir)
    engine = build_engine(config, wrap=hold, planned=PhaseDone(PLAN, 0.5))
    assert engine.startup.phase == STARTING and engine.startup.phases == {PLAN: 0.5}
    app = create_app(config, engine)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    url = f"http://{config.host}:{config.port}"
    try:
        async with aiohttp.ClientSession() as http:
            try:
                loop = asyncio.get_running_loop()
                assert await loop.run_in_executor(None, held.wait, _HOLD_S), "the engine never finished its build"
                async with http.get(url + "/readyz") as resp:
                    status, body = resp.status, await resp.json()
                assert status == 503 and body["status"] == "loading" and body["phase"] == BUILD
                assert list(body["phases"]) == [PLAN, LOAD, BUILD]
                async with http.get(url + "/healthz") as resp:
                    health = await resp.json()
                assert resp.status == 503 and health["status"] == "loading" and health["phase"] == BUILD
            finally:
                release.set()
            await asyncio.wait_for(asyncio.shield(app[ENGINE_START]), _HOLD_S)
            async with http.get(url + "/readyz") as resp:
                assert resp.status == 200 and await resp.json() == {"status": "ok"}
        view = engine.startup
        assert view.phase == READY
        assert [name for name, _ in view.finished] == [PLAN, LOAD, BUILD, READY]  # compile is off on CPU
        for name in (LOAD, BUILD, READY):
            assert _gauge(name) == view.phases[name]
    finally:
        release.set()
        await runner.cleanup()


def test_the_replica_start_timeout_covers_a_cold_start() -> None:
    assert ServeOptions().start_timeout_s >= COLD_START_S
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    assert options_from(vars(parser.parse_args([]))).start_timeout_s == ServeOptions().start_timeout_s
    assert options_from(vars(parser.parse_args(["--replica-start-timeout-s", "2400"]))).start_timeout_s == 2400.0


def test_the_kuberay_startup_probe_allows_a_cold_start() -> None:
    manifest = ROOT / "deploy" / "kuberay" / "rayservice.yaml"
    (service,) = [d for d in yaml.safe_load_all(manifest.read_text()) if d and d["kind"] == "RayService"]
    for group in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        probe = container["startupProbe"]
        # A cold start, and as long again for a first start's download (the manifest's comment).
        assert probe["periodSeconds"] * probe["failureThreshold"] >= 2 * COLD_START_S
