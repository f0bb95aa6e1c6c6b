"""Barge-in latency at the client: speech onset → the agent's audio stops, over real WebRTC.

One aiortc client on loopback against a real agent process (tiny model). The client asks a
question (espeak-ng speech); once the agent's reply audio is arriving it waits a random
0.3–1.0 s, then talks over it. Per interruption it measures, on its own clock:

- onset: when the first voiced 20 ms frame of the interrupting utterance leaves the client's
  microphone track (frame RMS above -40 dBFS);
- stop: the start of the silence that ends the interrupted reply at the client: the arrival of
  the first quiet frame (RMS under -50 dBFS) after the reply's last audible one. The agent's
  track keeps sending silence when it has nothing to play, so silence arrives as frames.

and, from the data channel, when `input_audio_buffer.speech_started` and
`output_audio_buffer.cleared` arrived: onset → cleared is the server's confirmation (the
endpointer's --barge-in-ms of voiced audio, its 80 ms chunks, the detector) plus the data
channel. With the barge-in pause (the agent's default) the agent falls silent at the candidate,
the first voiced 20 ms above the echo level, long before the confirmation, so stop comes before
cleared (clr→stop is negative); with --no-pause (the agent's --no-barge-in-pause) cleared →
stop is the outbound flush (the next 20 ms frame is silence), Opus, RTP and the client's jitter
hold. Either way stop is the first silence the client hears, and a try counts only when the
server confirmed the barge-in (below). The interrupting utterance is a user turn: the agent answers
it, and the client interrupts that answer next (or asks again when no spoken answer comes).

Table columns besides those: `1st gap` says "early" when the received audio already had a hole
of >= 100 ms (an underrun) between the onset and the stop; `agent dBFS` is the agent's loudest
received 20 ms in the 0.5 s before the onset (what the echo guard compares the speech with). The
script also runs the endpointer alone over the same utterance (no transport, every onset phase in
the 80 ms chunk) to show how much of the time is the confirmation rule itself.

An interruption counts only when the server really cut a reply (`output_audio_buffer.cleared`
after the onset); a reply that ended by itself first is skipped and retried; a barge-in the
server never confirmed counts as a miss (infinite latency). The client does not feed the
agent's audio back into its microphone, so there is no echo; the echo guard still applies
(the speech must be louder than the agent's recent output − 6 dB), so the utterances are at a
normal speech level (--speech-dbfs, the RMS of their voiced frames).

Last line: `barge_in_p50_ms=.. barge_in_p95_ms=.. confirmation_ms=600 target_ms=660
interruptions=N within_target=true|false` (target: confirmation + 60 ms at P95, issue 9).
Everything stays on 127.0.0.1; every loop is bounded in count and seconds. Run it inside a
loopback-only namespace (it opens WebRTC peers):

    unshare -n sh -c 'ip link set lo up && .venv/bin/python scripts/bench_barge_in.py [--interruptions 20]'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import wave
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import aiohttp
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_rtc import free_port  # noqa: E402  (scripts/ is on sys.path when run)

from agent.client.client import wait_ready  # noqa: E402
from agent.client.media import SEND_FRAME, SEND_RATE, PacedAudioTrack  # noqa: E402
from agent.config import Config  # noqa: E402
from agent.transport.ice import restrict_ice_hosts  # noqa: E402
from agent.transport.jitter import lower_audio_jitter_hold  # noqa: E402
from agent.transport.peer import close_peer  # noqa: E402

VOICED_DBFS = -40.0  # a sent frame above this is speech (the onset)
AUDIBLE_DBFS = -50.0  # a received frame above this is the agent's voice
REPLY_GAP_S = 0.3  # audible after this much quiet: a new reply started
STOP_SILENCE_S = 0.1  # quiet this long after a reply's last audible frame: it stopped
QUESTION = "Hello agent, please tell me a long story about the sea."
INTERRUPTION = "Hold on, let me ask you something else."


def dbfs(pcm: np.ndarray) -> float:
    if not pcm.size:
        return -200.0
    rms = float(np.sqrt(np.mean(np.square(pcm.astype(np.float64))))) / 32768.0
    return 20 * np.log10(max(rms, 1e-10))


def speech(folder: Path, name: str, text: str, level_dbfs: float) -> np.ndarray:
    """espeak-ng speech at 48 kHz int16, leading silence trimmed, voiced frames at level_dbfs RMS."""
    raw = folder / f"{name}.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "170", "-w", str(raw), text], check=True)
    with wave.open(str(raw)) as w:
        rate = w.getframerate()
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float64)
    pcm = np.interp(np.linspace(0, len(pcm) - 1, int(len(pcm) * SEND_RATE / rate)), np.arange(len(pcm)), pcm)
    n = len(pcm) // SEND_FRAME
    frames = pcm[: n * SEND_FRAME].reshape(n, SEND_FRAME)
    rms = np.sqrt(np.mean(frames**2, axis=1)) / 32768.0
    voiced = rms > 10 ** ((VOICED_DBFS - 10) / 20)
    active = float(np.sqrt(np.mean(rms[voiced] ** 2)))
    pcm = frames[int(np.argmax(voiced)) :].reshape(-1) * (10 ** (level_dbfs / 20) / active)
    return np.clip(np.round(pcm), -32768, 32767).astype(np.int16)


class Microphone(PacedAudioTrack):
    """The client's microphone: silence, or an utterance when say() is called (the pacing is
    client_media's). Records when each utterance's first voiced frame is sent."""

    def __init__(self) -> None:
        super().__init__()
        self._pcm: Optional[np.ndarray] = None
        self._pos = 0
        self._onset: Optional[asyncio.Future] = None
        self._done: Optional[asyncio.Future] = None

    def say(self, pcm: np.ndarray) -> tuple[asyncio.Future, asyncio.Future]:
        """Speak pcm from the next frame on; futures: onset time, time its last frame was sent."""
        loop = asyncio.get_running_loop()
        self._pcm, self._pos = pcm, 0
        self._onset, self._done = loop.create_future(), loop.create_future()
        return self._onset, self._done

    def chunk(self, now: float) -> np.ndarray:
        chunk = np.zeros(SEND_FRAME, np.int16)
        if self._pcm is not None:
            part = self._pcm[self._pos : self._pos + SEND_FRAME]
            chunk[: len(part)] = part
            self._pos += SEND_FRAME
            if self._onset is not None and not self._onset.done() and dbfs(chunk) > VOICED_DBFS:
                self._onset.set_result(now)
            if self._pos >= len(self._pcm):
                self._pcm = None
                if self._done is not None and not self._done.done():
                    self._done.set_result(now)
        return chunk


class Speaker:
    """What the client hears: (arrival time, audible, dBFS) per received frame, bounded."""

    def __init__(self) -> None:
        self.frames: deque[tuple[float, bool, float]] = deque(maxlen=60_000)  # 20 min of 20 ms
        self.last_audible: Optional[float] = None
        self.reply_onsets: list[float] = []  # audible after >= REPLY_GAP_S of quiet

    async def run(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            now = time.monotonic()
            level = dbfs(frame.to_ndarray())
            audible = level > AUDIBLE_DBFS
            self.frames.append((now, audible, level))
            if audible:
                if self.last_audible is None or now - self.last_audible >= REPLY_GAP_S:
                    self.reply_onsets.append(now)
                self.last_audible = now

    def playing(self, within_s: float = 0.06) -> bool:
        return self.last_audible is not None and time.monotonic() - self.last_audible <= within_s

    async def reply_onset_after(self, t: float, timeout: float) -> Optional[float]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            onset = next((o for o in self.reply_onsets if o > t), None)
            if onset is not None:
                return onset
            await asyncio.sleep(0.01)
        return None

    def loudest(self, t0: float, t1: float) -> float:
        return max((lvl for t, audible, lvl in self.frames if t0 <= t <= t1 and audible), default=-200.0)

    def stop_after(self, t0: float, t1: float) -> tuple[Optional[float], Optional[float]]:
        """(start of the silence after the last audible frame in [t0, t1], start of the first
        >= STOP_SILENCE_S quiet run after t0). None: no audible frame in the window."""
        window = [f for f in self.frames if f[0] >= t0]
        last = max((i for i, f in enumerate(window) if f[1] and f[0] <= t1), default=None)
        if last is None:
            return None, None
        final = window[last + 1][0] if last + 1 < len(window) else window[last][0] + 0.02
        quiet_since: Optional[float] = None  # arrival of the first quiet frame of the current run
        for t, audible, _ in window:
            if audible:
                if quiet_since is not None and t - quiet_since >= STOP_SILENCE_S:
                    break
                quiet_since = None
            elif quiet_since is None:
                quiet_since = t
        return final, quiet_since


@dataclass
class Interruption:
    onset: float
    speech_started: Optional[float]  # event arrival, client clock
    cleared: Optional[float]
    stop: Optional[float]
    first_gap: Optional[float]
    delay_s: float  # reply audio start → onset
    agent_dbfs: float  # the agent's loudest received 20 ms in the 0.5 s before the onset

    @property
    def total_ms(self) -> float:
        if self.cleared is None or self.stop is None:
            return float("inf")
        return (self.stop - self.onset) * 1000


class Caller:
    """The client peer: microphone, speaker, and the oai-events channel's timed events."""

    def __init__(self, url: str, prefetch: int) -> None:
        self.url = url
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.mic = Microphone()
        self.speaker = Speaker()
        self.events: list[tuple[float, dict[str, Any]]] = []
        self._prefetch = prefetch
        self._tasks: list[asyncio.Task] = []
        self._location = ""
        self.channel = self.pc.createDataChannel("oai-events")
        self.channel.on("message", lambda m: self.events.append((time.monotonic(), json.loads(m))))

    async def connect(self) -> None:
        self.pc.addTrack(self.mic)

        @self.pc.on("track")
        def on_track(track: MediaStreamTrack) -> None:
            if track.kind == "audio":
                for t in self.pc.getTransceivers():
                    if t.receiver.track is track:
                        lower_audio_jitter_hold(t.receiver, self._prefetch)
                self._tasks.append(asyncio.ensure_future(self.speaker.run(track)))

        await self.pc.setLocalDescription(await self.pc.createOffer())
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{self.url}/v1/realtime/calls",
                data=self.pc.localDescription.sdp,
                headers={"Content-Type": "application/sdp"},
            ) as resp:
                body = await resp.text()
                if resp.status != 201:
                    raise RuntimeError(f"offer refused: {resp.status} {body}")
                self._location = resp.headers.get("Location", "")
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=body, type="answer"))

    def first_event(self, kind: str, after: float) -> Optional[float]:
        return next((t for t, e in self.events if t > after and e.get("type") == kind), None)

    async def wait_event(self, kind: str, after: float, timeout: float) -> Optional[float]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            t = self.first_event(kind, after)
            if t is not None:
                return t
            await asyncio.sleep(0.01)
        return None

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.channel.remove_all_listeners()
        if self._location:
            try:
                async with aiohttp.ClientSession() as http:
                    async with http.delete(f"{self.url}{self._location}") as resp:
                        await resp.read()
            except aiohttp.ClientError:
                pass
        await close_peer(self.pc)


