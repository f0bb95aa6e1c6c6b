"""Live-caption latency as a viewer sees it: first partial after speech onset, partial cadence,
final after end of speech (p50/p95 of each), and transcription capacity against conversations.

Starts the agent in-process (the tiny model unless --model); the simulated users run in a child
process (`--client`, its own event loop and interpreter), so the server's loop serves only the
sessions, as it would in production. They open --sessions WebSocket sessions at once
(`--kind transcription`: GET /v1/realtime?intent=transcription; `--kind conversation`: realtime
sessions with audio.input.transcription set, so replies run too) and stream an espeak-ng
utterance (about 5 s, then 1.5 s of silence) into each, in real time, --rounds times, after
a second of silence. Figures
are the server's clock: `omni.since_speech_ms` of an item's first partial (a delta, or an
`omni.input_audio_transcription.partial` when it made no text stable), the gaps between its
partials' since_speech_ms (cadence), `omni.after_end_ms` of completed (final).

`--compare M`: one run, one engine: M conversation sessions, then 3*M (--ratio) transcription
sessions; the last line says, for each of the three p95s, whether the transcription sessions
are at or under the conversation sessions' (capacity >= ratio x at the same caption latency).
By default every user starts speaking at the same instant (lockstep: all sessions' half-second
partials fall in one engine tick, the worst case); `--stagger-s S` spreads the onsets evenly
over S seconds, as independent speakers would be.

`--capacity`: the capacity of each kind, the figure the transcription target is stated in. Each
kind runs at the session counts of --levels in turn, one engine, until a level misses the
budget: every p95 at or under --budget-ms (first partial, cadence, final) and every item's final
arrived with no error. A kind's capacity is its last level in budget, so both kinds are held to
the same p95 caption latency; the last line gives both and their ratio (target >= 3).

    python scripts/bench_captions.py --sessions 1 --rounds 3
    python scripts/bench_captions.py --sessions 3 --kind conversation
    python scripts/bench_captions.py --compare 4 --rounds 2
    python scripts/bench_captions.py --capacity --rounds 2 --stagger-s 1
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path

import aiohttp
import numpy as np
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.client.client import wait_ready  # noqa: E402
from agent.config import Config  # noqa: E402
from agent.engine.factory import build_engine  # noqa: E402
from agent.server import create_app  # noqa: E402

SENTENCE = "Good evening everyone, welcome to the live caption test of this small agent today."


def utterance() -> np.ndarray:
    """The sentence as 24 kHz int16 (espeak-ng, linear resample)."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-s", "160", "-w", str(raw), SENTENCE], check=True)
        with wave.open(str(raw)) as w:
            rate = w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float32)
    n = int(len(pcm) * 24000 / rate)
    return np.interp(np.linspace(0, len(pcm) - 1, n), np.arange(len(pcm)), pcm).astype(np.int16)


async def session(url: str, kind: str, pcm: np.ndarray, rounds: int, out: list[dict], lead_s: float = 1.0) -> None:
    query = "?intent=transcription" if kind == "transcription" else ""
    async with aiohttp.ClientSession() as http, http.ws_connect(f"{url}/v1/realtime{query}") as ws:
        if kind == "conversation":
            await ws.send_str(
                json.dumps(
                    {
                        "type": "session.update",
                        "session": {"type": "realtime", "audio": {"input": {"transcription": {"model": "thinker"}}}},
                    }
                )
            )
        items: dict[str, dict] = {}
        done = asyncio.Event()

        async def read() -> None:
            async for msg in ws:
                ev = json.loads(msg.data)
                kind_ = ev["type"]
                if kind_ in (
                    "conversation.item.input_audio_transcription.delta",
                    "omni.input_audio_transcription.partial",
                ):
                    items.setdefault(ev["item_id"], {"since": []})["since"].append(ev["omni"]["since_speech_ms"])
                elif kind_ == "conversation.item.input_audio_transcription.completed":
                    items.setdefault(ev["item_id"], {"since": []})["final_ms"] = ev["omni"]["after_end_ms"]
                    if sum("final_ms" in i for i in items.values()) >= rounds:
                        done.set()
                elif kind_ == "error":  # e.g. engine_busy: counted, and the round's final may not come
                    items.setdefault(f"error-{len(items)}", {"since": [], "error": ev["error"].get("code")})

        reader = asyncio.ensure_future(read())
        silence = np.zeros(int(1.5 * 24000), np.int16)
        # A second of silence first (plus the user's stagger): nobody speaks at the instant they
        # connect (the session's setup is not what a caption's latency measures).
        lead = np.zeros(int(lead_s * 24000), np.int16)
        audio = np.concatenate([lead] + [np.concatenate([pcm, silence])] * rounds)
        start = time.monotonic()
        for i, at in enumerate(range(0, len(audio), 480)):  # 20 ms appends on the wall clock
            chunk = base64.b64encode(audio[at : at + 480].astype("<i2").tobytes()).decode()
            await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
            wait = start + (i + 1) * 0.02 - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
        try:
            await asyncio.wait_for(done.wait(), 60)
        except asyncio.TimeoutError:
            pass  # a missing final is reported (finals < items), not a crash
        finally:
            reader.cancel()
        out += list(items.values())


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def clients(url: str, kind: str, sessions: int, rounds: int, stagger_s: float = 0.0) -> list[dict]:
    """The simulated users (the child process's work): every item's figures. With stagger_s,
    user k starts speaking k * stagger_s / sessions later than user 0 (0: all in lockstep)."""
    pcm = utterance()
    items: list[dict] = []
    await asyncio.gather(
        *(session(url, kind, pcm, rounds, items, 1.0 + k * stagger_s / sessions) for k in range(sessions))
    )
    return items


