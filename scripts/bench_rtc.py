"""Load harness: N real aiortc clients on loopback against a real agent process.

Each client sends a spoken WAV (espeak-ng) plus 4 fps video, waits for the reply, and
speaks again; it measures at the client what a user feels: voice-to-voice (known end of
speech in the sent audio → first audible received sample), TTFT from events, and
glitches (short holes inside a reply). The server's own TTFA comes from /metrics. The
stack overhead is voice-to-voice − end-of-turn silence − server TTFA.

Then the transport comparison, in the same run against the same agent: one audio-only
WebRTC session, then one WebSocket session (agent.client.client.WsAgentClient: the same speech
streamed as 24 kHz pcm16 `input_audio_buffer.append` events in real time), each for
--transport-turns turns; both measured at the client from the end of speech in the sent
audio to the first audible reply audio (WebRTC: the first audible received 20 ms frame;
WebSocket: the arrival of the first audible `response.output_audio.delta`).

Then speculative start, in the same run: one audio-only WebRTC session for --spec-turns turns
against the agent (speculation on, its default), then the same against a second agent started
with --no-speculative-start; server TTFA (end of turn → first audio frame sent, from
response.done's omni field) P50 on over off, and the share of turns whose reply was committed
from a speculation (omni.stats.speculative).

Then the camera comparison, same agent: one WebRTC session without video and one sending a
640x480 camera at 4 fps, each for --camera-turns turns, alternated in --camera-blocks blocks
(off, on, off, on, ...); the server's end-of-turn → first audio (TTFA, from response.done) and
the client's voice-to-voice compared, and the image tokens response.done's usage reports.

Then the end of turn, same agent: one audio-only WebRTC session with server_vad (the fixed
--silence-ms) and one with semantic_vad (each pause judged by Smart Turn, agent/media/smart_turn.py),
each for --turn-turns turns, alternated in --turn-blocks blocks; voice-to-voice at the client
compared. `--turn-detection semantic_vad` runs the load levels with semantic_vad sessions too, and
every level prints what the end-of-turn judge cost there (pauses judged, ms each, per session).

Prints a table per concurrency level, one per transport, one for speculation, one for the
camera and one for the end of turn; last line:
`p95_ratio_4_vs_1=R overhead_p50_ms=O ws_minus_webrtc_p50_ms=D speculative_ttfa_ratio=S speculative_share=F camera_ttfa_ratio=C camera_ttfa_delta_ms=T camera_v2v_ratio=V image_tokens=I underrun_share_2=U2 underrun_share_4=U4 engine_cpu_per_session_s=E engine_cpu_ratio_4_vs_1=ER
semantic_v2v_p50_drop_ms=SD judge_ms_per_pause=J`
(voice-to-voice P95 at 4 sessions over 1 session; overhead P50 at 1 session; WebSocket P50
minus WebRTC P50 end of speech → first audio, target ≤ 30 ms; server TTFA P50 with speculation
over without, target ≤ 0.2; share of turns committed from a speculation; TTFA P50 camera on
over camera off, target ≤ 1.1, and the same as a difference in ms; voice-to-voice P50 (the
user's end of speech → first audible reply, as the client hears it) camera on over off; image
tokens per camera-on turn, median). With speculative start both TTFAs are a few ms (the reply
was made in the pause), so their ratio swings with ms-level scheduling noise: read it with the
difference and the voice-to-voice ratio beside it. Then the load budget (docs/load.md): the
share of reply frames the outbound track ran short at 2 and 4 sessions (targets 0 and ≤ 1%),
and the engine thread's CPU-seconds per session-second at 4 sessions and over 1 session
(target ≤ 1.2); server_vad's voice-to-voice P50 less semantic_vad's (target ≥ 120 ms) and the
judge's mean compute per pause judged at the largest level: from the agent's agent_thread_cpu_seconds_total, scraped around each level,
printed per level with every other kind of thread, the clients' own CPU and the engine's time by
stage. `--transcription` runs the levels with every client asking for input transcription.
Everything stays on 127.0.0.1; every level is bounded in turns and seconds.

With --ray --replicas N (the `serve` extra): the single-process agent and then the agent as N
Ray Serve replicas behind Serve's proxy (`omni-agent serve --ray`), in the same run, each at
--ray-calls concurrent calls; plus the offer/answer time (POST of an SDP offer → 201 answer)
straight to the agent and through the proxy. Last line:
`ray_p95_ratio=R offer_p50_direct_ms=A offer_p50_proxy_ms=B proxy_offer_overhead_p50_ms=B-A`
(voice-to-voice P95 with replicas over single-process; target R ≤ 1.1 and overhead ≤ 20 ms).

    .venv/bin/python scripts/bench_rtc.py [--levels 1,2,4,8] [--turns 3] [--transport-turns 5] [--runner stream]
    .venv/bin/python scripts/bench_rtc.py --ray --replicas 2 [--ray-calls 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path
from typing import Callable, Union

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.client.client import AgentClient, PatternVideoTrack, WsAgentClient, wait_ready  # noqa: E402
from agent.transport.ice import restrict_ice_hosts  # noqa: E402


def make_speech(path: Path, text: str = "Hello agent, what do you see?") -> Path:
    raw = path.with_name("raw.wav")
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "170", "-w", str(raw), text], check=True)
    with wave.open(str(raw)) as w:
        rate = w.getframerate()
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
    pcm = np.concatenate([np.zeros(int(0.3 * rate), np.int16), pcm])
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return path


def omni_figures(done: dict) -> dict:
    """The agent's latency extras on a GA response.done: response.omni {ttft_ms, ttfa_ms, mode}."""
    return (done.get("response") or {}).get("omni") or {}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values), q))


