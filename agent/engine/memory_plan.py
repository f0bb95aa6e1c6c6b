"""How many sessions, of how many tokens, the GPU holds beside the model (docs/memory.md).

The engine's device memory is fixed at start-up: the weights, then every session slot's static
KV caches reserved at the context limit (CUDA graphs hold their addresses), then what the steps
need while they run. So

    weights + rows x kv_per_slot(context) + reserve  <=  free device memory before the load

where `rows` is every session slot (--max-sessions plus --max-transcription-sessions) plus the
graphs' pad row where some batch is padded (agent/engine/compile/wiring.py: padded batch rows write
into a scratch row of every cache; with one or two slots every batch is a bucket and there is
none), and `kv_per_slot(context)` is one row of the thinker's cache (context tokens), the
talker's (context + a reply's frames + 16: agent/engine/runner/streaming.py's talker limit), code2wav's
per-slot ring and conv state. The code predictor's cache is one batch bucket of 17 tokens,
counted once.

Limits the command line left out (`Config.sized_from_memory`) are derived from this on CUDA;
given ones are only checked, and a plan that cannot fit is refused before the model is loaded,
naming the flag to lower and by how much. On the CPU nothing is derived: the defaults stand.

Where: `size_limits(config)` runs before the engine and the HTTP app are built (agent/__main__.py
`serve`, a Ray replica's start), on the main thread before the event loop runs (a Ray replica
runs it in a worker thread). It reads the checkpoint's config.json (weights counted on the meta
device: nothing is loaded) and the GPU's free memory through NVML, less the engine's CUDA context
still to come (`engine_free`, agent/engine/free_memory.py: no CUDA context is made in this process, whose memory the engine's
child process could not use), and returns the Config with the resolved numbers, so admission
(agent/transport/http.py, `config.max_sessions`), the engine inbox and the engine's caches
(`config.engine_slots`, `config.context_limit`) all read the same ones. After the load the engine
compares the plan with what is really free (`check_after_load`, in the engine's process).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from agent.engine.free_memory import engine_free
from agent.engine.model_memory import Card, GiB, KiB, ModelMemory

if TYPE_CHECKING:
    from agent.config import Config
    from agent.engine.checkpoints.model import LoadedModel

log = logging.getLogger(__name__)

# Device memory kept free for what runs beside weights and caches: prefill activations (at most
# 256 tokens a tick, the LM head on the last position only), the encoders' activations for a
# turn's audio and frames, the CUDA graph pools and inductor's buffers of every batch bucket,
# cuBLAS workspaces and the caching allocator's rounding. Measured once: 1.16 GiB beyond weights
# and KV at 8 sessions on an H200, graphs on, steps not compiled (99.6 GiB peak,
# bench/results/engine-h200-2026-11-30.txt); the compiled steps' buffers are not measured yet.
RESERVE_BYTES = 3 * GiB
DEFAULT_SESSIONS = 8  # Config().max_sessions: the cap on derived sessions
DEFAULT_CONTEXT = 32768  # Config().context_limit: the derived context's ceiling
MIN_SESSIONS = 2  # the plan lowers the context before it goes under this many sessions ...
MIN_CONTEXT = 8192  # ... but not under this many tokens
CONTEXT_STEP = 1024  # the granularity of the longest context a refusal suggests
# Derived contexts round down to a tier (powers of two from this one, and each one's 1.5x: 4096,
# 6144, 8192, 12288, 16384, 24576, 32768, ...): the context is a compiled shape, part of the compile
# cache's key, so a start with a little less free memory (another process, a driver update) must
# derive the same context as the last one, or it compiles cold.
CONTEXT_TIER_BASE = 4096
LIMITS = ("max_sessions", "context_limit")


def context_tier(tokens: int) -> int:
    """The largest context tier at or under `tokens`: CONTEXT_TIER_BASE x 2**k or 1.5 x that
    (0 under CONTEXT_TIER_BASE)."""
    tier, power = 0, CONTEXT_TIER_BASE
    while power <= tokens:
        tier = power * 3 // 2 if power * 3 // 2 <= tokens else power
        power *= 2
    return tier


def pad_rows(slots: int) -> int:
    """The graphs' scratch row of every KV cache for `slots` slots (0 or 1), by the engine's own
    rule and default buckets (counted also when graphs are off)."""
    from agent.engine.compile.wiring import GraphConfig, batch_buckets, needs_pad_row

    return int(needs_pad_row(batch_buckets(GraphConfig().batch_sizes, slots), slots))


class MemoryPlanError(ValueError):
    """The limits asked for (or the model alone) do not fit the device's free memory."""