def figures(items: list[dict]) -> dict[str, list[float]]:
    return {
        "first": [i["since"][0] for i in items if i["since"] and i["since"][0] is not None],
        "cadence": [b - a for i in items for a, b in zip(i["since"], i["since"][1:]) if None not in (a, b)],
        "final": [i["final_ms"] for i in items if i.get("final_ms") is not None],
        "partials": [len(i["since"]) for i in items if "error" not in i],
    }


def report(kind: str, sessions: int, rounds: int, items: list[dict]) -> dict[str, list[float]]:
    f = figures(items)
    first, gaps, final, partials = f["first"], f["cadence"], f["final"], f["partials"]
    errors = [i["error"] for i in items if "error" in i]
    print(
        f"{sessions} {kind} session(s) x {rounds} rounds, {len(partials)} items, {len(final)} finals, "
        f"partials per item {min(partials, default=0)}-{max(partials, default=0)}, errors {len(errors)} "
        f"{sorted(set(errors))}"
    )
    print(f"first partial after onset ms: p50 {pct(first, 50):.0f}  p95 {pct(first, 95):.0f}")
    print(
        f"partial cadence ms:           p50 {pct(gaps, 50):.0f}  p95 {pct(gaps, 95):.0f}  max {max(gaps, default=0):.0f}"
    )
    print(f"final after end of speech ms: p50 {pct(final, 50):.0f}  p95 {pct(final, 95):.0f}")
    print(
        f"SUMMARY kind={kind} sessions={sessions} first_partial_p50_ms={pct(first, 50):.0f} "
        f"first_partial_p95_ms={pct(first, 95):.0f} cadence_p50_ms={pct(gaps, 50):.0f} "
        f"cadence_p95_ms={pct(gaps, 95):.0f} final_p95_ms={pct(final, 95):.0f}",
        flush=True,
    )
    return f