async def scrape_value(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(f"{url}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def scrape_histogram(http: aiohttp.ClientSession, url: str, name: str) -> dict[float, float]:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            key = float("inf") if le == "+Inf" else float(le)
            # Summed over the other labels (priority): the quantile is over every session.
            buckets[key] = buckets.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return buckets


async def scrape_labelled(http: aiohttp.ClientSession, url: str, name: str, label: str) -> dict[str, float]:
    """Every series of one metric, by the value of one label: {label value: sample}."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and f'{label}="' in line:
            key = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def histogram_quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float:
    """Prometheus' histogram_quantile over the bucket increase between two scrapes."""
    les = sorted(after)
    counts = [after[le] - before.get(le, 0.0) for le in les]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return float("nan")
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in zip(les, counts):
        if c >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_c) / max(c - prev_c, 1e-9)
        prev_le, prev_c = le, c
    return les[-1]


Client = Callable[[], Union[AgentClient, WsAgentClient]]


async def run_level(url: str, make_client: Client, n: int, turns: int, limit_s: float, silence_s: float) -> dict:
    clients = [make_client() for _ in range(n)]
    async with aiohttp.ClientSession() as http:
        before = await scrape_histogram(http, url, "agent_time_to_first_audio_seconds")
        underruns_before = await scrape_value(http, url, "agent_playout_underruns_total")
        stages_before = {
            stage: [
                await scrape_value(http, url, f'agent_stage_seconds_{k}{{stage="{stage}"}}') for k in ("sum", "count")
            ]
            for stage in ("vision_encoder", "thinker_prefill")
        }
        # Where the agent's CPU goes during the level (engine thread, asyncio thread, ...) and the
        # engine's time by stage; read before the clients connect and before they hang up.
        cpu_before = await scrape_labelled(http, url, "agent_thread_cpu_seconds_total", "thread")
        stage_sum_before = await scrape_labelled(http, url, "agent_engine_seconds_total", "stage")
        calls_before = await scrape_labelled(http, url, "agent_engine_calls_total", "stage")
        rows_before = await scrape_labelled(http, url, "agent_stage_seconds_count", "stage")
        spec_before = await scrape_labelled(http, url, "agent_speculative_replies_total", "outcome")
        judge_before = [await scrape_value(http, url, f"agent_turn_judge_seconds_{k}") for k in ("sum", "count")]
        client_cpu_before = time.process_time()
        t0 = time.monotonic()
        try:
            for c in clients:
                await c.connect()
                await asyncio.sleep(0.37)  # stagger: real users do not speak in lockstep
            while time.monotonic() - t0 < limit_s:
                done = [len(c.result.of_type("response.done")) for c in clients]
                if min(done) >= turns:
                    break
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)  # let the last replies' audio arrive
            wall = time.monotonic() - t0
            cpu = delta(await scrape_labelled(http, url, "agent_thread_cpu_seconds_total", "thread"), cpu_before)
            stage_sums = delta(
                await scrape_labelled(http, url, "agent_engine_seconds_total", "stage"), stage_sum_before
            )
            client_cpu = time.process_time() - client_cpu_before
            calls = delta(await scrape_labelled(http, url, "agent_engine_calls_total", "stage"), calls_before)
            rows = delta(await scrape_labelled(http, url, "agent_stage_seconds_count", "stage"), rows_before)
            spec = delta(await scrape_labelled(http, url, "agent_speculative_replies_total", "outcome"), spec_before)
            judge = [
                await scrape_value(http, url, f"agent_turn_judge_seconds_{k}") - judge_before[i]
                for i, k in enumerate(("sum", "count"))
            ]
        finally:
            for c in clients:
                await c.close()
        after = await scrape_histogram(http, url, "agent_time_to_first_audio_seconds")
        underruns = await scrape_value(http, url, "agent_playout_underruns_total") - underruns_before
        stages = {}  # stage -> seconds per call (mean over the level), from /metrics
        for stage in ("vision_encoder", "thinker_prefill"):
            total = [
                await scrape_value(http, url, f'agent_stage_seconds_{k}{{stage="{stage}"}}') for k in ("sum", "count")
            ]
            stages[stage] = (total[0] - stages_before[stage][0]) / max(total[1] - stages_before[stage][1], 1)
    v2v, ttft, ttfa, overhead, glitches, missing, speculative = [], [], [], [], 0, 0, 0
    image_tokens: list[float] = []
    late = 0  # frames the vision encoder saw only at the end of a turn
    timing: dict[str, list[float]] = {}  # omni.turn_timing's stages (ms), every turn
    frames = 0.0  # 20 ms frames of reply audio the agent made (the denominator of the underrun share)
    for c in clients:
        lat = c.turn_latencies()[:turns]
        dones = c.result.of_type("response.done")[:turns]
        for i, v in enumerate(lat):
            if v is None:
                missing += 1
                continue
            v2v.append(v)
            server_ttfa = omni_figures(dones[i]).get("ttfa_ms") if i < len(dones) else None
            if server_ttfa is not None:
                overhead.append(v - silence_s - server_ttfa / 1000)
        for t in c.result.of_type("omni.turn_timing")[:turns]:  # where each turn's time went
            for stage, value in (t.get("stages") or {}).items():
                if value is not None:
                    timing.setdefault(stage, []).append(value)
        figures = [omni_figures(d) for d in dones]
        ttft += [f["ttft_ms"] / 1000 for f in figures if f.get("ttft_ms") is not None]
        ttfa += [f["ttfa_ms"] / 1000 for f in figures if f.get("ttfa_ms") is not None]
        speculative += sum(bool((f.get("stats") or {}).get("speculative")) for f in figures)
        glitches += c.result.glitches
        image_tokens += [
            ((d["response"].get("usage") or {}).get("input_token_details") or {}).get("image_tokens", 0) for d in dones
        ]
        late += sum(int((f.get("stats") or {}).get("frames_encoded_at_end_of_turn") or 0) for f in figures)
        # Every reply of the level (not only the measured turns): the underrun counter counts them all.
        frames += (
            sum(
                int((omni_figures(d).get("stats") or {}).get("audio_samples") or 0)
                for d in c.result.of_type("response.done")
            )
            / 480
        )  # 20 ms frames at 24 kHz
    return {
        "n": n,
        "turns": len(v2v),
        "missing": missing,
        "v2v": v2v,
        "ttft": ttft,
        "ttfa": ttfa,
        "overhead": overhead,
        "glitches": glitches,
        "underruns": underruns,
        "speculative": speculative,
        "frames": frames,
        "dones": sum(min(len(c.result.of_type("response.done")), turns) for c in clients),
        "image_tokens": image_tokens,
        "late_frames": late,
        "stages": stages,
        "timing": timing,
        # CPU-seconds per session-second, by thread kind (the agent's) and for the client process
        "cpu": {k: v / (n * wall) for k, v in cpu.items()},
        "client_cpu": client_cpu / (n * wall),
        # engine-thread seconds per session-second, by stage (a batched call counted once)
        "stage_share": {k: v / (n * wall) for k, v in stage_sums.items() if v > 0},
        "spec_outcomes": {k: int(v) for k, v in spec.items()},
        # end-of-turn judgments during the level: how many, and their compute (s) in all
        "judge_calls": judge[1],
        "judge_s": judge[0],
        "wall": wall,
        # rows (sessions) per batched call, per stage
        "rows_per_call": {k: rows.get(k, 0.0) / v for k, v in calls.items() if v > 0.5},
        "server_ttfa_p50": histogram_quantile(0.5, before, after),
        "server_ttfa_p95": histogram_quantile(0.95, before, after),
    }