@dataclass(frozen=True)
class MemoryPlan:
    sessions: int  # --max-sessions
    context: int  # --context-limit
    transcription: int  # --max-transcription-sessions: slots of their own
    memory: ModelMemory
    free: int | None  # device memory free before the load; None: not a GPU, nothing derived
    reserve: int
    derived: tuple[str, ...]  # which of LIMITS the plan chose
    device: str = "cuda"

    @property
    def rows(self) -> int:
        """Rows of every slot cache: each session slot and the pad row, if any."""
        return self.sessions + self.transcription + self.pad_rows

    @property
    def pad_rows(self) -> int:
        return pad_rows(self.sessions + self.transcription)

    @property
    def kv(self) -> int:
        return self.rows * self.memory.kv_per_slot(self.context) + self.memory.fixed_state

    @property
    def weights(self) -> int:
        """Everything weight-shaped: parameters and buffers, the predictor's fused copies, and a
        4-bit model's unpacked expert stack during a prefill."""
        return self.memory.weights + self.memory.engine_weights + self.memory.unpacked_experts

    @property
    def need(self) -> int:
        return self.weights + self.kv + self.reserve

    def describe(self) -> str:
        """The start-up log block."""
        m = self.memory
        free = "not derived (CPU)" if self.free is None else f"{_gib(self.free)} free before the load"
        derived = ", ".join(f"--{name.replace('_', '-')}" for name in self.derived) or "none"
        return "\n".join(
            [
                f"memory plan ({self.device}, {m.dtype}): {free}",
                (
                    f"  weights          {_gib(self.weights)} (parameters and buffers {_gib(m.weights)}, the code "
                    f"predictor's fused projections {_gib(m.engine_weights)}"
                    + (f", a prefill's unpacked experts {_gib(m.unpacked_experts)}" if m.unpacked_experts else "")
                    + ")"
                ),
                (
                    f"  KV per session   {_gib(m.kv_per_slot(self.context))} at {self.context} tokens (a token: thinker "
                    f"{m.thinker_kv_token / KiB:.0f} KiB + talker {m.talker_kv_token / KiB:.0f} KiB)"
                ),
                (
                    f"  KV, all slots    {_gib(self.kv)} ({self.rows} rows: {self.sessions} sessions + {self.transcription} "
                    f"transcription + {self.pad_rows} pad)"
                ),
                f"  reserve          {_gib(self.reserve)} (activations, graph pools, workspaces)",
                f"  needed           {_gib(self.need)}" + ("" if self.free is None else f" of {_gib(self.free)}"),
                f"  sessions x context  {self.sessions} x {self.context} tokens (sized from memory: {derived})",
            ]
        )

    def export(self) -> None:
        """Publish the plan on /metrics."""
        from agent import metrics

        parts = {"weights": self.weights, "kv": self.kv, "reserve": self.reserve}
        if self.free is not None:
            parts["free"] = self.free
        for part, value in parts.items():
            metrics.MEMORY_PLAN_BYTES.labels(part=part).set(value)
        metrics.MEMORY_PLAN_SESSIONS.set(self.sessions)
        metrics.MEMORY_PLAN_CONTEXT.set(self.context)


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if abs(n) >= GiB else f"{n / 2**20:.0f} MiB"