async def interrupt_once(
    caller: Caller,
    question: np.ndarray,
    interruption: np.ndarray,
    rng: random.Random,
    since: Optional[float],
    log: list[str],
) -> Optional[Interruption]:
    """One try: have a reply playing (the answer to what was said last, after `since`, or else to
    the question), talk over it, time it. None: no interruption to count."""
    reply = None if since is None else await caller.speaker.reply_onset_after(since, timeout=5.0)
    if reply is None:
        # Nothing (more) to interrupt: ask the question and wait for its spoken answer.
        _, said = caller.mic.say(question)
        await asyncio.wait_for(said, 15.0)
        reply = await caller.speaker.reply_onset_after(time.monotonic(), timeout=10.0)
        if reply is None:
            log.append("no spoken reply within 10 s of the question")
            return None
    delay = rng.uniform(0.3, 1.0)
    await asyncio.sleep(max(0.0, reply + delay - time.monotonic()))
    if not caller.speaker.playing():
        log.append(f"reply ended by itself within {delay:.2f} s")
        return None
    onset_f, said = caller.mic.say(interruption)
    onset = await asyncio.wait_for(onset_f, 2.0)
    started = await caller.wait_event("input_audio_buffer.speech_started", onset, timeout=3.0)
    cleared = caller.first_event("output_audio_buffer.cleared", onset)
    drained = caller.first_event("output_audio_buffer.stopped", onset)
    if started is not None:
        cleared = cleared or await caller.wait_event("output_audio_buffer.cleared", onset, timeout=0.5)
    if cleared is None and drained is not None:
        log.append("reply drained before the barge-in was confirmed")
        await asyncio.wait_for(said, 10.0)
        return None
    # The interrupted reply's audio is what arrives before the interruption's own answer can:
    # that needs the utterance's end + the end-of-turn silence, far after the confirmation.
    await asyncio.sleep(max(0.0, (cleared or onset + 3.0) + 0.3 - time.monotonic()))
    stop, first_gap = caller.speaker.stop_after(onset, (cleared or onset + 3.0) + 0.2)
    await asyncio.wait_for(said, 10.0)
    return Interruption(onset, started, cleared, stop, first_gap, delay, caller.speaker.loudest(onset - 0.5, onset))


