"""The `serve` command's flags (`omni-agent [serve] ...`, the Ray Serve ones included) and the
one frozen Config they make; tests and embedders build a Config the way the command line does."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from agent.config import Config


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    d = Config()
    p.add_argument("--host", default=d.host, help="address to serve HTTP on (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="HTTP port (default %(default)s)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("OMNI_AGENT_API_KEY", d.api_key),
        metavar="KEY",
        help="require this key (or an ephemeral key minted with it) on /v1/realtime routes "
        "(default: $OMNI_AGENT_API_KEY; unset = open, for loopback use)",
    )
    p.add_argument(
        "--ice-host",
        action="append",
        default=[],
        dest="ice_hosts",
        metavar="ADDR",
        help="host address ICE advertises (repeatable); default: every interface but loopback",
    )
    p.add_argument(
        "--ice-server",
        action="append",
        default=[],
        dest="ice_servers",
        type=_ice_server,
        metavar="URL[,USERNAME,CREDENTIAL]",
        help="STUN/TURN server for the agent's peers and the page (repeatable), e.g. "
        "stun:stun.example.com:3478, turn:turn.example.com:3478?transport=udp (credentials minted "
        "from --turn-secret) or turn:…,alice,s3cret (static: the agent's own, never sent to the page); default: none",
    )
    p.add_argument(
        "--turn-secret",
        default=os.environ.get("OMNI_AGENT_TURN_SECRET", d.turn_secret),
        metavar="SECRET",
        help="TURN REST shared secret (coturn's static-auth-secret): TURN URLs given without a credential "
        "get a short-lived one minted per call, for the agent and the page (default: $OMNI_AGENT_TURN_SECRET)",
    )
    p.add_argument(
        "--turn-ttl",
        type=int,
        default=d.turn_ttl_s,
        dest="turn_ttl_s",
        metavar="SECONDS",
        help="how long a minted TURN credential can open allocations (default %(default)s)",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        dest="cors_origins",
        metavar="ORIGIN",
        help="let pages from this origin call the agent (repeatable; * for any); default: none",
    )
    p.add_argument(
        "--mcp-allow",
        action="append",
        default=[],
        type=_hosts,
        dest="mcp_allow",
        metavar="HOST[:PORT][,...]",
        help="MCP servers a session's tools may name are on these hosts (repeatable); default: none, MCP tools off",
    )
    p.add_argument(
        "--mcp-timeout-s",
        type=_positive(float),
        default=d.mcp_timeout_s,
        help="time limit of one MCP tool listing or call (default %(default)s)",
    )
    p.add_argument(
        "--otlp-endpoint",
        default=d.otlp_endpoint,
        metavar="URL",
        help="send each call's trace to this OTLP/HTTP collector (e.g. http://127.0.0.1:4318); "
        "default: OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing",
    )
    p.add_argument(
        "--max-calls-per-minute",
        type=int,
        default=d.max_calls_per_minute,
        help="new calls per client address per minute, beyond that 429 (0: no limit; default %(default)s)",
    )
    p.add_argument(
        "--max-events-per-s",
        type=float,
        default=d.max_events_per_s,
        help="client events per session per second, beyond that `error` events (default %(default)s)",
    )
    p.add_argument(
        "--drain-s",
        type=float,
        default=d.drain_s,
        help="on SIGTERM/Ctrl-C, let replies in progress finish for at most this long (default %(default)s)",
    )
    p.add_argument(
        "--model",
        default=d.model,
        metavar="PATH_OR_ID",
        help="checkpoint for from_pretrained, e.g. Qwen/Qwen3-Omni-30B-A3B-Instruct; "
        "default: the tiny model, built on first use in --cache-dir",
    )
    p.add_argument(
        "--cache-dir", type=Path, default=d.cache_dir, help="where the tiny model is built (default %(default)s)"
    )
    p.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"], help="(default %(default)s)")
    p.add_argument(
        "--dtype",
        default=d.dtype,
        choices=["auto", "float32", "bfloat16"],
        help="auto: bfloat16 on cuda, float32 on cpu",
    )
    p.add_argument(
        "--quantize",
        default=d.quantize,
        choices=["", "int4"],
        help="4-bit weights, quantized after loading a float checkpoint (a quantized checkpoint from "
        "`omni-agent quantize` needs no flag, and is the way for a card the float weights do not fit)",
    )
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="run the GPU path eagerly")
    p.add_argument(
        "--cpu-graphs",
        action="store_true",
        help="on CPU, replay the engine's steps as TorchScript traces, off the GIL (experimental)",
    )
    p.add_argument(
        "--engine-process",
        default=d.engine_process,
        action=argparse.BooleanOptionalAction,
        help="run the engine in a child process, with an interpreter lock of its own (docs/load.md); "
        "--no-engine-process: a thread of the agent's process",
    )
    p.add_argument(
        "--compile",
        default=d.compile,
        choices=["auto", "on", "off"],
        help="torch.compile the per-frame steps at start-up (auto: on CUDA only; cached in --cache-dir)",
    )
    p.add_argument("--no-compile", dest="compile", action="store_const", const="off", help="same as --compile off")
    p.add_argument(
        "--compile-regions",
        default=d.compile_regions,
        action=argparse.BooleanOptionalAction,
        help="compile each decoder layer once and call it per layer: a first start that does not grow "
        "with depth (48 thinker layers), no fusion across layers (default: on CUDA; docs/running.md)",
    )
    p.add_argument(
        "--compile-per-bucket",
        default=d.compile_per_bucket,
        action="store_true",
        help="compile each step once per batch bucket, specialised to it, instead of once for all "
        "(a cold start several times as long)",
    )
    p.add_argument(
        "--compile-budget-s",
        type=float,
        default=d.compile_budget_s,
        help="seconds of compiling a start-up may spend; steps not compiled by then run eagerly, graphed "
        "(0: no limit; a step whose compile fails runs eagerly anyway)",
    )
    p.add_argument(
        "--attention",
        default=d.attention,
        choices=["auto", "sdpa", "flex", "flash"],
        help="the KV caches' attention kernel (auto: flash-attn where installed, flex on CUDA, sdpa on CPU)",
    )
    p.add_argument(
        "--runner",
        default=d.runner,
        choices=["stream", "reference"],
        help="stream: streaming engine; reference: transformers' generate() (whole reply at once)",
    )
    p.add_argument(
        "--no-video",
        dest="video",
        action="store_false",
        help="ignore the camera: frames are dropped unread and the client is asked to pause it",
    )
    p.add_argument(
        "--video-fps",
        type=_positive(float),
        default=d.video_fps,
        dest="video_fps",
        help="camera frames sampled per second; 2 make one video grid (default %(default)s)",
    )
    p.add_argument(
        "--video-window",
        type=_positive(float),
        default=d.video_window_s,
        dest="video_window_s",
        help="seconds of a turn that get every grid at full rate (default %(default)s)",
    )
    p.add_argument(
        "--video-turn-tokens",
        type=_positive(int),
        default=d.video_turn_tokens,
        dest="video_turn_tokens",
        help="visual tokens per turn at most: resolution is scaled down first, then the grid rate (default %(default)s)",
    )
    p.add_argument(
        "--system-prompt",
        default=None,
        help="default: a short prompt for the tiny model, Qwen's voice-assistant prompt for a real one",
    )
    p.add_argument(
        "--max-reply-tokens",
        type=_positive(int),
        default=None,
        help="text tokens per reply (default: the model's generation_config.json, else 1024; tiny: 48)",
    )
    p.add_argument(
        "--max-reply-seconds",
        type=_positive(float),
        default=None,
        help="audio seconds per reply (default: the model's generation config, else 60; tiny: 4)",
    )
    p.add_argument(
        "--decoding",
        default=d.decoding,
        choices=["auto", "greedy", "sample"],
        help="auto: the model's own (tiny: greedy; real: sampled as Qwen does); greedy: argmax in "
        "every stage; sample: every stage sampled (default %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="draw every reply's sampling seed from this (reproducible replies; default: fresh)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=d.threads,
        help="torch CPU threads (0: on CPU all cores but one, left to the network thread)",
    )
    p.add_argument(
        "--context-limit",
        type=_positive(int),
        default=None,
        help=f"tokens per session; when full, history is dropped, system prompt kept (default: "
        f"{d.context_limit}, lowered on a GPU that would hold fewer than 2 sessions of it; docs/memory.md)",
    )
    p.add_argument(
        "--audio-window",
        type=float,
        default=d.audio_window_s,
        dest="audio_window_s",
        help="audio encoder attention window in seconds, 1..8 (default %(default)s)",
    )
    p.add_argument("--vad-silence-ms", type=int, default=d.vad_silence_ms, help="silence that ends a turn")
    p.add_argument(
        "--turn-model",
        default=d.turn_model,
        help="semantic_vad's end-of-turn model (Smart Turn v3.2 ONNX): a path, off (silence alone), or "
        "left out for the one `omni-agent fetch-turn-model` keeps in --cache-dir",
    )
    p.add_argument("--vad-aggressiveness", type=int, default=d.vad_aggressiveness, choices=[0, 1, 2, 3])
    p.add_argument(
        "--vad",
        default=d.vad,
        choices=["silero", "webrtc"],
        help="voice detector: silero (ONNX, one thread) or webrtc (webrtcvad) (default %(default)s)",
    )
    p.add_argument(
        "--vad-threshold",
        type=float,
        default=d.vad_threshold,
        help="silero speech probability threshold (default %(default)s)",
    )
    p.add_argument(
        "--barge-in-ms",
        type=int,
        default=d.barge_in_ms,
        help="voiced audio needed to interrupt the agent while it speaks (default %(default)s)",
    )
    p.add_argument(
        "--barge-in-gap-ms",
        type=int,
        default=d.barge_in_gap_ms,
        help="an unvoiced gap this long ends a barge-in candidate (default %(default)s)",
    )
    p.add_argument(
        "--echo-margin-db",
        type=float,
        default=d.echo_margin_db,
        help="while the agent speaks, a barge-in must be louder than its played level plus this "
        "(default %(default)s dB)",
    )
    p.add_argument(
        "--no-echo-guard",
        dest="echo_guard",
        action="store_false",
        help="do not raise the barge-in threshold by the level the agent plays (duration rule only)",
    )
    p.add_argument(
        "--no-barge-in-pause",
        dest="barge_in_pause",
        action="store_false",
        help="do not pause the agent's voice on a likely barge-in before it is confirmed "
        "(--barge-in-ms); with it, a false alarm resumes where it paused",
    )
    p.add_argument(
        "--barge-in-pause-max-ms",
        type=int,
        default=d.barge_in_pause_max_ms,
        help="an unconfirmed barge-in pause resumes after this long (default %(default)s)",
    )
    p.add_argument(
        "--no-speculative-start",
        dest="speculative_start",
        action="store_false",
        help="do not start replies on short pauses (speculatively, held until the turn ends)",
    )
    p.add_argument(
        "--speculation-pause-ms",
        type=int,
        default=d.speculation_pause_ms,
        help="unvoiced audio inside a turn after which a reply starts speculatively (the earliest,"
        " with the pause learned per session)",
    )
    p.add_argument(
        "--no-adaptive-speculation",
        dest="speculation_adaptive",
        action="store_false",
        help="speculate at every pause of --speculation-pause-ms instead of learning per session"
        " the pause length after which speakers rarely go on",
    )
    p.add_argument(
        "--max-sessions",
        type=_positive(int),
        default=None,
        help=f"offers beyond this get 503 (default: as many as the GPU's free memory holds at the "
        f"context limit, at most {d.max_sessions}; {d.max_sessions} on CPU; docs/memory.md)",
    )
    p.add_argument(
        "--high-priority-slots",
        type=int,
        default=d.high_priority_slots,
        help="of --max-sessions, slots kept for priority=high sessions (default %(default)s)",
    )
    p.add_argument(
        "--max-transcription-sessions",
        type=_at_least_zero,
        default=d.max_transcription_sessions,
        help="transcription (captions-only) sessions admitted on their own limit, beyond --max-sessions "
        "(default %(default)s: they count against --max-sessions)",
    )
    p.add_argument(
        "--memory-reserve-gib",
        type=float,
        default=d.memory_reserve_gib,
        help="GPU memory the plan keeps for activations, graph pools and workspaces (default %(default)s: "
        "1.16 GiB measured at 8 sessions on an H200, with margin); lower it on a 24 GB card at your own risk "
        "(docs/quantization.md)",
    )
    p.add_argument(
        "--connect-timeout-s",
        type=float,
        default=d.connect_timeout_s,
        help="close a call whose peer has not connected this long after its answer was sent (frees its slot); "
        "the answer itself waits at most this long for the engine to open the session",
    )
    p.add_argument("--max-turns-per-s", type=float, default=d.max_turns_per_s, help="turn rate limit per engine")
    p.add_argument(
        "--text-only-p95-ms",
        type=float,
        default=d.text_only_p95_ms,
        help="P95 first-response latency above which new replies are text-only",
    )
    p.add_argument(
        "--fallback-p95-ms",
        type=float,
        default=d.fallback_p95_ms,
        help="P95 above which replies come from the fallback model",
    )
    p.add_argument(
        "--speculation-p95-ms",
        type=float,
        default=d.speculation_p95_ms,
        help="P95 above which speculative starts stop (the ladder's first rung)",
    )
    p.add_argument(
        "--ladder-margin-ms",
        type=float,
        default=d.ladder_margin_ms,
        help="step back down only under threshold minus this ...",
    )
    p.add_argument("--ladder-recover-s", type=float, default=d.ladder_recover_s, help="... held this long")
    p.add_argument(
        "--fallback-model",
        default=d.fallback_model,
        metavar="PATH_OR_ID|none",
        help="text-only model for the last ladder level (default: a tiny Qwen3; e.g. Qwen/Qwen3-8B)",
    )
    p.add_argument("--log-level", default="INFO")
    from agent.serve.options import add_serve_flags  # no Ray import: only the flags

    add_serve_flags(p)


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def _at_least_zero(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _hosts(text: str) -> tuple[str, ...]:
    """A comma-separated list of hosts or host:port pairs, lower-cased."""
    hosts = tuple(h.strip().lower() for h in text.split(",") if h.strip())
    if not hosts or any("/" in h or "@" in h or " " in h for h in hosts):
        raise argparse.ArgumentTypeError(f"host or host:port names, comma-separated; got {text!r}")
    return hosts


def _ice_server(text: str):
    from agent.transport.ice import parse_ice_server

    try:
        return parse_ice_server(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def config_from_args(ns: argparse.Namespace) -> Config:
    fields = set(Config.__dataclass_fields__)
    values = {k: v for k, v in vars(ns).items() if k in fields}
    for name in ("ice_hosts", "ice_servers", "cors_origins"):
        values[name] = tuple(values.get(name) or ())
    values["mcp_allow"] = tuple(host for hosts in values.get("mcp_allow") or () for host in hosts)
    # Limits left out are sized from the GPU's memory at start-up (agent/engine/memory_plan.py).
    sized = tuple(name for name in ("max_sessions", "context_limit") if values.get(name, 0) is None)
    for name in sized:
        del values[name]
    return Config(**values, sized_from_memory=sized)
