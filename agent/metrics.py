"""Prometheus metrics: the one module-level registry the project allows.

Names follow the latency words of docs/benchmarks.md: TTFT and TTFA are measured from end of turn.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from agent.thread_cpu import ThreadCpuCollector

REGISTRY = CollectorRegistry(auto_describe=True)
REGISTRY.register(ThreadCpuCollector())  # agent_thread_cpu_seconds_total{thread=...}
# The standard process_* (resident memory, CPU, open descriptors), python_gc_* and python_info
# series that operators' dashboards look for; a registry of our own has none unless told.
for _collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
    REGISTRY.register(_collector)

# Latency buckets dense around the 100-500 ms band we care about.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0)
_STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# `priority`: the session's class (agent/gate/priority.py), high or normal.
TTFT = Histogram(
    "agent_time_to_first_token_seconds",
    "End of turn to first text token",
    ["priority"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
TTFA = Histogram(
    "agent_time_to_first_audio_seconds",
    "End of turn to first audio frame handed to the outbound track",
    ["priority"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
STAGE = Histogram(
    "agent_stage_seconds",
    "Time per engine stage (per call, or per frame for per-frame stages)",
    ["stage"],
    buckets=_STAGE_BUCKETS,
    registry=REGISTRY,
)
ENGINE_SECONDS = Counter(
    "agent_engine_seconds",
    "Engine thread time by stage (a batched call counted once, not once per session)",
    ["stage"],
    registry=REGISTRY,
)
ENGINE_CALLS = Counter(
    "agent_engine_calls",
    "Engine calls by stage; agent_stage_seconds_count over this is the mean rows (sessions) per call",
    ["stage"],
    registry=REGISTRY,
)
SESSIONS_ACTIVE = Gauge("agent_sessions_active", "Connected sessions", ["priority"], registry=REGISTRY)
TRANSCRIPTION_SESSIONS_ACTIVE = Gauge(
    "agent_transcription_sessions_active",
    "Connected transcription (captions-only) sessions, also counted in agent_sessions_active",
    registry=REGISTRY,
)
INGEST_BUFFER = Gauge("agent_ingest_buffer_frames", "Frames waiting in the ingest ring", ["kind"], registry=REGISTRY)
INGEST_DROPPED = Counter(
    "agent_ingest_dropped_frames_total", "Frames dropped by ingest", ["kind", "reason"], registry=REGISTRY
)
PLAYOUT_BUFFER = Gauge("agent_playout_buffer_seconds", "Audio queued on outbound tracks", registry=REGISTRY)
PLAYOUT_UNDERRUNS = Counter(
    "agent_playout_underruns_total",
    "20 ms frames sent as silence while a reply was still playing",
    registry=REGISTRY,
)
DTLS_FIRST_FLIGHT_RESENDS = Counter(
    "agent_dtls_first_flight_resends_total",
    "ClientHellos sent again early (100-700 ms) because the peer had answered nothing yet: a peer "
    "whose DTLS starts after its ICE drops the first (agent/transport/dtls_flight.py)",
    registry=REGISTRY,
)
BARGE_IN_PAUSES = Counter(
    "agent_barge_in_pauses_total",
    "Outbound audio paused on a barge-in candidate, by how the pause ended: flushed (confirmed), "
    "resumed (the candidate died), expired (no confirmation within the bound)",
    ["outcome"],
    registry=REGISTRY,
)
TURN_JUDGE_SECONDS = Histogram(
    "agent_turn_judge_seconds",
    "One end-of-turn judgment (Smart Turn v3.2 on the turn's last 8 s) on the judge's thread",
    buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.12, 0.2, 0.5),
    registry=REGISTRY,
)
TURN_JUDGMENTS = Counter(
    "agent_turn_judgments_total",
    "Pauses judged for semantic_vad, by verdict: complete (P >= 0.5), incomplete, failed",
    ["verdict"],
    registry=REGISTRY,
)
OFFERS_REJECTED = Counter("agent_offers_rejected_total", "Offers refused", ["reason"], registry=REGISTRY)
DEGRADATION_LEVEL = Gauge(
    "agent_degradation_level", "0 audio replies, 1 text-only, 2 fallback model", registry=REGISTRY
)
GPU_UTILIZATION = Gauge(
    "agent_gpu_utilization_ratio",
    "Busy ratio, from NVML, of the GPU this process uses (the first of CUDA_VISIBLE_DEVICES; absent without a GPU)",
    registry=REGISTRY,
)
GPU_MEMORY_USED = Gauge(
    "agent_gpu_memory_used_bytes",
    "Memory in use on the GPU this process uses (every process on it), from NVML",
    registry=REGISTRY,
)
GPU_INFO = Gauge(
    "agent_gpu_info",
    "1 for the GPU this process uses: its NVML uuid and index; replicas that report the same uuid share one GPU",
    ["uuid", "index"],
    registry=REGISTRY,
)
VIDEO_THROTTLE_EVENTS = Counter(
    "agent_video_throttle_events_total",
    "input_video.throttle events sent, by the state the sender is asked into (throttled, paused, open)",
    ["state"],
    registry=REGISTRY,
)
VIDEO_THROTTLED_SECONDS = Counter(
    "agent_video_throttled_seconds_total", "Time video senders spent throttled or paused", registry=REGISTRY
)
TURNS_REJECTED = Counter("agent_turns_rejected_total", "Turns refused by the turn rate limit", registry=REGISTRY)
ENGINE_INBOX = Gauge("agent_engine_inbox_depth", "Requests waiting for the engine thread", registry=REGISTRY)
TURNS = Counter("agent_turns_total", "Turns sent to the engine", registry=REGISTRY)
ERRORS = Counter("agent_errors_total", "Errors reported to clients", ["where"], registry=REGISTRY)
SPECULATIONS = Counter(
    "agent_speculative_replies_total",
    "Replies started speculatively on a short pause, by outcome: started, committed_held (its first "
    "frame was ready), committed_prefilling, discarded",
    ["outcome"],
    registry=REGISTRY,
)

# The start-up memory plan (agent/engine/memory_plan.py, docs/memory.md), set once it is made.
MEMORY_PLAN_BYTES = Gauge(
    "agent_memory_plan_bytes",
    "Device memory the start-up plan counts, by part: weights, kv (every session slot's caches at the "
    "context limit), reserve (activations, graph pools, workspaces), free (free before the load; GPU only)",
    ["part"],
    registry=REGISTRY,
)
MEMORY_PLAN_SESSIONS = Gauge(
    "agent_memory_plan_sessions", "Sessions the memory plan admits (--max-sessions)", registry=REGISTRY
)
MEMORY_PLAN_CONTEXT = Gauge(
    "agent_memory_plan_context_tokens", "Tokens per session the caches hold (--context-limit)", registry=REGISTRY
)

# The engine's start-up (agent/engine/startup.py): each phase's seconds, set as it finishes.
STARTUP_SECONDS = Gauge(
    "agent_startup_seconds",
    "Seconds each start-up phase took: plan, load, build (compiles and graph capture included), "
    "compile:<step> (one per compiled step, inside build), fallback, ready (engine start to serving)",
    ["phase"],
    registry=REGISTRY,
)

for _priority in ("high", "normal"):  # both classes are exported from the start, at zero
    TTFT.labels(priority=_priority)
    TTFA.labels(priority=_priority)
    SESSIONS_ACTIVE.labels(priority=_priority)
for _outcome in ("flushed", "resumed", "expired"):
    BARGE_IN_PAUSES.labels(outcome=_outcome)
for _verdict in ("complete", "incomplete", "failed"):
    TURN_JUDGMENTS.labels(verdict=_verdict)


def render() -> bytes:
    """Prometheus text exposition of the registry."""
    return generate_latest(REGISTRY)


def visible_gpu(environ: Mapping[str, str]) -> str | int:
    """The GPU CUDA gives this process as device 0, as NVML names it: the first entry of
    CUDA_VISIBLE_DEVICES, a uuid ("GPU-…", "MIG-…") or an index (Ray and most launchers write
    indices in NVML's order, the PCI bus order nvidia-smi shows), or index 0 when it is unset."""
    first = environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if not first:
        return 0
    return int(first) if first.isdigit() else first


class GpuSampler:
    """Reads the utilisation and memory of this process's GPU through NVML (nvidia-ml-py) when a
    GPU and the package exist: the device named by CUDA_VISIBLE_DEVICES, not NVML's device 0, so
    replicas on one multi-GPU host each report their own. `nvml`: the module (a fake in tests)."""

    def __init__(self, nvml: Any = None, environ: Mapping[str, str] | None = None) -> None:
        self._handle = None
        self.unavailable = ""
        try:
            if nvml is None:
                import pynvml as nvml  # optional: the `gpu` extra

            nvml.nvmlInit()
            gpu = visible_gpu(os.environ if environ is None else environ)
            if isinstance(gpu, int):
                self._handle = nvml.nvmlDeviceGetHandleByIndex(gpu)
            else:
                self._handle = nvml.nvmlDeviceGetHandleByUUID(gpu)
            self._nvml = nvml
            uuid = nvml.nvmlDeviceGetUUID(self._handle)
            self.uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            self.index = int(nvml.nvmlDeviceGetIndex(self._handle))
            GPU_INFO.labels(uuid=self.uuid, index=str(self.index)).set(1)
        except (ImportError, OSError, RuntimeError) as exc:  # no package / no driver / no device
            self._handle = None
            self.unavailable = str(exc) or type(exc).__name__
        except Exception as exc:  # pynvml.NVMLError has no common base we can import without pynvml
            self._handle = None
            self.unavailable = str(exc) or type(exc).__name__

    def sample(self) -> None:
        if self._handle is not None:
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            GPU_UTILIZATION.set(util.gpu / 100.0)
            GPU_MEMORY_USED.set(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)


# OpenTelemetry export (agent/telemetry/otlp.py): spans handed to the collector, and those lost
# because the bounded queue was full (a slow or absent collector) or an export failed.
TRACE_SPANS = Counter(
    "agent_trace_spans",
    "Trace spans by outcome: exported, dropped_queue_full, dropped_export_failed",
    ["outcome"],
    registry=REGISTRY,
)
