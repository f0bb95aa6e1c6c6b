"""Command line: `omni-agent [serve] [flags]`, `omni-agent precompile [serve's flags]`, `omni-agent call
URL`, `omni-agent make-tiny DIR`, `omni-agent fetch-turn-model` and `omni-agent quantize SRC DST` (its flags:
agent/engine/quant/command.py; serve's: agent/flags.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from agent.config import Config
from agent.engine.quant.command import add_arguments as add_quantize_arguments
from agent.engine.quant.command import run as run_quantize
from agent.flags import add_serve_arguments, config_from_args

if TYPE_CHECKING:
    from aiohttp import web


def serve(config: Config) -> None:
    from agent.engine.factory import build_engine
    from agent.engine.memory_plan import size_limits
    from agent.engine.startup import timed_plan
    from agent.server import create_app
    from agent.transport.ice import restrict_ice_hosts

    restrict_ice_hosts(config.ice_hosts)
    # Before the loop runs and the model loads: a plan that cannot fit is refused at once, and
    # admission and the engine read the same resolved limits from `config`.
    config, _, planned = timed_plan(size_limits, config)
    engine = build_engine(config, planned=planned)
    asyncio.run(_serve(config, create_app(config, engine)))


def precompile(config: Config) -> int:
    """Build the engine's runner as `serve` would with these flags (same memory plan, so the same
    compiled shapes), here in this process, and exit: its compiles write the compiled steps'
    artifacts under --cache-dir (agent/engine/compile/cache.py), which a later `serve` on the same
    kind of card loads instead of compiling. A KubeRay init container or a job per GPU type runs
    it into the cache volume (docs/ray-serve.md). Exit status 0 once the file is written or was
    already complete, 1 when the runner does not compile (nothing to cache)."""
    from agent.engine.factory import runner_factory
    from agent.engine.memory_plan import size_limits

    config, _ = size_limits(config)
    runner = runner_factory(config)()
    graphing = getattr(runner, "graphing", None)
    compiler = graphing.compiler if graphing is not None else None
    if compiler is None or graphing.artifacts is None:
        print("omni-agent precompile: these flags compile nothing (CPU without --compile on, or --runner reference)")
        return 1
    report = compiler.cache_report()
    for step, seconds in compiler.compile_seconds().items():
        print(f"  {step:>16}: {sum(seconds.values()):7.1f} s, cache {report[step]}")
    path = graphing.artifacts.path
    print(f"omni-agent precompile: {path} ({path.stat().st_size / 2**20:.1f} MiB; loaded: {graphing.artifacts_state})")
    return 0


async def _serve(config: Config, app: "web.Application") -> None:
    """Serve until SIGTERM or Ctrl-C, then shut down in order: refuse new calls, let replies in
    progress finish (at most --drain-s; a second signal cuts that short), close every peer and
    the engine, return (exit status 0)."""
    from aiohttp import web

    from agent.server import drain

    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    print(f"omni-agent: serving on http://{config.host}:{config.port}  (model: {config.model or 'tiny'})", flush=True)
    loop = asyncio.get_running_loop()
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
    print("omni-agent: shutting down (again to skip waiting for replies)", flush=True)
    draining = asyncio.ensure_future(drain(app, config.drain_s))
    hurried = asyncio.ensure_future(hurry.wait())
    await asyncio.wait([draining, hurried], return_when=asyncio.FIRST_COMPLETED)
    draining.cancel()
    hurried.cancel()
    await runner.cleanup()  # closes every session and peer, then stops the engine
    print("omni-agent: stopped", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="omni-agent", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    add_serve_arguments(sub.add_parser("serve", help="run the agent (the default command)"))
    add_serve_arguments(
        sub.add_parser(
            "precompile",
            help="compile the engine's steps for serve's flags into --cache-dir's compile cache, then exit",
        )
    )
    tiny = sub.add_parser("make-tiny", help="build the tiny Qwen3-Omni checkpoint into DIR")
    tiny.add_argument("dir", type=Path)
    turn = sub.add_parser(
        "fetch-turn-model", help="download the end-of-turn model (Smart Turn v3.2) into --cache-dir, once"
    )
    turn.add_argument("--cache-dir", type=Path, default=Config().cache_dir)
    quant = sub.add_parser(
        "quantize",
        help="write a 4-bit copy of a float checkpoint (SRC folder) into DST, layer by layer; "
        "serve it with --model DST",
    )
    add_quantize_arguments(quant)
    from agent.client.call import add_arguments as add_call_arguments

    call = sub.add_parser(
        "call",
        help="join an agent as a headless client: mic/camera or files in, "
        "voice to the speaker or a WAV, captions printed",
    )
    add_call_arguments(call)
    call.add_argument("--log-level", default="WARNING")
    if not argv or argv[0] not in (
        "serve",
        "precompile",
        "call",
        "make-tiny",
        "fetch-turn-model",
        "quantize",
        "-h",
        "--help",
    ):
        argv = ["serve", *argv]
    ns = parser.parse_args(argv)
    if ns.command == "make-tiny":
        from agent.engine.checkpoints.tiny import make_tiny

        print(make_tiny(ns.dir))
        return 0
    if ns.command == "fetch-turn-model":
        from agent.media.turn_model import default_path, fetch

        try:
            print(fetch(default_path(ns.cache_dir)))
        except RuntimeError as exc:
            print(f"omni-agent fetch-turn-model: {exc}", file=sys.stderr)
            return 1
        return 0
    if ns.command == "quantize":
        return run_quantize(ns)
    if ns.command == "call":
        from agent.client.call import options_from_args, run_call

        logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return run_call(options_from_args(ns))
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(ns)
    except ValueError as exc:  # settings that contradict each other (Config.__post_init__)
        parser.error(str(exc))
    if ns.command == "precompile":
        return precompile(config)
    if ns.ray:
        try:
            from agent.serve.app import run as serve_on_ray
        except ImportError as exc:
            parser.error(f"--ray needs Ray Serve: pip install '.[serve]' ({exc})")
        from agent.serve.options import options_from

        serve_on_ray(config, options_from(vars(ns)))
        return 0
    from agent.engine.memory_plan import MemoryPlanError

    try:
        serve(config)
    except MemoryPlanError as exc:
        print(f"omni-agent: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