def plan(
    memory: ModelMemory,
    free: int | None,
    *,
    sessions: int | None = None,
    context: int | None = None,
    transcription: int = 0,
    reserve: int = RESERVE_BYTES,
    cap: int = DEFAULT_SESSIONS,
    default_context: int = DEFAULT_CONTEXT,
    device: str = "cuda",
) -> MemoryPlan:
    """Sessions and context for `free` bytes of device memory. `sessions`/`context` None: derive
    them; given: check them. `free` None (the CPU): nothing is derived or refused (the defaults).

    Derived: as many sessions (at most `cap`) as fit at `default_context`; if that is under
    MIN_SESSIONS, the longest context (a tier of `context_tier`, at least MIN_CONTEXT, at most
    `default_context`) at which MIN_SESSIONS fit, else one session. Raises MemoryPlanError when
    nothing fits."""
    derived = tuple(name for name, value in zip(LIMITS, (sessions, context)) if value is None)
    if free is None:
        return MemoryPlan(sessions or cap, context or default_context, transcription, memory, None, reserve, (), "cpu")
    budget = free - memory.fixed - reserve  # for the slot caches

    def rows(n: int) -> int:
        return n + transcription + pad_rows(n + transcription)

    def most_sessions(ctx: int) -> int:
        if budget <= 0:
            return 0
        fit = budget // memory.kv_per_slot(ctx)  # rows that fit
        unpadded = fit - transcription  # every row a session's: only where no batch is padded
        if unpadded >= 1 and pad_rows(fit) == 0:
            return unpadded
        return max(0, fit - transcription - 1)

    def longest_context(n: int) -> int:
        """The longest context at which `n` sessions fit, in CONTEXT_STEPs: what a refusal
        suggests for --context-limit (a given limit is the user's shape, not tiered)."""
        per_row = budget // rows(n) - memory.slot_state - memory.talker_kv_token * memory.talker_extra_tokens
        return max(0, per_row // (memory.thinker_kv_token + memory.talker_kv_token) // CONTEXT_STEP * CONTEXT_STEP)

    def derived_context(n: int) -> int:
        """The context the plan chooses for `n` sessions: the longest that fits, down to its
        tier, at most `default_context` (which stands as given when it fits)."""
        return min(default_context, context_tier(longest_context(n)))

    def made(n: int, ctx: int) -> MemoryPlan:
        return MemoryPlan(n, ctx, transcription, memory, free, reserve, derived, device)

    if budget <= 0:
        raise MemoryPlanError(
            f"the model alone needs {_gib(memory.fixed + reserve)} (weights "
            f"{_gib(memory.weights + memory.engine_weights)} and a {_gib(reserve)} reserve) and {_gib(free)} is free: "
            "no --max-sessions or --context-limit fits on this GPU; use one with more memory"
        )
    if sessions is not None and context is not None:
        if rows(sessions) * memory.kv_per_slot(context) <= budget:
            return made(sessions, context)
        raise MemoryPlanError(_too_big(made(sessions, context), most_sessions(context), longest_context(sessions)))
    if sessions is not None:  # the context is derived for the sessions asked for
        ctx = derived_context(sessions)
        if ctx >= MIN_CONTEXT:
            return made(sessions, ctx)
        raise MemoryPlanError(
            _too_big(
                made(sessions, MIN_CONTEXT),
                most_sessions(MIN_CONTEXT),
                other=f"give a --context-limit under {MIN_CONTEXT}",
            )
        )
    if context is not None:  # the sessions are derived for the context asked for
        n = min(cap, most_sessions(context))
        if n >= 1:
            return made(n, context)
        raise MemoryPlanError(_too_big(made(1, context), context=longest_context(1)))
    n = min(cap, most_sessions(default_context))
    if n >= MIN_SESSIONS:
        return made(n, default_context)
    for want in (MIN_SESSIONS, 1):
        ctx = derived_context(want)
        if ctx >= MIN_CONTEXT:
            return made(min(cap, most_sessions(ctx)), ctx)
    raise MemoryPlanError(_too_big(made(1, MIN_CONTEXT), other="use a GPU with more memory"))


def _too_big(asked: MemoryPlan, sessions: int = 0, context: int = 0, other: str = "") -> str:
    """The refusal: what was asked, what it needs, what is free, and the flags that would fit."""
    flags = ([f"--max-sessions to {sessions}"] if sessions >= 1 else []) + (
        [f"--context-limit to {context}"] if context >= CONTEXT_STEP else []
    )
    remedies = (["lower " + " or ".join(flags)] if flags else []) + ([other] if other else [])
    noun = "session" if asked.sessions == 1 else "sessions"
    return (
        f"{asked.sessions} {noun} x {asked.context} tokens need {_gib(asked.need)} (weights {_gib(asked.weights)}, "
        f"KV {_gib(asked.kv)}, reserve {_gib(asked.reserve)}); {_gib(asked.free or 0)} free: "
        + (", or ".join(remedies) if remedies else "nothing fits")
    )


def size_limits(config: Config) -> tuple[Config, MemoryPlan]:
    """The Config with --max-sessions / --context-limit resolved for this machine, and the plan
    (logged and exported). Raises MemoryPlanError when the limits cannot fit. Makes no CUDA
    context where NVML is installed (`engine_free`)."""
    from transformers import AutoConfig

    from agent.engine.checkpoints.model import complete_config, resolve_device, resolve_dtype
    from agent.engine.checkpoints.tiny import ensure_model

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    model_config = AutoConfig.from_pretrained(ensure_model(config))
    complete_config(model_config)
    memory = ModelMemory.from_config(model_config, dtype, config.max_reply_seconds or 60.0, config.quantize)
    free = engine_free(device, config.engine_process) if device.type == "cuda" else None
    given = {name: (None if name in config.sized_from_memory else getattr(config, name)) for name in LIMITS}
    # A derived limit's Config value (the default) is its cap: at most 8 sessions, 32768 tokens.
    result = plan(
        memory,
        free,
        sessions=given["max_sessions"],
        context=given["context_limit"],
        transcription=config.max_transcription_sessions,
        cap=config.max_sessions,
        default_context=config.context_limit,
        device=str(device),
        reserve=int(config.memory_reserve_gib * GiB),
    )
    log.info("%s", result.describe())
    if free is not None and config.fallback_model not in ("", "none"):
        log.warning(
            "the plan does not count --fallback-model %s: its weights share the GPU's reserve", config.fallback_model
        )
    result.export()
    return replace(config, max_sessions=result.sessions, context_limit=result.context), result


def check_after_load(loaded: LoadedModel, config: Config) -> None:
    """Once the weights are on the GPU: warn when less is free than the plan counted on for the
    caches and the reserve (another process took memory, or the plan's count was off)."""
    import torch

    if loaded.device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(loaded.device)
    free += torch.cuda.memory_reserved(loaded.device) - torch.cuda.memory_allocated(loaded.device)
    memory = ModelMemory.of_model(loaded.model, config.max_reply_seconds or 60.0)
    wanted = plan(
        memory,
        None,
        sessions=config.max_sessions,
        context=config.context_limit,
        transcription=config.max_transcription_sessions,
    )
    need = wanted.kv + int(config.memory_reserve_gib * GiB) + memory.engine_weights + memory.unpacked_experts
    if free < need:
        log.warning(
            "after the load %s is free on %s, the plan needs %s for %d sessions x %d tokens and the reserve: "
            "lower --max-sessions or --context-limit if the caches do not fit",
            _gib(free),
            loaded.device,
            _gib(need),
            config.max_sessions,
            config.context_limit,
        )


def plan_for_cards(memory: ModelMemory, cards: Sequence[Card]) -> dict[str, MemoryPlan | MemoryPlanError]:
    """The default plan (nothing given) on each card: what the benchmark prints."""
    out: dict[str, MemoryPlan | MemoryPlanError] = {}
    for card in cards:
        try:
            out[card.name] = plan(memory, card.free)
        except MemoryPlanError as exc:
            out[card.name] = exc
    return out
