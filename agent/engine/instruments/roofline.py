"""Bytes an engine tick reads at real size, and the time model that turns bytes and kernels
into a *predicted* GPU time (a model, not a measurement; docs/engine-roofline.md).

    time = bytes / (efficiency x bandwidth) + kernels x per_kernel

Bytes come from the tensors of a meta-device model (nothing allocated) as the engine holds
them (`nbytes`): a float weight is its elements x the engine's element size, a 4-bit one
(agent/engine/quant) its packed bytes, nibbles and per-group scales and offsets. Every weight a
stage touches is read once per call (a batched call reads a weight once for all its rows), the
MoE experts at their expected spread, and the KV cache (always in the engine's dtype) at a
stated context length. Activations, logits and conv states are left out (small next to these
at decode; the model says so rather than guessing them).

MoE spread: a token picks k of E experts; with routing taken as uniform, B tokens touch
E x (1 - (1 - k/E)^B) distinct experts on average, so batch 1 reads k experts per layer and a
long prefill nearly all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from agent.engine.quant.modules import Int4Embedding, Int4Experts, Int4Linear

CODEC_FRAME_S = 0.080  # audio one tick produces per session


@dataclass(frozen=True)
class DeviceModel:
    name: str
    bandwidth: float  # bytes/s, peak HBM
    efficiency: float  # fraction of peak a decode kernel reaches
    per_kernel_s: float  # launch + tail cost per kernel, graph-replayed

    def seconds(self, nbytes: float, kernels: float) -> float:
        return nbytes / (self.efficiency * self.bandwidth) + kernels * self.per_kernel_s


H200 = DeviceModel("H200", bandwidth=4.8e12, efficiency=0.6, per_kernel_s=4e-6)


def expected_experts(tokens: int, top_k: int, experts: int) -> float:
    """Expected distinct experts hit by `tokens` tokens each routed to top_k of `experts`."""
    if tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def nbytes(module: nn.Module | None, element: int = 2) -> int:
    """Bytes of a module's weights as the engine holds them, whatever dtype a meta model was
    built in: floating parameters at `element` bytes each (the engine's dtype), and the packed
    buffers of its 4-bit modules: nibbles one byte per two weights, scales and offsets at
    `element` bytes (they are kept in the model's dtype). Other buffers (RoPE tables, code
    offsets) are left out, as they always were."""
    if module is None:
        return 0
    total = sum(p.numel() * (element if p.is_floating_point() else p.element_size()) for p in module.parameters())
    for m in module.modules():
        if isinstance(m, (Int4Linear, Int4Experts, Int4Embedding)):
            for b in m.buffers(recurse=False):
                total += b.numel() * (element if b.is_floating_point() else b.element_size())
    return total


def _routed_experts(mlp: nn.Module | None) -> nn.Module | None:
    """A MoE layer's expert stack (dense or 4-bit), without reading a 4-bit stack's float weight."""
    routed = getattr(mlp, "experts", None)
    if isinstance(routed, Int4Experts):
        return routed
    if routed is not None and isinstance(getattr(routed, "gate_up_proj", None), nn.Parameter):
        return routed
    return None


@dataclass(frozen=True)
class Decoder:
    """One MoE/dense decoder stack's byte-relevant sizes: weights in bytes as held (`nbytes`),
    the KV cache in elements (its element size is the engine's dtype's)."""

    layers: int
    dense_per_layer: float  # bytes: attention, norms, router, shared expert: read every call
    expert: float  # bytes of one routed expert's weights (0 for a dense stack)
    experts: int
    top_k: int
    kv_per_token: int  # K and V elements per token, all layers
    head: int  # bytes: final norm and output head, read once per call
    embed_row: int  # bytes of one input embedding row (embeddings are never quantized)

    @classmethod
    def of(cls, body: nn.Module, head: int, element: int = 2) -> "Decoder":
        """`head`: the output head's bytes (`nbytes`); `element`: the engine's element size."""
        layers = list(body.layers)
        dense, expert, experts, top_k = 0.0, 0.0, 0, 0
        for layer in layers:
            mlp = getattr(layer, "mlp", None)
            routed = _routed_experts(mlp)
            if routed is not None:
                experts = int(getattr(routed, "num_experts", 0) or routed.gate_up_proj.shape[0])
                expert += nbytes(routed, element) / experts
                top_k = int(getattr(mlp.gate, "top_k", 0) or body.config.num_experts_per_tok)
                dense += nbytes(layer, element) - nbytes(routed, element)
            else:
                dense += nbytes(layer, element)
        n = max(len(layers), 1)
        config = body.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        norm = nbytes(getattr(body, "norm", None), element)
        return cls(
            layers=len(layers),
            dense_per_layer=dense / n,
            expert=expert / n,
            experts=experts,
            top_k=top_k,
            kv_per_token=2 * len(layers) * config.num_key_value_heads * head_dim,
            head=norm + head,
            embed_row=config.hidden_size * element,
        )

    def weights(self, tokens: int) -> float:
        """Weight bytes one call over `tokens` tokens reads (experts at their spread)."""
        spread = expected_experts(tokens, self.top_k, self.experts) if self.experts else 0.0
        return self.layers * (self.dense_per_layer + spread * self.expert) + self.head + tokens * self.embed_row


@dataclass(frozen=True)
class ByteModel:
    """Bytes per stage at real size. Weights are in bytes as held (`nbytes`: a 4-bit module's
    packed bytes, a float one its elements x `element`); KV sizes are in elements, and `element`
    is the engine's element size (the caches' and the float weights')."""

    thinker: Decoder
    talker: Decoder
    text_projection: int  # bytes
    predictor_layers: int  # bytes of one code-predictor step's body (all its layers and norm)
    predictor_head: int  # bytes of one of its 15 heads
    predictor_kv_per_token: int  # elements
    num_groups: int
    code2wav: int  # bytes of every code2wav weight but the code table (rows only)
    code2wav_kv_per_token: int  # elements
    code2wav_window: int
    audio_encoder: int  # bytes
    element: int = 2

    @classmethod
    def of(cls, model: nn.Module, element: int = 2) -> "ByteModel":
        """From a (meta-device) Qwen3OmniMoeForConditionalGeneration at full depth, float or
        quantized (agent/engine/quant/apply.py `quantize_model`)."""
        thinker, talker = model.thinker, model.talker
        predictor = talker.code_predictor
        c2w = model.code2wav
        c2w_cfg = c2w.config
        cp_cfg = predictor.model.config
        cp_head_dim = getattr(cp_cfg, "head_dim", None) or cp_cfg.hidden_size // cp_cfg.num_attention_heads
        c2w_head_dim = getattr(c2w_cfg, "head_dim", None) or c2w_cfg.hidden_size // c2w_cfg.num_attention_heads
        size = lambda m: nbytes(m, element)  # noqa: E731
        return cls(
            thinker=Decoder.of(thinker.model.language_model, size(thinker.lm_head), element),
            talker=Decoder.of(talker.model, size(talker.codec_head), element),
            text_projection=size(talker.text_projection),
            predictor_layers=size(predictor.model.layers) + size(predictor.model.norm),
            predictor_head=size(predictor.lm_head[0]),
            predictor_kv_per_token=2 * cp_cfg.num_hidden_layers * cp_cfg.num_key_value_heads * cp_head_dim,
            num_groups=talker.config.num_code_groups,
            code2wav=size(c2w) - size(c2w.code_embedding),
            code2wav_kv_per_token=2 * c2w_cfg.num_hidden_layers * c2w_cfg.num_key_value_heads * c2w_head_dim,
            code2wav_window=c2w_cfg.sliding_window,
            audio_encoder=size(thinker.model.audio_tower),
            element=element,
        )

    # ---- one steady tick: B sessions each get one codec frame --------------------------------

    def tick(self, batch: int, context: int) -> dict[str, float]:
        """Bytes per stage of one tick for `batch` sessions, each with `context` tokens of KV."""
        e = self.element
        steps = self.num_groups - 1
        return {
            "thinker_decode": self.thinker.weights(batch) + e * batch * context * self.thinker.kv_per_token,
            "talker_step": self.talker.weights(batch)
            + self.text_projection
            + e * batch * context * self.talker.kv_per_token,
            # 15 sequential steps, each reading the body and its own head; KV <= 17 positions.
            "code_predictor": steps * (self.predictor_layers + self.predictor_head)
            + e * batch * steps * (self.num_groups + 1) * self.predictor_kv_per_token,
            "code2wav": self.code2wav + e * batch * self.code2wav_window * self.code2wav_kv_per_token,
        }

    def end_of_turn(self, thinker_tokens: int, talker_tokens: int, context: int) -> dict[str, float]:
        """Bytes from end of speech to the first frame for one session: the audio encoder's
        open block, the thinker prefill of `thinker_tokens` over `context` tokens of history,
        the talker prefix of `talker_tokens`, the first code-predictor loop and code2wav step."""
        e = self.element
        steady = self.tick(1, context)
        return {
            "audio_tail": self.audio_encoder,
            "thinker_prefill": self.thinker.weights(thinker_tokens)
            + e * (context + thinker_tokens) * self.thinker.kv_per_token,
            "talker_prefill": self.talker.weights(talker_tokens)
            + self.text_projection
            + e * (context + talker_tokens) * self.talker.kv_per_token,
            "code_predictor": steady["code_predictor"],
            "code2wav": steady["code2wav"],
        }
