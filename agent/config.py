"""The one frozen configuration object, built from the command line (or by tests directly)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.decoding import Decoding
    from agent.transport.ice import IceServer

# Rates the model fixes: 16 kHz mono in, 12.5 Hz tokens (80 ms), 24 kHz out.
INPUT_RATE = 16_000
INPUT_FRAME_SAMPLES = 1_280  # 80 ms at 16 kHz: one frame of the session's audio clock
OUTPUT_RATE = 24_000
OUTPUT_FRAME_SAMPLES = 480  # 20 ms at 24 kHz: one outbound RTP frame
CODEC_FRAME_SAMPLES = 1_920  # 80 ms at 24 kHz: what code2wav renders per codec frame


def default_cache_dir() -> Path:
    """Where the tiny checkpoint is built on first use (XDG cache, overridable)."""
    base = os.environ.get("OMNI_AGENT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "omni-agent"
    )
    return Path(base)


@dataclass(frozen=True)
class Config:
    # network
    host: str = "127.0.0.1"
    port: int = 8080
    # Host addresses ICE advertises. aioice never offers loopback on its own and otherwise
    # probes every interface; tests pin this to 127.0.0.1, production may name a public IP.
    ice_hosts: tuple[str, ...] = ()
    # The page ships inside the package (package data), so an installed agent serves it too.
    web_dir: Path = field(default_factory=lambda: Path(__file__).resolve().parent / "web")
    # When set, every /v1/realtime route needs `Authorization: Bearer` with it or with an
    # ephemeral key minted from it; "" leaves the agent open (fine on loopback, not beyond).
    api_key: str = field(default="", repr=False)
    # Set by a Ray Serve replica to its replica id: its calls are named `<prefix>.rtc_…`, so
    # the router can send a call's follow-ups to its owner (agent/serve/ownership.py). "" = rtc_….
    call_id_prefix: str = ""
    # Origins whose pages may call the agent from the browser (CORS); () = none, "*" = any.
    cors_origins: tuple[str, ...] = ()
    # STUN/TURN servers the agent's peers use (agent/transport/ice.py IceServer); () = host candidates only.
    ice_servers: tuple["IceServer", ...] = ()
    # TURN REST shared secret (coturn's static-auth-secret; agent/transport/turn_credentials.py):
    # a TURN URL given without a credential gets one minted from it per call, valid for
    # turn_ttl_s, for the agent's peer and for the page alike. The secret itself never leaves.
    turn_secret: str = field(default="", repr=False)
    turn_ttl_s: int = 600
    max_calls_per_minute: int = 60  # new calls (WebRTC or WebSocket) per client address; 0 = no limit
    max_events_per_s: float = 200.0  # client events per session (a flood gets `error` events)
    # The hosts ("host" or "host:port") a session's MCP tools may name (agent/realtime/
    # mcp_config.py): none by default, so a client cannot make the agent reach its own network.
    mcp_allow: tuple[str, ...] = ()
    mcp_timeout_s: float = 20.0  # one MCP listing or call, connection included
    # OpenTelemetry traces over OTLP/HTTP (agent/telemetry/otlp.py): a collector's base URL; ""
    # = the OTEL_EXPORTER_OTLP_* variables, and with none of them no tracing at all.
    otlp_endpoint: str = ""
    # SIGTERM/Ctrl-C: stop taking calls, let replies in progress finish for at most this long.
    drain_s: float = 10.0

    # model
    model: str = ""  # path or hub id; "" = the tiny checkpoint in cache_dir
    cache_dir: Path = field(default_factory=default_cache_dir)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 on cuda, fp32 on cpu) | float32 | bfloat16
    quantize: str = ""  # "" | int4: 4-bit weights after loading a float checkpoint (agent/engine/quant)
    cuda_graphs: bool = True
    # On CPU, the engine's steps traced per bucket and replayed off the GIL (agent/engine/
    # agent/engine/compile/cpu_traces.py; docs/load.md). Off by default: buckets first used in a reply are traced
    # there (a one-time stall), and capturing every bucket at start-up is not done yet.
    cpu_graphs: bool = False
    # The engine in a child process of its own (agent/engine/process.py; docs/load.md): the
    # network and the engine then never wait on each other's interpreter lock (at 4 sessions on
    # 2 cores: voice-to-voice P95 3.1 s -> 0.7 s). --no-engine-process: a thread of this process.
    engine_process: bool = True
    # torch.compile of the per-frame step functions: auto = on CUDA only (on CPU the start-up
    # compile costs more than it saves here: agent/engine/compile/inductor.py); on | off.
    compile: str = "auto"
    # Compiled, each decoder layer one nested region: one layer's code generated and called per
    # layer, so the cold compile does not grow with depth (agent/engine/ops/slots.py; on CPU the
    # thinker's step at 48 layers: ~54 s against ~970 s). None: on CUDA, off on CPU.
    compile_regions: bool | None = None
    # Compiled, one compile per batch bucket, each specialised to its batch, instead of one for
    # every bucket (the batch symbolic): a cold start several times as long.
    compile_per_bucket: bool = False
    # The slot caches' attention kernel: auto (flash-attn where installed, flex on CUDA, sdpa on
    # CPU) | sdpa | flex | flash (agent/engine/ops/attention.py).
    attention: str = "auto"
    # Seconds of compiling a start-up may spend before the steps not yet compiled run eagerly
    # (still graphed): a start that is certain to end. 0: no limit.
    compile_budget_s: float = 0.0
    runner: str = "stream"  # stream | reference (transformers' generate(): whole reply at once)
    speaker: str = ""  # "" = first speaker in the talker config
    # Left None, these are the model's own (agent/decoding.py): the tiny random model gets a
    # short prompt, greedy decoding and 48 tokens / 4 s (it rarely stops by itself); any other
    # checkpoint its generation_config.json, else Qwen's sampling, prompt and 1024 tokens / 60 s.
    system_prompt: str | None = None
    max_reply_tokens: int | None = None  # thinker text tokens per reply
    max_reply_seconds: float | None = None  # audio seconds per reply
    decoding: str = "auto"  # auto (the model's) | greedy (argmax in every stage) | sample
    seed: int | None = None  # reply seeds drawn from this (reproducible replies); None: fresh
    sampling: "Decoding | None" = None  # resolved from decoding/seed and the model; tests may set it
    threads: int = 0  # torch intra-op threads on CPU; 0 = all cores but one
    # Tokens a session's conversation may hold; when a turn would overflow it, the session's
    # history is dropped (system prompt kept) and the reply says so (stats.history_reset).
    # Left out on the command line, sized to the GPU's memory at start-up (sized_from_memory).
    context_limit: int = 32768
    audio_window_s: float = 1.0  # AuT attention window (n_window_infer) used for prefill

    # ingest / turns
    vad_silence_ms: int = 300  # end of turn after this much unvoiced audio
    vad_aggressiveness: int = 2  # webrtcvad mode 0..3
    vad_min_speech_ms: int = 120  # voiced audio needed before a turn starts
    vad: str = "silero"  # voice detector: silero (ONNX, one thread) | webrtc (agent/media/voice.py)
    vad_threshold: float = 0.5  # Silero speech probability from which a sub-frame is voiced
    # Echo guard (agent/media/vad.py, agent/media/echo.py): while the agent speaks, a barge-in needs this
    # much voiced audio, each sub-frame louder than the agent's recent loudest frame + margin, with
    # no unvoiced gap over barge_in_gap_ms. 600 ms: a backchannel ("uh-huh", "yeah", "I see": 2 of 30
    # reach it, scripts/bench_turns.py) pauses the agent's voice and lets it go on; a person who goes
    # on talking interrupts. The agent falls silent at the first voiced sub-frame either way.
    barge_in_ms: int = 600
    barge_in_gap_ms: int = 300
    echo_guard: bool = True  # raise the onset threshold by the level played (False: duration only)
    echo_margin_db: float = -6.0
    # Barge-in pause: while the agent speaks, its voice pauses (silence, queue held) on the first
    # voiced sub-frame above the echo level; the confirmed barge-in then drops the held audio, a
    # candidate that dies resumes it where it paused, and so does a pause longer than the bound.
    barge_in_pause: bool = True
    # Longer than an interruption takes to confirm (barge_in_ms of voice with its gaps: up to 1.7 s
    # in the corpus), so a real one is never heard resuming first.
    barge_in_pause_max_ms: int = 2000
    # Speculative start: after this much unvoiced audio inside a turn the engine starts the
    # reply, its output held, while the endpointer keeps listening: committed at the end of
    # turn (vad_silence_ms), discarded invisibly if the user speaks again first. With or without
    # speculation, the turn's audio ends at such a pause when no voice follows it.
    speculative_start: bool = True
    speculation_pause_ms: int = 120
    # Learn the pause per session (agent/media/pauses.py): speculate only past a length the speaker
    # rarely resumes after, speculation_pause_ms at the earliest (False: always at that length).
    speculation_adaptive: bool = True
    # semantic_vad's end-of-turn model (agent/media/turn_model.py): "" = the one `omni-agent
    # fetch-turn-model` keeps in cache_dir, or a path; "off": semantic_vad ends turns by silence alone.
    turn_model: str = ""
    max_turn_seconds: float = 30.0  # a turn longer than this is ended by force
    video: bool = True  # --no-video: camera frames are dropped unread and the sender is asked to pause
    video_fps: float = 4.0
    video_max_side: int = 448  # frames are resized so the longer side is at most this
    video_frames_per_turn: int = (
        2  # latest sampled frames flushed at a turn's end (still images for the reference/fallback runners)
    )
    video_window_s: float = 2.0  # --video-window: this much of a turn gets every grid at video_fps (docs/video.md)
    video_turn_tokens: int = 768  # --video-turn-tokens: visual tokens per turn at most (resolution first, then rate)
    ingest_buffer_frames: int = 8  # bounded ring between ingest and the engine (5-10)
    # Back-pressure on the camera (agent/media/backpressure.py): frames the engine has not taken.
    video_high_water: int = 6  # backlog at which the sender is asked for 1 fps at half size
    video_low_water: int = 1  # backlog under which, held video_throttle_hold_s, it is restored
    video_throttle_hold_s: float = 2.0
    video_pause_after_s: float = 3.0  # still at the high-water mark this long: pause the camera
    jitter_prefetch: int = 0  # aiortc holds 4 x 20 ms; 0 = release in-order packets at once

    # sessions, admission and the degradation ladder
    max_sessions: int = 8
    # Which of max_sessions and context_limit the command line left out: on a GPU, start-up
    # sizes those to its free memory, their values here being the caps (8 sessions, 32768
    # tokens), and checks the given ones (agent/engine/memory_plan.py, docs/memory.md). On the
    # CPU, and for a Config made in code (()), the values stand as they are.
    sized_from_memory: tuple[str, ...] = ()
    # Of max_sessions, slots only high-priority sessions may take (priority classes: high, normal).
    high_priority_slots: int = 0
    # Transcription sessions (captions only: no replies) admitted on a limit of their own, on
    # top of max_sessions; 0: they count against max_sessions like any session. They cost the
    # engine a fraction of a conversation (scripts/bench_captions.py --capacity), so a limit
    # sized for conversations would turn most of the caption viewers an engine can serve away.
    max_transcription_sessions: int = 0
    # Device memory the plan keeps beside weights and caches (agent/engine/memory_plan.py RESERVE_BYTES:
    # activations, graph pools, workspaces); a small card may lower it at its own risk.
    memory_reserve_gib: float = 3.0
    connect_timeout_s: float = 15.0  # an answered offer that never connects frees its slot (counted from the answer)
    max_turns_per_s: float = 20.0  # per engine
    text_only_p95_ms: float = 300.0  # P95 first-response latency above this: text-only replies
    fallback_p95_ms: float = 500.0  # above this: the text-only fallback model
    speculation_p95_ms: float = 200.0  # the ladder's first rung: above this, no speculative starts
    ladder_margin_ms: float = 50.0  # step back only under threshold - margin ...
    ladder_recover_s: float = 10.0  # ... held this long
    engine_inbox: int = 64  # bounded queue into the engine thread ...
    # ... plus this many per session slot: every session sends a command per 20 ms of audio, so
    # a fixed bound would tolerate a shorter engine stall the more sessions there are (12
    # captioned sessions filled 64 in ~100 ms and had their audio dropped): 25 is 0.5 s each.
    engine_inbox_per_session: int = 25

    # Text-only model for degradation level 2: "" = a tiny Qwen3 built on first use when the
    # Omni model is the tiny one, none otherwise (a real model never falls back to a random
    # one); "none" = no fallback (level 2 then stays text-only on the Omni model).
    fallback_model: str = ""
    ladder_min_samples: int = 5  # replies needed before the ladder judges
    ladder_window: int = 50  # latest replies the P95 is taken over

    def __post_init__(self) -> None:
        if self.ice_servers or self.turn_secret:
            # A bare TURN URL without a secret is refused here, at start-up, not at the first call.
            from agent.transport.turn_credentials import check_turn_settings

            check_turn_settings(self.ice_servers, self.turn_secret, self.turn_ttl_s)
        # The fields the model decides are resolved once, here, so that every reader (the
        # engine thread, the Realtime session defaults) sees the same concrete values.
        if None in (self.system_prompt, self.max_reply_tokens, self.max_reply_seconds, self.sampling):
            from agent.decoding import defaults_for

            d = defaults_for(self.model, self.decoding, self.seed)
            resolved = {
                "system_prompt": d.system_prompt,
                "max_reply_tokens": d.max_reply_tokens,
                "max_reply_seconds": d.max_reply_seconds,
                "sampling": d.decoding,
            }
            for name, value in resolved.items():
                if getattr(self, name) is None:
                    object.__setattr__(self, name, value)

    @property
    def engine_slots(self) -> int:
        """Session slots in the engine's static caches: every session the admission can let in."""
        return self.max_sessions + self.max_transcription_sessions

    @property
    def model_path(self) -> str:
        return self.model or str(self.cache_dir / "tiny-qwen3-omni")