def merge_levels(runs: list[dict]) -> dict:
    """Several run_level results of one setting as one: samples pooled, counts summed, the
    stage means averaged (the /metrics quantiles of a block are dropped: they do not pool)."""
    out = dict(runs[0])
    for r in runs[1:]:
        for key, value in r.items():
            if isinstance(value, list):
                out[key] = out[key] + value
            elif key == "stages":
                out[key] = {k: v + value[k] for k, v in out[key].items()}
            elif key == "timing":
                out[key] = {k: out[key].get(k, []) + value.get(k, []) for k in {*out[key], *value}}
            elif isinstance(value, dict):
                continue  # per-level CPU and engine figures: the first block's stand for the setting
            elif key not in ("n", "server_ttfa_p50", "server_ttfa_p95"):
                out[key] += value
    out["stages"] = {k: v / len(runs) for k, v in out["stages"].items()}
    if len(runs) > 1:
        out["server_ttfa_p50"] = out["server_ttfa_p95"] = float("nan")
    return out


def start_server(
    port: int, args: argparse.Namespace, ray_replicas: int = 0, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "agent",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--ice-host",
        "127.0.0.1",
        "--runner",
        args.runner,
        "--max-sessions",
        # A conversation's input transcription runs in an engine slot of its own: with
        # --transcription every session needs two, or most would be refused theirs (capacity).
        str((max(args.levels) + 1) * (2 if args.transcription else 1)),
        "--vad-silence-ms",
        str(args.silence_ms),
        "--log-level",
        "WARNING",
        "--max-calls-per-minute",
        "0",
        *extra,
    ]  # one loopback address opens every call
    if ray_replicas:
        cmd += ["--ray", "--replicas", str(ray_replicas)]
    if not args.ladder:
        # Measure the spoken path's capacity: keep the degradation ladder from switching
        # replies to text (which would hide exactly the latency we are measuring).
        cmd += [
            "--text-only-p95-ms",
            "1e9",
            "--fallback-p95-ms",
            "1e9",
            "--speculation-p95-ms",
            "1e9",
            "--fallback-model",
            "none",
        ]
    if args.model:
        cmd += ["--model", args.model]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.cpu_graphs:
        cmd += ["--cpu-graphs"]
    if args.engine_thread:
        cmd += ["--no-engine-process"]
    return subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def offer_times(url: str, wav: Path, count: int) -> list[float]:
    """Seconds from POSTing an SDP offer to its 201 answer, one call at a time (each hung up at once)."""
    times = []
    async with aiohttp.ClientSession() as http:
        for _ in range(count):
            client = AgentClient(url, wav, video=False)
            try:
                client.pc.addTrack(client.audio)
                client.pc.createDataChannel("oai-events")
                await client.pc.setLocalDescription(await client.pc.createOffer())
                t0 = time.perf_counter()
                async with http.post(
                    f"{url}/v1/realtime/calls",
                    data=client.pc.localDescription.sdp,
                    headers={"Content-Type": "application/sdp"},
                ) as resp:
                    await resp.read()
                    elapsed = time.perf_counter() - t0
                    location = resp.headers.get("Location", "")
                if resp.status == 201:
                    times.append(elapsed)
                    async with http.delete(f"{url}{location}") as gone:
                        await gone.read()
            finally:
                await client.close()
            await asyncio.sleep(0.3)  # let the hung-up call free its slot
    return times


