"""A Serve replica while its engine starts (agent/serve/replica.py), without a cluster.

Pins:
- check_health passes while the engine is loading and alive, fails once the start-up has run
  past the start timeout (naming the phase it is stuck in), and fails a failed load at once;
- the constructor's wait for the engine returns when the engine's start does, raises the load's
  error, and past the timeout raises TimeoutError naming the running phase and the flag.
"""

from __future__ import annotations

import asyncio
import os
import time
from types import SimpleNamespace
from typing import Any

import pytest

from agent.engine.loop import Engine
from agent.engine.startup import LOAD, PhaseBegun, PhaseDone, StartupLog
from agent.serve.options import ServeOptions
from agent.transport.http import ENGINE, ENGINE_START

try:
    from agent.serve.replica import AgentReplica
except ImportError:  # pragma: no cover - depends on the environment
    if os.environ.get("CI") == "true":
        raise  # the `test` extra pins ray[serve]: missing is a failure in CI
    pytest.skip("ray[serve] is not installed (pip install '.[serve]')", allow_module_level=True)


def _replica(start: asyncio.Future, began_ago_s: float = 0.0, timeout_s: float = 60.0) -> Any:
    """What check_health and the wait read of a replica: its app's engine and start, its options."""
    startup = StartupLog()
    startup.apply(PhaseDone("plan", 0.1))
    startup.apply(PhaseBegun(LOAD))
    engine = Engine(lambda: None, startup=startup)  # never started: loading, as far as probes can tell
    return SimpleNamespace(
        web={ENGINE: engine, ENGINE_START: start},
        options=ServeOptions(start_timeout_s=timeout_s),
        replica_id="r1",
        _began=time.monotonic() - began_ago_s,
    )


async def test_check_health_passes_a_start_up_in_progress_until_its_timeout() -> None:
    start = asyncio.get_running_loop().create_future()
    AgentReplica.check_health(_replica(start))  # loading: no error
    with pytest.raises(RuntimeError, match="still in phase 'load'"):
        AgentReplica.check_health(_replica(start, began_ago_s=120.0, timeout_s=60.0))
    start.set_exception(RuntimeError("injected: weights missing"))
    with pytest.raises(RuntimeError, match="weights missing"):
        AgentReplica.check_health(_replica(start))


async def test_the_wait_for_the_engine_ends_with_its_start() -> None:
    loop = asyncio.get_running_loop()
    start = loop.create_future()
    loop.call_soon(start.set_result, None)
    await AgentReplica._wait_for_engine(_replica(start), 60.0)
    failed = loop.create_future()
    loop.call_soon(failed.set_exception, RuntimeError("injected: weights missing"))
    with pytest.raises(RuntimeError, match="weights missing"):
        await AgentReplica._wait_for_engine(_replica(failed), 60.0)


async def test_the_wait_gives_up_at_the_timeout_naming_the_phase() -> None:
    start = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError, match=r"--replica-start-timeout-s.*phase 'load'.*'plan': 0.1"):
        await AgentReplica._wait_for_engine(_replica(start), 0.05)
    assert not start.done()  # the engine's start is not cancelled by the wait giving up