async def run_clients(url: str, kind: str, sessions: int, rounds: int, stagger_s: float = 0.0) -> list[dict]:
    """The users in a child process; its stdout is the items as JSON."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--client",
        url,
        "--kind",
        kind,
        "--sessions",
        str(sessions),
        "--rounds",
        str(rounds),
        "--stagger-s",
        str(stagger_s),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    if proc.returncode:
        raise SystemExit(f"the client process failed ({proc.returncode})")
    return json.loads(out)


BUDGET_KEYS = ("first", "cadence", "final")


def in_budget(
    f: dict[str, list[float]], items: list[dict], sessions: int, rounds: int, budget_ms: list[float]
) -> tuple[bool, str]:
    """Whether a level held: every final of sessions x rounds items arrived, no error, and each
    p95 at or under its budget. The reason when it did not."""
    errors = sum("error" in i for i in items)
    if errors or len(f["final"]) < sessions * rounds:
        return False, f"{len(f['final'])}/{sessions * rounds} finals, {errors} errors"
    over = [
        f"{key} p95 {pct(f[key], 95):.0f} > {limit:.0f}"
        for key, limit in zip(BUDGET_KEYS, budget_ms)
        if not pct(f[key], 95) <= limit
    ]
    return not over, ", ".join(over)


async def capacity(
    url: str, kind: str, levels: list[int], rounds: int, stagger_s: float, budget_ms: list[float]
) -> int:
    """The kind's last level in budget (0: not even the first)."""
    held = 0
    for n in levels:
        items = await run_clients(url, kind, n, rounds, stagger_s)
        ok, why = in_budget(report(kind, n, rounds, items), items, n, rounds, budget_ms)
        print(f"LEVEL kind={kind} sessions={n} {'in budget' if ok else 'over budget: ' + why}", flush=True)
        if not ok:
            break
        held = n
    return held


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kind", choices=("transcription", "conversation"), default="transcription")
    p.add_argument(
        "--compare",
        type=int,
        default=0,
        metavar="M",
        help="M conversation sessions, then ratio*M transcription sessions, one engine",
    )
    p.add_argument("--ratio", type=int, default=3)
    p.add_argument(
        "--capacity",
        action="store_true",
        help="each kind's most sessions in budget, over --levels; the last line gives the ratio",
    )
    p.add_argument("--levels", type=ints, default=[2, 4, 6, 8, 10, 12, 16, 20, 24, 28, 32, 40, 48, 64])
    p.add_argument(
        "--budget-ms",
        type=lambda t: [float(x) for x in t.split(",")],
        default=[1200.0, 1000.0, 1000.0],
        metavar="FIRST,CADENCE,FINAL",
        help="p95 budgets of the capacity run (default 1200,1000,1000)",
    )
    p.add_argument(
        "--stagger-s",
        type=float,
        default=0.0,
        help="spread the users' speech onsets evenly over this many seconds (0: lockstep, the worst case)",
    )
    p.add_argument("--model", default="", help="model path (default: the tiny checkpoint)")
    p.add_argument("--port", type=int, default=18089)
    p.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)  # the child process
    args = p.parse_args()
    if args.client:
        print(json.dumps(await clients(args.client, args.kind, args.sessions, args.rounds, args.stagger_s)))
        return
    if len(args.budget_ms) != 3:
        p.error("--budget-ms takes three numbers: first partial, cadence, final")
    most = max(args.sessions, args.compare * (args.ratio + 1), max(args.levels) if args.capacity else 0)
    # All the users come from one loopback address, standing for many: no per-address call rate.
    config = Config(
        host="127.0.0.1",
        port=args.port,
        model=args.model,
        fallback_model="none",
        max_sessions=max(8, 2 * most),
        max_calls_per_minute=0,
    )
    runner = web.AppRunner(create_app(config, build_engine(config)))
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    url = f"http://{config.host}:{config.port}"
    await wait_ready(url, timeout_s=120)
    print(f"utterance {len(utterance()) / 24000:.1f} s, then 1.5 s of silence")
    try:
        if args.capacity:
            # A warm-up call of each kind first, not counted: the first turns pay one-off costs.
            for kind in ("conversation", "transcription"):
                await run_clients(url, kind, 1, 1, 0.0)
            caps = {
                kind: await capacity(url, kind, args.levels, args.rounds, args.stagger_s, args.budget_ms)
                for kind in ("conversation", "transcription")
            }
            tx, conv = caps["transcription"], caps["conversation"]
            budget = ",".join(f"{k}:{v:.0f}" for k, v in zip(BUDGET_KEYS, args.budget_ms))
            print(
                f"CAPACITY transcription={tx} conversation={conv} "
                f"ratio={tx / conv if conv else float('nan'):.1f} budget_p95_ms={budget} "
                f"stagger_s={args.stagger_s:g} rounds={args.rounds}"
            )
            return
        if not args.compare:
            report(
                args.kind,
                args.sessions,
                args.rounds,
                await run_clients(url, args.kind, args.sessions, args.rounds, args.stagger_s),
            )
            return
        m, n = args.compare, args.compare * args.ratio
        conv = report(
            "conversation", m, args.rounds, await run_clients(url, "conversation", m, args.rounds, args.stagger_s)
        )
        tx = report(
            "transcription", n, args.rounds, await run_clients(url, "transcription", n, args.rounds, args.stagger_s)
        )
    finally:
        await runner.cleanup()
    verdicts = []
    for name, key in (("first_partial", "first"), ("cadence", "cadence"), ("final", "final")):
        a, b = pct(tx[key], 95), pct(conv[key], 95)
        verdicts.append(f"{name}_p95_ms={a:.0f}/{b:.0f}:{'holds' if a <= b else 'misses'}")
    print(
        f"CAPACITY transcription={n} conversation={m} ratio={n / m:.1f} (transcription/conversation p95) "
        + " ".join(verdicts)
    )


if __name__ == "__main__":
    asyncio.run(main())
