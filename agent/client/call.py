"""`omni-agent call URL`: a headless device client (a glasses prototype, a kiosk, a Raspberry Pi).

It joins a session over WebRTC the way the page does, with the microphone and camera taken
from devices (V4L2, ALSA, PulseAudio through aiortc's MediaPlayer, i.e. FFmpeg's input
devices) or from media files, plays the agent's voice on a sound device or writes it to a
WAV file, prints the captions as they arrive, and obeys `input_video.throttle` (the camera
track drops to the asked rate and size, or pauses). When the call drops or the agent cannot
be reached it reconnects with exponential backoff; Ctrl-C hangs up and exits cleanly.

It is agent/client/client.py's AgentClient (what the tests and benchmarks drive) with real media.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

from aiortc.contrib.media import MediaPlayer

from agent.client.client import AgentClient
from agent.client.media import DeviceSink, LoopedVideoFile, SilenceAfterEnd, WavSink
from agent.transport.ice import restrict_ice_hosts

log = logging.getLogger(__name__)

CAMERA_MAX_FPS = 4.0  # the agent samples 4 frames per second: sending more only costs both sides
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 10.0
STABLE_CALL_S = 10.0  # a call that lasted this long resets the backoff
CONNECT_TIMEOUT_S = 20.0  # an answered offer whose media never connects is a failed call
FATAL_STATUSES = (400, 401, 403, 404, 413)  # retrying cannot fix these


@dataclass(frozen=True)
class CallOptions:
    url: str
    audio_file: Optional[Path] = None  # speech to send once (then silence); else the microphone
    mic: str = "default"
    mic_format: str = "pulse"  # FFmpeg input device: pulse, alsa, avfoundation, dshow
    video_file: Optional[Path] = None  # looped like a camera; else the camera device
    camera: str = ""  # e.g. /dev/video0; "" and no video file: no video
    camera_format: str = "v4l2"
    camera_size: str = "640x480"
    out_wav: Optional[Path] = None  # the agent's voice to this WAV; else to the speaker
    speaker: str = "default"
    speaker_format: str = "pulse"  # FFmpeg output device: pulse, alsa
    api_key: Optional[str] = None
    text_only: bool = False
    max_replies: int = 0  # exit after this many finished replies (0: run until Ctrl-C)
    max_seconds: float = 0.0  # exit after this long (0: no limit)
    ice_hosts: tuple[str, ...] = ()  # host addresses ICE gathers (empty: every interface)


class Call:
    """Runs calls until stopped: connect, hold the call while it lives, reconnect with backoff."""

    def __init__(self, opts: CallOptions, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
        self.opts = opts
        self._out, self._err = out, err
        self._stop = asyncio.Event()
        self._dropped = asyncio.Event()
        self._sink: Any = WavSink(opts.out_wav) if opts.out_wav else None
        self.replies = 0
        self.connections = 0
        self.exit_code = 0
        self._mid_line = False

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> int:
        if self.opts.max_seconds:
            asyncio.get_running_loop().call_later(self.opts.max_seconds, self.stop)
        backoff = BACKOFF_START_S
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    await self._one_call()
                except _Fatal as exc:
                    self._say(f"call refused: {exc}")
                    self.exit_code = 2
                    return self.exit_code
                except Exception as exc:  # unreachable agent, 503, a dead peer: try again
                    self._say(f"call failed: {exc}")
                if self._stop.is_set():
                    break
                if time.monotonic() - started >= STABLE_CALL_S:
                    backoff = BACKOFF_START_S
                delay = backoff * random.uniform(0.8, 1.2)  # jitter: many devices, one restarted agent
                self._say(f"reconnecting in {delay:.1f} s")
                await self._sleep(delay)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
        finally:
            if self._sink is not None:
                self._sink.close()
        return self.exit_code

    async def _one_call(self) -> None:
        audio, video = self._sources()
        self._dropped.clear()
        client = AgentClient(
            self.opts.url,
            audio_source=audio,
            video_source=video,
            api_key=self.opts.api_key,
            video_max_fps=CAMERA_MAX_FPS,
            session={"type": "realtime", "output_modalities": ["text" if self.opts.text_only else "audio"]},
            on_event=self._on_event,
            on_audio=self._on_audio,
        )
        client.pc.on("connectionstatechange", lambda: self._on_state(client))
        try:
            try:
                await client.connect()
            except RuntimeError as exc:  # the agent answered the offer with an error
                status = _status_of(exc)
                if status in FATAL_STATUSES:
                    raise _Fatal(str(exc)) from None
                raise
            if not await self._connected(client):
                raise ConnectionError(f"media did not connect in {CONNECT_TIMEOUT_S:.0f} s")
            self.connections += 1
            self._say(f"connected: {client.result.location}")
            stop, dropped = asyncio.ensure_future(self._stop.wait()), asyncio.ensure_future(self._dropped.wait())
            await asyncio.wait([stop, dropped], return_when=asyncio.FIRST_COMPLETED)
            for task in (stop, dropped):
                task.cancel()
            if not self._stop.is_set():
                raise ConnectionError(f"the call dropped ({client.pc.connectionState})")
        finally:
            self._end_line()
            if client.result.location:
                try:
                    await asyncio.wait_for(client.hangup(), 5)
                except Exception:  # the agent may be gone already: the peer closes anyway
                    pass
            await client.close()

    async def _connected(self, client: AgentClient) -> bool:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while client.pc.connectionState != "connected":
            if client.pc.connectionState in ("failed", "closed") or time.monotonic() > deadline or self._stop.is_set():
                return self._stop.is_set()
            await asyncio.sleep(0.05)
        return True

    def _sources(self) -> tuple[Any, Any]:
        o = self.opts
        if o.audio_file is not None:
            try:
                spoken = MediaPlayer(str(o.audio_file)).audio
            except (OSError, ValueError) as exc:  # no such file, not media: retrying cannot help
                raise _Fatal(f"cannot play {o.audio_file} as the microphone: {exc}") from None
            audio = SilenceAfterEnd(spoken) if spoken is not None else None
        else:
            audio = MediaPlayer(o.mic, format=o.mic_format).audio
        video = None
        if o.video_file is not None:
            try:
                video = LoopedVideoFile(o.video_file)
            except (OSError, ValueError) as exc:  # no such file, not media, no video in it
                raise _Fatal(f"cannot play {o.video_file} as the camera: {exc}") from None
        elif o.camera:
            video = MediaPlayer(
                o.camera, format=o.camera_format, options={"video_size": o.camera_size, "framerate": "15"}
            ).video
        if audio is None:
            raise _Fatal(f"no audio stream in {o.audio_file or o.mic}")
        return audio, video

    # ---- what the agent sends ------------------------------------------------------------
    def _on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind in ("response.output_audio_transcript.delta", "response.output_text.delta"):
            if not self._mid_line:
                self._out.write("agent: ")
                self._mid_line = True
            self._out.write(event.get("delta", ""))
            self._out.flush()
        elif kind == "response.done":
            self._end_line()
            self.replies += 1
            if self.opts.max_replies and self.replies >= self.opts.max_replies:
                self.stop()
        elif kind == "input_audio_buffer.speech_started":
            self._end_line()
        elif kind == "input_video.throttle":
            state = (
                "paused"
                if event.get("paused")
                else f"{event.get('max_fps')} fps, 1/{event.get('scale_resolution_down_by')} size"
            )
            self._say(f"camera: {state} ({event.get('reason')})")
        elif kind == "error":
            self._say(f"agent error: {(event.get('error') or {}).get('message')}")

    def _on_audio(self, frame: Any) -> None:
        if self._sink is None:
            try:
                self._sink = DeviceSink(self.opts.speaker, self.opts.speaker_format)
            except Exception as exc:
                self._say(f"no speaker ({exc}); the agent's voice is not played")
                self._sink = _Discard()
        self._sink.write(frame)

    def _on_state(self, client: AgentClient) -> None:
        if client.pc.connectionState in ("failed", "closed"):
            self._dropped.set()

    # ---- terminal ------------------------------------------------------------------------
    def _end_line(self) -> None:
        if self._mid_line:
            self._out.write("\n")
            self._out.flush()
            self._mid_line = False

    def _say(self, message: str) -> None:
        self._end_line()
        self._err.write(f"[omni-agent call] {message}\n")
        self._err.flush()

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except asyncio.TimeoutError:
            pass


class _Fatal(Exception):
    """A refusal that retrying cannot fix (bad key, bad offer, no such media)."""


class _Discard:
    def write(self, frame: Any) -> None: ...

    def close(self) -> None: ...


def _status_of(exc: Exception) -> Optional[int]:
    # AgentClient raises "offer refused: <status> <body>".
    parts = str(exc).split()
    return int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the agent's base URL, e.g. http://127.0.0.1:8080")
    p.add_argument(
        "--audio",
        type=Path,
        dest="audio_file",
        metavar="FILE",
        help="speak this media file once, then silence (default: the microphone)",
    )
    p.add_argument("--mic", default="default", help="microphone device (default %(default)s)")
    p.add_argument(
        "--mic-format", default="pulse", help="FFmpeg input device for --mic: pulse, alsa, ... (default %(default)s)"
    )
    p.add_argument(
        "--video", type=Path, dest="video_file", metavar="FILE", help="send this video file, looped, as the camera"
    )
    p.add_argument(
        "--camera", default="", metavar="DEVICE", help="camera device, e.g. /dev/video0 (default: no camera)"
    )
    p.add_argument("--camera-format", default="v4l2", help="FFmpeg input device for --camera (default %(default)s)")
    p.add_argument("--camera-size", default="640x480", help="(default %(default)s)")
    p.add_argument(
        "--out", type=Path, dest="out_wav", metavar="WAV", help="write the agent's voice here (default: the speaker)"
    )
    p.add_argument("--speaker", default="default", help="speaker device (default %(default)s)")
    p.add_argument("--speaker-format", default="pulse", help="FFmpeg output device: pulse, alsa (default %(default)s)")
    p.add_argument("--api-key", default=None, help="Bearer key for an agent started with --api-key")
    p.add_argument(
        "--ice-host",
        action="append",
        default=[],
        dest="ice_hosts",
        metavar="ADDR",
        help="host address ICE gathers (repeatable; 127.0.0.1 for an agent on this machine); "
        "default: every interface but loopback",
    )
    p.add_argument("--text-only", action="store_true", help="ask for text replies (captions only)")
    p.add_argument(
        "--max-replies", type=int, default=0, help="exit after this many replies (default: run until Ctrl-C)"
    )
    p.add_argument("--max-seconds", type=float, default=0.0, help="exit after this many seconds (default: no limit)")


def options_from_args(ns: argparse.Namespace) -> CallOptions:
    fields = set(CallOptions.__dataclass_fields__)
    values = {k: v for k, v in vars(ns).items() if k in fields}
    values["ice_hosts"] = tuple(values.get("ice_hosts") or ())
    return CallOptions(**values)


def run_call(opts: CallOptions, on_start: Optional[Callable[[Call], None]] = None) -> int:
    """Run until Ctrl-C (or the reply/time limit); SIGINT and SIGTERM hang up cleanly."""

    restrict_ice_hosts(opts.ice_hosts)

    async def main() -> int:
        call = Call(opts)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, call.stop)
        if on_start is not None:
            on_start(call)
        return await call.run()

    return asyncio.run(main())