async def measure_deployment(args: argparse.Namespace, wav: Path, ray_replicas: int) -> tuple[dict, list[float]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(port, args, ray_replicas)
    try:
        await wait_ready(url, timeout_s=300.0)
        offers = await offer_times(url, wav, args.offers)
        r = await run_level(
            url,
            lambda: AgentClient(url, wav, video=True, repeat_after_s=args.gap_s, video_fps=args.video_fps),
            args.ray_calls,
            args.turns,
            args.level_timeout_s,
            args.silence_ms / 1000,
        )
    finally:
        server.terminate()
        server.wait(timeout=60)
    return r, offers


async def compare_ray(args: argparse.Namespace, wav: Path) -> None:
    """Single process vs N Serve replicas, same run, same calls, same speech."""
    single, single_offers = await measure_deployment(args, wav, 0)
    print(f"  single process: {single['turns']} turns measured, {single['missing']} without a heard reply", flush=True)
    ray_r, ray_offers = await measure_deployment(args, wav, args.replicas)
    print(
        f"  {args.replicas} replicas: {ray_r['turns']} turns measured, {ray_r['missing']} without a heard reply",
        flush=True,
    )
    ms = lambda v: f"{v * 1000:7.0f}"  # noqa: E731
    print(f"\n{args.ray_calls} concurrent calls, video on; voice-to-voice at the client; offer = POST → 201 answer")
    print(f"{'agent':>14} {'turns':>5} {'v2v p50':>8} {'v2v p95':>8} {'TTFA p50':>8} {'offer p50':>9} {'offer p95':>9}")
    for name, r, offers in (("single", single, single_offers), (f"ray x{args.replicas}", ray_r, ray_offers)):
        print(
            f"{name:>14} {r['turns']:>5} {ms(pct(r['v2v'], 50)):>8} {ms(pct(r['v2v'], 95)):>8} "
            f"{ms(pct(r['ttfa'], 50)):>8} {ms(pct(offers, 50)):>9} {ms(pct(offers, 95)):>9}"
        )
    direct, proxied = pct(single_offers, 50), pct(ray_offers, 50)
    print(
        f"ray_p95_ratio={pct(ray_r['v2v'], 95) / pct(single['v2v'], 95):.2f} offer_p50_direct_ms={direct * 1000:.1f} "
        f"offer_p50_proxy_ms={proxied * 1000:.1f} proxy_offer_overhead_p50_ms={(proxied - direct) * 1000:.1f}"
    )


async def compare_turn_detection(
    url: str, wav: Path, args: argparse.Namespace, limit_s: float, silence_s: float
) -> dict[str, dict]:
    """server_vad against semantic_vad: the same speech, one audio-only session at a time, in
    alternated blocks so that a drift in the machine's load hits both alike."""
    if not args.turn_turns:
        return {}

    def client(kind: str) -> Callable[[], AgentClient]:
        session = {"type": "realtime", "audio": {"input": {"turn_detection": {"type": kind}}}}
        return lambda: AgentClient(url, wav, video=False, repeat_after_s=args.gap_s, session=session)

    blocks = max(1, min(args.turn_blocks, args.turn_turns))
    parts: dict[str, list[dict]] = {"server_vad": [], "semantic_vad": []}
    for b in range(blocks):
        turns = args.turn_turns // blocks + (b < args.turn_turns % blocks)
        for kind in parts:
            parts[kind].append(await run_level(url, client(kind), 1, turns, limit_s, silence_s))
    merged = {kind: merge_levels(runs) for kind, runs in parts.items()}
    for kind, r in merged.items():
        print(f"  {kind}: {r['turns']} turns measured, {r['missing']} without a heard reply", flush=True)
    return merged


def print_timing(results: list[dict]) -> None:
    """The median of each omni.turn_timing stage (ms) per session count: where the agent's
    voice-to-voice goes (docs/operations.md), from the end of speech to the first sound out."""
    from agent.realtime.turn_timing import STAGES

    print("# turn timing, median ms per stage (omni.turn_timing; the stages add up to the agent's voice-to-voice)")
    print("sessions " + " ".join(f"{s:>12}" for s in STAGES) + "        total")
    for r in results:
        timing = r.get("timing") or {}
        medians = [statistics.median(timing[s]) if timing.get(s) else float("nan") for s in STAGES]
        print(f"{r['n']:>8} " + " ".join(f"{m:>12.1f}" for m in medians) + f" {sum(medians):>12.1f}")


def print_judge(results: list[dict]) -> None:
    """What the end-of-turn judge cost at each level (semantic_vad sessions only)."""
    for r in results:
        if r.get("judge_calls"):
            each = 1000 * r["judge_s"] / r["judge_calls"]
            share = r["judge_s"] / (r["n"] * r["wall"])
            print(
                f"judge at n={r['n']}: {r['judge_calls']:.0f} pauses judged, {each:.1f} ms each, "
                f"{share * 1000:.1f} ms of one core per session-second"
            )


def underrun_share(r: dict) -> float:
    return r["underruns"] / r["frames"] if r["frames"] else float("nan")


THREADS = ("engine", "asyncio", "executor", "decoder", "decode", "native", "other")


def print_cpu(results: list[dict]) -> None:
    """CPU-seconds per session-second at each level: the agent's threads by kind, the clients'
    process, and the engine thread's time by stage (the rest of its time is `untimed`)."""
    print("\nCPU-seconds per session-second (agent threads by kind; clients = this process)")
    print(f"{'sessions':>8} " + " ".join(f"{k:>8}" for k in THREADS) + f" {'agent':>8} {'clients':>8}")
    for r in results:
        cpu = r["cpu"]
        print(
            f"{r['n']:>8} "
            + " ".join(f"{cpu.get(k, 0.0):8.3f}" for k in THREADS)
            + f" {sum(cpu.values()):8.3f} {r['client_cpu']:8.3f}"
        )
    stages = sorted(
        {k for r in results for k in r["stage_share"]},
        key=lambda k: -max(r["stage_share"].get(k, 0.0) for r in results),
    )
    print("\nengine thread seconds per session-second, by stage")
    print(f"{'stage':>18} " + " ".join(f"{'n=' + str(r['n']):>8}" for r in results))
    for stage in [*stages, "untimed"]:
        row = []
        for r in results:
            share = r["stage_share"]
            value = (r["cpu"].get("engine", 0.0) - sum(share.values())) if stage == "untimed" else share.get(stage, 0.0)
            row.append(f"{value:8.3f}")
        print(f"{stage:>18} " + " ".join(row))
    print(
        "\nsessions per engine call (code predictor / code2wav / vision encoder): "
        + "; ".join(
            f"n={r['n']}: {r['rows_per_call'].get('code_predictor', float('nan')):.2f} / "
            f"{r['rows_per_call'].get('code2wav', float('nan')):.2f} / "
            f"{r['rows_per_call'].get('vision_encoder', float('nan')):.2f}"
            for r in results
        )
    )
    print(
        "\nspeculative replies by outcome: "
        + "; ".join(
            f"n={r['n']}: " + ", ".join(f"{k} {v}" for k, v in sorted(r["spec_outcomes"].items())) for r in results
        )
    )


async def main_async(args: argparse.Namespace) -> None:
    restrict_ice_hosts(["127.0.0.1"])
    tmp = Path(tempfile.mkdtemp(prefix="bench_rtc_"))
    wav = make_speech(tmp / "speech.wav")
    if args.ray:
        await compare_ray(args, wav)
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(port, args)
    try:
        await wait_ready(url)
        results = []
        silence_s, limit_s = args.silence_ms / 1000, args.level_timeout_s
        # --transcription: every client also asks for live input transcription (partials while
        # it speaks, the final transcript at the end of its turn).
        session = (
            {"type": "realtime", "audio": {"input": {"transcription": {"model": "thinker"}}}}
            if args.transcription
            else None
        )
        if args.turn_detection == "semantic_vad":
            session = session or {"type": "realtime", "audio": {"input": {}}}
            session["audio"]["input"]["turn_detection"] = {"type": "semantic_vad"}
        if args.warmup_turns:
            await run_level(
                url,
                lambda: AgentClient(
                    url, wav, video=True, repeat_after_s=args.gap_s, video_fps=args.video_fps, session=session
                ),
                max(args.levels),
                args.warmup_turns,
                limit_s,
                silence_s,
            )
            print(f"  warm-up: {max(args.levels)} sessions x {args.warmup_turns} turns (not measured)", flush=True)
        for n in args.levels:
            r = await run_level(
                url,
                lambda: AgentClient(
                    url, wav, video=True, repeat_after_s=args.gap_s, video_fps=args.video_fps, session=session
                ),
                n,
                args.turns,
                limit_s,
                silence_s,
            )
            results.append(r)
            print(f"  level {n}: {r['turns']} turns measured, {r['missing']} without a heard reply", flush=True)
        transports = {}
        if args.transport_turns:
            # Same agent, same speech, one session at a time, no video on either: only the
            # transport differs.
            transports["webrtc"] = await run_level(
                url,
                lambda: AgentClient(url, wav, video=False, repeat_after_s=args.gap_s),
                1,
                args.transport_turns,
                limit_s,
                silence_s,
            )
            transports["websocket"] = await run_level(
                url,
                lambda: WsAgentClient(url, wav, repeat_after_s=args.gap_s),
                1,
                args.transport_turns,
                limit_s,
                silence_s,
            )
            for name, r in transports.items():
                print(f"  {name}: {r['turns']} turns measured, {r['missing']} without a heard reply", flush=True)
        speculation = {}
        if args.spec_turns:
            rtc = lambda u: lambda: AgentClient(u, wav, video=False, repeat_after_s=args.gap_s)  # noqa: E731
            speculation["on"] = await run_level(url, rtc(url), 1, args.spec_turns, limit_s, silence_s)
        turn_detection = await compare_turn_detection(url, wav, args, limit_s, silence_s)
        camera = {}
        if args.camera_turns:
            # Same agent, same speech, one session at a time: only the camera differs. Off and on
            # alternate in blocks, so that a drift in the machine's load hits both alike.
            make = {
                "off": lambda: AgentClient(url, wav, video=False, repeat_after_s=args.gap_s),
                "on": lambda: AgentClient(
                    url, wav, repeat_after_s=args.gap_s, video_source=PatternVideoTrack(640, 480, fps=4)
                ),
            }
            blocks = max(1, min(args.camera_blocks, args.camera_turns))
            parts: dict[str, list[dict]] = {"off": [], "on": []}
            for b in range(blocks):
                turns = args.camera_turns // blocks + (b < args.camera_turns % blocks)
                for name in ("off", "on"):
                    parts[name].append(await run_level(url, make[name], 1, turns, limit_s, silence_s))
            camera = {name: merge_levels(runs) for name, runs in parts.items()}
            for name, r in camera.items():
                print(f"  camera {name}: {r['turns']} turns measured, {r['missing']} without a heard reply", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    if args.spec_turns:
        # The same speech against a second agent with speculation off (one agent at a time).
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port_off = s.getsockname()[1]
        url_off = f"http://127.0.0.1:{port_off}"
        server = start_server(port_off, args, extra=("--no-speculative-start",))
        try:
            await wait_ready(url_off)
            speculation["off"] = await run_level(url_off, rtc(url_off), 1, args.spec_turns, limit_s, silence_s)
        finally:
            server.terminate()
            server.wait(timeout=30)

    ms = lambda v: f"{v * 1000:7.0f}"  # noqa: E731
    print(
        f"\nrunner={args.runner} silence={args.silence_ms} ms  (voice-to-voice at the client; "
        "TTFT/TTFA from the server)"
    )
    print(
        f"{'sessions':>8} {'turns':>5} {'v2v p50':>8} {'v2v p95':>8} {'v2v p99':>8} {'TTFT p50':>8} "
        f"{'TTFA p50':>8} {'TTFA p95':>8} {'/metrics p95':>12} {'ovh p50':>8} {'glitch':>6} {'underrun':>8}"
    )
    for r in results:
        print(
            f"{r['n']:>8} {r['turns']:>5} {ms(pct(r['v2v'], 50)):>8} {ms(pct(r['v2v'], 95)):>8} "
            f"{ms(pct(r['v2v'], 99)):>8} {ms(pct(r['ttft'], 50)):>8} {ms(pct(r['ttfa'], 50)):>8} "
            f"{ms(pct(r['ttfa'], 95)):>8} {ms(r['server_ttfa_p95']):>12} {ms(pct(r['overhead'], 50)):>8} "
            f"{r['glitches']:>6} {r['underruns']:>8.0f}"
        )
    print(
        "\nunderrun share (20 ms frames the track ran short of audio, over the reply frames made): "
        + "; ".join(f"n={r['n']}: {underrun_share(r):.2%}" for r in results)
    )
    print_cpu(results)
    print_timing(results)
    print_judge(results)
    by_n = {r["n"]: r for r in results}
    share = lambda n: underrun_share(by_n[n]) if n in by_n else float("nan")  # noqa: E731
    # engine-thread CPU-seconds per session-second (the capacity budget; see docs/load.md)
    engine_cpu = lambda n: by_n[n]["cpu"].get("engine", float("nan")) if n in by_n else float("nan")  # noqa: E731
    base = pct(by_n[1]["v2v"], 95) if 1 in by_n else float("nan")
    four = pct(by_n[4]["v2v"], 95) if 4 in by_n else float("nan")
    # The headline overhead is the stack's own cost at one session; under load it grows with
    # CPU contention on this shared 2-core machine (the table shows it per level).
    overhead = pct(by_n[1]["overhead"] if 1 in by_n else [o for r in results for o in r["overhead"]], 50)
    if transports:
        print("\ntransport (1 session, audio only; end of speech → first audio at the client, TTFA from the server)")
        print(f"{'transport':>9} {'turns':>5} {'e2e p50':>8} {'e2e p95':>8} {'TTFA p50':>8} {'e2e-TTFA':>8}")
        for name, r in transports.items():
            print(
                f"{name:>9} {r['turns']:>5} {ms(pct(r['v2v'], 50)):>8} {ms(pct(r['v2v'], 95)):>8} "
                f"{ms(pct(r['ttfa'], 50)):>8} {ms(pct(r['v2v'], 50) - pct(r['ttfa'], 50)):>8}"
            )
    ws_minus = (
        pct(transports["websocket"]["v2v"], 50) - pct(transports["webrtc"]["v2v"], 50) if transports else float("nan")
    )
    spec_ratio, spec_share = float("nan"), float("nan")
    if speculation:
        print("\nspeculative start (1 session, audio only; server TTFA: end of turn → first audio frame sent)")
        print(
            f"{'agent':>9} {'turns':>5} {'TTFA p50':>8} {'TTFA p95':>8} {'e2e p50':>8} {'from spec':>9} "
            f"{'glitch':>6} {'underrun':>8}"
        )
        for name, r in speculation.items():
            print(
                f"{'spec ' + name:>9} {len(r['ttfa']):>5} {ms(pct(r['ttfa'], 50)):>8} {ms(pct(r['ttfa'], 95)):>8} "
                f"{ms(pct(r['v2v'], 50)):>8} {r['speculative']:>9} {r['glitches']:>6} {r['underruns']:>8.0f}"
            )
        spec_ratio = pct(speculation["on"]["ttfa"], 50) / pct(speculation["off"]["ttfa"], 50)
        spec_share = speculation["on"]["speculative"] / max(1, speculation["on"]["dones"])
    camera_ratio = camera_v2v_ratio = camera_ttfa_delta = image_tokens = float("nan")
    if camera:
        print("\ncamera (1 session; 640x480 at 4 fps vs none; TTFA from the server, image tokens from usage)")
        print(
            f"{'camera':>6} {'turns':>5} {'TTFA p50':>8} {'TTFA p95':>8} {'v2v p50':>8} {'img tok':>7} "
            f"{'vision':>8} {'prefill':>8} {'late frames':>11}   (vision, prefill: mean per call at the end of a turn)"
        )
        for name, r in camera.items():
            print(
                f"{name:>6} {len(r['ttfa']):>5} {ms(pct(r['ttfa'], 50)):>8} {ms(pct(r['ttfa'], 95)):>8} "
                f"{ms(pct(r['v2v'], 50)):>8} {pct(r['image_tokens'], 50):>7.0f} "
                f"{ms(r['stages']['vision_encoder']):>8} {ms(r['stages']['thinker_prefill']):>8} {r['late_frames']:>11}"
            )
        camera_ratio = pct(camera["on"]["ttfa"], 50) / pct(camera["off"]["ttfa"], 50)
        camera_v2v_ratio = pct(camera["on"]["v2v"], 50) / pct(camera["off"]["v2v"], 50)
        camera_ttfa_delta = pct(camera["on"]["ttfa"], 50) - pct(camera["off"]["ttfa"], 50)
        image_tokens = pct(camera["on"]["image_tokens"], 50)
    semantic_drop = float("nan")
    if turn_detection:
        print("\nend of turn (1 session, audio only; voice-to-voice at the client)")
        print(f"{'turn detection':>14} {'turns':>5} {'v2v p50':>8} {'v2v p95':>8} {'TTFA p50':>8} {'judged':>6}")
        for name, r in turn_detection.items():
            print(
                f"{name:>14} {r['turns']:>5} {ms(pct(r['v2v'], 50)):>8} {ms(pct(r['v2v'], 95)):>8} "
                f"{ms(pct(r['ttfa'], 50)):>8} {r['judge_calls']:>6.0f}"
            )
        semantic_drop = pct(turn_detection["server_vad"]["v2v"], 50) - pct(turn_detection["semantic_vad"]["v2v"], 50)
    largest = results[-1] if results else {}
    judge_ms = (
        1000 * largest.get("judge_s", 0.0) / largest["judge_calls"] if largest.get("judge_calls") else float("nan")
    )
    print(
        f"p95_ratio_4_vs_1={four / base:.2f} overhead_p50_ms={overhead * 1000:.0f} "
        f"ws_minus_webrtc_p50_ms={ws_minus * 1000:.0f} speculative_ttfa_ratio={spec_ratio:.2f} "
        f"speculative_share={spec_share:.2f} camera_ttfa_ratio={camera_ratio:.2f} "
        f"camera_ttfa_delta_ms={camera_ttfa_delta * 1000:.1f} camera_v2v_ratio={camera_v2v_ratio:.2f} "
        f"image_tokens={image_tokens:.0f} underrun_share_2={share(2):.4f} underrun_share_4={share(4):.4f} "
        f"engine_cpu_per_session_s={engine_cpu(4):.3f} engine_cpu_ratio_4_vs_1={engine_cpu(4) / engine_cpu(1):.2f} "
        f"semantic_v2v_p50_drop_ms={semantic_drop * 1000:.0f} judge_ms_per_pause={judge_ms:.1f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    p.add_argument("--turns", type=int, default=3, help="turns per client per level")
    p.add_argument("--gap-s", type=float, default=6.0, help="silence after each play of the WAV")
    p.add_argument("--silence-ms", type=int, default=300, help="the agent's end-of-turn silence")
    p.add_argument("--level-timeout-s", type=float, default=90.0)
    p.add_argument("--runner", default="stream", choices=["stream", "reference"])
    p.add_argument("--threads", type=int, default=0, help="the agent's torch CPU threads (0: its default)")
    p.add_argument("--ladder", action="store_true", help="leave the degradation ladder on (default: off)")
    p.add_argument("--video-fps", type=int, default=4, help="client camera rate (the page asks browsers for 4)")
    p.add_argument("--cpu-graphs", action="store_true", help="run the agent with --cpu-graphs (docs/load.md)")
    p.add_argument(
        "--engine-thread",
        action="store_true",
        help="run the agent with --no-engine-process: the engine a thread of its process (docs/load.md)",
    )
    p.add_argument(
        "--warmup-turns",
        type=int,
        default=0,
        help="turns per client at the largest level first, not measured (e.g. to trace CPU graphs)",
    )
    p.add_argument(
        "--transcription", action="store_true", help="the load levels' clients ask for input transcription too"
    )
    p.add_argument(
        "--transport-turns", type=int, default=5, help="turns each for the WebRTC vs WebSocket comparison (0: skip it)"
    )
    p.add_argument(
        "--spec-turns",
        type=int,
        default=5,
        help="turns each with speculative start on and off (0: skip the comparison)",
    )
    p.add_argument(
        "--camera-turns", type=int, default=5, help="turns each for the camera on vs off comparison (0: skip it)"
    )
    p.add_argument(
        "--camera-blocks", type=int, default=2, help="off/on blocks the camera turns are split into, alternated"
    )
    p.add_argument(
        "--turn-detection",
        choices=["server_vad", "semantic_vad"],
        default="server_vad",
        help="what the load levels' sessions ask for (the agent's default: server_vad)",
    )
    p.add_argument("--turn-turns", type=int, default=5, help="turns each for server_vad vs semantic_vad (0: skip it)")
    p.add_argument("--turn-blocks", type=int, default=2, help="blocks the end-of-turn turns are split into")
    p.add_argument("--model", default=os.environ.get("OMNI_AGENT_MODEL", ""))
    p.add_argument("--ray", action="store_true", help="compare single process with Ray Serve replicas")
    p.add_argument("--replicas", type=int, default=2, help="with --ray: Serve replicas")
    p.add_argument("--ray-calls", type=int, default=2, help="with --ray: concurrent calls on each deployment")
    p.add_argument("--offers", type=int, default=10, help="with --ray: offers timed on each deployment")
    args = p.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
