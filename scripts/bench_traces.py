"""What tracing costs a call: the same load with the trace exporter off and with it pointed at a
dead collector (a loopback port nothing listens on), side by side in one run.

Two agent processes are started, one without tracing and one with `--otlp-endpoint
http://127.0.0.1:<dead port>`; N real aiortc clients (scripts/bench_rtc.py's run_level: spoken
WAV, 4 fps video, voice-to-voice measured at the client) run against each in alternated blocks
(off, on, off, on, ...) so that a drift in the machine's load hits both alike. Printed: each
side's voice-to-voice p50/p95, the median omni.turn_timing stages, and the traced agent's span
counts from /metrics (agent_trace_spans_total: exported, dropped because the queue was full or
the export failed). The last line: `trace_p95_ratio=… trace_p50_ratio=… spans_dropped=…
spans_exported=…`; a ratio near 1 says a dead collector costs the calls nothing.

    .venv/bin/python scripts/bench_traces.py --sessions 4 --turns 6 --blocks 2
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_rtc  # noqa: E402

from agent.client.client import AgentClient, wait_ready  # noqa: E402
from agent.transport.ice import restrict_ice_hosts  # noqa: E402


async def spans(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as http:
        return await bench_rtc.scrape_labelled(http, url, "agent_trace_spans_total", "outcome")


async def main_async(args: argparse.Namespace) -> None:
    restrict_ice_hosts(["127.0.0.1"])
    wav = bench_rtc.make_speech(Path(tempfile.mkdtemp(prefix="bench_traces_")) / "speech.wav")
    server_args = bench_rtc_args(args)
    dead = bench_rtc.free_port()  # nothing listens here: every export fails
    ports = {"off": bench_rtc.free_port(), "dead_collector": bench_rtc.free_port()}
    extra = {"off": (), "dead_collector": ("--otlp-endpoint", f"http://127.0.0.1:{dead}")}
    servers = {k: bench_rtc.start_server(ports[k], server_args, extra=extra[k]) for k in ports}
    urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    try:
        for url in urls.values():
            await wait_ready(url)
        parts: dict[str, list[dict]] = {k: [] for k in urls}
        blocks = max(1, min(args.blocks, args.turns))
        for b in range(blocks):
            turns = args.turns // blocks + (b < args.turns % blocks)
            for kind, url in urls.items():

                def client(url: str = url) -> AgentClient:
                    return AgentClient(url, wav, video=True, repeat_after_s=args.gap_s, video_fps=4)

                parts[kind].append(
                    await bench_rtc.run_level(url, client, args.sessions, turns, args.level_timeout_s, 0.3)
                )
                print(f"  block {b + 1}/{blocks} {kind}: {parts[kind][-1]['turns']} turns", flush=True)
        counted = await spans(urls["dead_collector"])
        off_counted = await spans(urls["off"])
    finally:
        for server in servers.values():
            server.terminate()
        for server in servers.values():
            server.wait(timeout=30)
    merged = {k: bench_rtc.merge_levels(v) for k, v in parts.items()}
    print(
        f"# {args.sessions} sessions x {args.turns} turns each side, {blocks} alternated blocks, tiny model on this CPU"
    )
    print(f"{'side':>16} {'turns':>6} {'v2v_p50_ms':>11} {'v2v_p95_ms':>11}")
    for kind, r in merged.items():
        p50, p95 = bench_rtc.pct(r["v2v"], 50) * 1000, bench_rtc.pct(r["v2v"], 95) * 1000
        print(f"{kind:>16} {r['turns']:>6} {p50:>11.1f} {p95:>11.1f}")
    for kind, r in merged.items():
        r["n"] = kind  # (print_timing's row label)
    bench_rtc.print_timing(list(merged.values()))
    print(f"# spans on the traced agent: {counted}; on the untraced one: {off_counted or 'none'}")
    off, on = merged["off"], merged["dead_collector"]
    dropped = counted.get("dropped_queue_full", 0) + counted.get("dropped_export_failed", 0)
    print(
        f"trace_p95_ratio={bench_rtc.pct(on['v2v'], 95) / bench_rtc.pct(off['v2v'], 95):.3f} "
        f"trace_p50_ratio={bench_rtc.pct(on['v2v'], 50) / bench_rtc.pct(off['v2v'], 50):.3f} "
        f"spans_dropped={dropped:.0f} spans_exported={counted.get('exported', 0):.0f}"
    )


def bench_rtc_args(args: argparse.Namespace) -> argparse.Namespace:
    """What bench_rtc.start_server reads, as its own defaults have them."""
    return argparse.Namespace(
        runner="stream",
        levels=[args.sessions],
        transcription=False,
        silence_ms=300,
        ladder=False,
        model=args.model,
        threads=0,
        cpu_graphs=False,
        engine_thread=False,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=6, help="turns per client on each side")
    p.add_argument("--blocks", type=int, default=2, help="alternated blocks the turns are split into")
    p.add_argument("--gap-s", type=float, default=6.0)
    p.add_argument("--level-timeout-s", type=float, default=120.0)
    p.add_argument("--model", default="")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