def endpointer_alone(
    pcm48: np.ndarray, barge_in_ms: int, agent_dbfs: Optional[float], guard: bool = True, candidate: bool = False
) -> list[float]:
    """The confirmation the endpointer itself needs for this utterance, without any transport:
    ms from the first voiced 20 ms frame to the 80 ms chunk whose push() starts the turn, for
    each of the four 20 ms phases of the onset within a chunk. The client sends a frame when its
    audio is complete (its pts time), so a chunk is at the server one frame before its end.
    agent_dbfs: the level the agent plays (None: it is silent: a plain turn start, min_speech_ms);
    guard False: the duration rule only (--no-echo-guard). candidate: time to the BargeInCandidate
    the agent pauses on instead (fed per 20 ms frame as the server gets them: peek(), then push()
    once a chunk is complete)."""
    from agent.config import INPUT_RATE
    from agent.media.ingest import CHUNK_SECONDS, AudioChunk
    from agent.media.turn_events import BargeInCandidate, SpeechStarted
    from agent.media.vad import Endpointer

    level = None if agent_dbfs is None else 10 ** (agent_dbfs / 20)
    pcm16 = pcm48[: len(pcm48) // 3 * 3].astype(np.float32).reshape(-1, 3).mean(axis=1) / 32768.0
    sub = INPUT_RATE // 50
    n = len(pcm16) // sub
    loud = np.sqrt(np.mean(pcm16[: n * sub].reshape(n, sub) ** 2, axis=1)) > 10 ** (VOICED_DBFS / 20)
    first_voiced = int(np.argmax(loud)) * 0.02
    chunk_len = int(CHUNK_SECONDS * INPUT_RATE)
    out = []
    for phase in range(4):
        lead = np.zeros(chunk_len * 12 + phase * sub, np.float32)  # ~1 s of quiet first
        audio = np.concatenate([lead, pcm16, np.zeros(chunk_len * 4, np.float32)])
        ep = Endpointer(barge_in_ms=barge_in_ms, echo=lambda: level, echo_margin_db=-6.0 if guard else None)
        onset = len(lead) / INPUT_RATE + first_voiced
        for i in range(len(audio) // chunk_len):
            chunk = AudioChunk(audio[i * chunk_len : (i + 1) * chunk_len], i, i * CHUNK_SECONDS)
            if candidate:
                k = next(
                    (
                        k
                        for k in range(3)
                        if any(isinstance(e, BargeInCandidate) for e in ep.peek(i, chunk.pcm[: (k + 1) * sub]))
                    ),
                    None,
                )
                if k is not None or any(isinstance(e, BargeInCandidate) for e in ep.push(chunk)):
                    ready = chunk.start + (4 if k is None else k + 1) * 0.02
                    out.append((ready - 0.02 - onset) * 1000)
                    break
            elif any(isinstance(e, SpeechStarted) for e in ep.push(chunk)):
                out.append((chunk.end - 0.02 - onset) * 1000)
                break
        else:
            out.append(float("inf"))
    return out


async def scrape(url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics") as resp:
            for line in (await resp.text()).splitlines():
                if line and not line.startswith("#"):
                    full, value = line.rsplit(" ", 1)
                    name = full.split("{", 1)[0]
                    values[name] = values.get(name, 0.0) + float(value)
                    if full != name:  # each labelled series too
                        values[full] = float(value)
    return values


def start_server(port: int, args: argparse.Namespace, log: Path) -> subprocess.Popen:
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
        "--max-sessions",
        "2",
        "--log-level",
        "WARNING",
        "--barge-in-ms",
        str(args.barge_in_ms),
    ]
    if args.no_pause:
        cmd += ["--no-barge-in-pause"]
    if not args.ladder:
        # A busy 2-core box would make replies text-only (nothing to interrupt): keep them spoken.
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
    with log.open("wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], stdout=out, stderr=subprocess.STDOUT)


def header(args: argparse.Namespace) -> str:
    """Date, code version, package versions and the command line, for the results file."""
    from importlib.metadata import PackageNotFoundError, version

    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "log", "-1", "--format=%h %s"], capture_output=True, text=True, timeout=10
        ).stdout.strip()[:100]
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    versions = []
    for pkg in ("aiortc", "aiohttp", "torch", "transformers", "onnxruntime", "silero-vad", "numpy"):
        try:
            versions.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            pass
    return (
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; commit {commit}\n"
        f"# python {sys.version.split()[0]}; {', '.join(versions)}; {len(os.sched_getaffinity(0))} CPUs\n"
        f"# command: scripts/bench_barge_in.py {' '.join(sys.argv[1:])}".rstrip()
    )


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


async def main_async(args: argparse.Namespace) -> None:
    restrict_ice_hosts(["127.0.0.1"])
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="bench_barge_in_"))
    question = speech(tmp, "question", QUESTION, args.speech_dbfs)
    interruption = speech(tmp, "interruption", INTERRUPTION, args.speech_dbfs)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(header(args), flush=True)
    server_log = tmp / "agent.log"
    server = start_server(port, args, server_log)
    done: list[Interruption] = []
    log: list[str] = []
    try:
        try:
            await wait_ready(url)
        except TimeoutError:
            print(server_log.read_text()[-3000:], file=sys.stderr)
            raise
        before = await scrape(url)
        caller = Caller(url, args.prefetch)
        try:
            await caller.connect()
            for _ in range(200):  # the channel opens after ICE + DTLS + SCTP
                if caller.channel.readyState == "open":
                    break
                await asyncio.sleep(0.05)
            t0 = time.monotonic()
            since: Optional[float] = None
            for _attempt in range(args.max_attempts):
                if len(done) >= args.interruptions or time.monotonic() - t0 > args.max_seconds:
                    break
                try:
                    r = await interrupt_once(caller, question, interruption, rng, since, log)
                except asyncio.TimeoutError:
                    log.append("timed out waiting for the microphone")
                    r = None
                since = time.monotonic()
                if r is not None:
                    done.append(r)
                    print(f"  {len(done):2d}: onset→stop {r.total_ms:6.0f} ms", flush=True)
            elapsed = time.monotonic() - t0
            levels = [lvl for _, audible, lvl in caller.speaker.frames if audible]
        finally:
            await caller.close()
        after = await scrape(url)
    finally:
        server.terminate()
        server.wait(timeout=60)

    ms = lambda a, b: "     -" if a is None or b is None else f"{(b - a) * 1000:6.0f}"  # noqa: E731
    print(
        f"\nbarge-in over WebRTC loopback, tiny model, --barge-in-ms {args.barge_in_ms}, "
        f"{'no barge-in pause' if args.no_pause else 'barge-in pause on'}, client jitter hold "
        f"{args.prefetch} frame(s), speech at {args.speech_dbfs:.0f} dBFS, agent voice median "
        f"{pct(levels, 50):.0f} dBFS (client clock; ss = speech_started, clr = output_audio_buffer.cleared "
        "arrival)"
    )
    print(
        f"{'#':>3} {'delay ms':>8} {'onset→ss':>8} {'onset→clr':>9} {'clr→stop':>8} {'onset→stop':>10} "
        f"{'1st gap':>7} {'agent dBFS':>10}"
    )
    for i, r in enumerate(done, 1):
        gap = "" if r.first_gap is None or r.stop is None or r.first_gap >= r.stop - 0.03 else "early"
        print(
            f"{i:>3} {r.delay_s * 1000:8.0f} {ms(r.onset, r.speech_started):>8} {ms(r.onset, r.cleared):>9} "
            f"{ms(r.cleared, r.stop):>8} {r.total_ms:10.0f} {gap:>7} {r.agent_dbfs:10.1f}"
        )
    totals = [r.total_ms for r in done]
    confirm = [(r.cleared - r.onset) * 1000 for r in done if r.cleared is not None]
    flush = [(r.stop - r.cleared) * 1000 for r in done if r.cleared is not None and r.stop is not None]
    missed = sum(r.cleared is None for r in done)
    print(
        f"onset→clr p50 {pct(confirm, 50):.0f} p95 {pct(confirm, 95):.0f} ms; clr→stop p50 "
        f"{pct(flush, 50):.0f} p95 {pct(flush, 95):.0f} ms; missed barge-ins {missed}; skipped tries "
        f"{len(log)} ({'; '.join(sorted(set(log))) or 'none'}); {elapsed:.0f} s"
    )
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("agent_playout_underruns_total", "agent_turns_total")}
    barge = sorted(k for k in after if k.startswith("agent_barge_in_pauses_total{"))
    outcome = lambda k: k.split("=", 1)[1].strip('"}')  # noqa: E731
    pauses = ", ".join(f"{outcome(k)} {after[k] - before.get(k, 0.0):.0f}" for k in barge)
    print(
        f"server /metrics: barge-in pauses {pauses or 'not exported'}; during the run "
        f"turns {delta['agent_turns_total']:.0f}, playout underruns {delta['agent_playout_underruns_total']:.0f}"
    )
    guard = pct([r.agent_dbfs for r in done], 50)
    alone = {
        "agent silent (plain turn start)": endpointer_alone(interruption, args.barge_in_ms, None),
        f"agent at {guard:.0f} dBFS, guard off": endpointer_alone(interruption, args.barge_in_ms, guard, False),
        f"agent at {guard:.0f} dBFS, guard on": endpointer_alone(interruption, args.barge_in_ms, guard),
        f"agent at {guard:.0f} dBFS, guard on, onset → pause (candidate)": endpointer_alone(
            interruption, args.barge_in_ms, guard, candidate=True
        ),
    }
    print(
        "endpointer alone on the same utterance (no transport), onset → turn start per onset phase "
        "0/20/40/60 ms in the 80 ms chunk: "
        + "; ".join(f"{name}: {'/'.join(f'{v:.0f}' for v in vals)} ms" for name, vals in alone.items())
    )
    target = args.barge_in_ms + 60
    p50, p95 = pct(totals, 50), pct(totals, 95)
    ok = len(done) >= args.interruptions and p95 <= target
    print(
        f"barge_in_p50_ms={p50:.0f} barge_in_p95_ms={p95:.0f} confirmation_ms={args.barge_in_ms} "
        f"target_ms={target} interruptions={len(done)} within_target={'true' if ok else 'false'}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--interruptions", type=int, default=20)
    p.add_argument("--max-attempts", type=int, default=60, help="tries, counted or skipped, at most")
    p.add_argument("--max-seconds", type=float, default=360.0, help="stop starting tries after this")
    p.add_argument(
        "--barge-in-ms", type=int, default=Config().barge_in_ms, help="the agent's flag (default: the agent's own)"
    )
    p.add_argument("--prefetch", type=int, default=1, help="client jitter hold in 20 ms frames (1: browser-like)")
    p.add_argument("--speech-dbfs", type=float, default=-20.0, help="RMS of the client's voiced frames")
    p.add_argument(
        "--no-pause",
        action="store_true",
        help="run the agent with --no-barge-in-pause (silent only once the barge-in is confirmed)",
    )
    p.add_argument("--ladder", action="store_true", help="leave the degradation ladder on (default: off)")
    p.add_argument("--model", default="")
    p.add_argument("--seed", type=int, default=9)
    args = p.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
