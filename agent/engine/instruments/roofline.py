"""Bytes an engine tick reads at real size, and the time model that turns bytes and kernels
into a *predicted* GPU time (a model, not a measurement; docs/engine-roofline.md).

    time = bytes / (efficiency x bandwidth) + kernels x per_kernel

Bytes come from the parameter shapes of a meta-device model (nothing allocated) in the
engine's dtype: every weight a stage touches, read once per call (a batched call reads a
weight once for all its rows), the MoE experts at their expected spread, and the KV cache at a
stated context length. Activations, logits and conv states are left out (small next to these
at decode; the model says so rather than guessing them).

MoE spread: a token picks k of E experts; with routing taken as uniform, B tokens touch
E x (1 - (1 - k/E)^B) distinct experts on average, so batch 1 reads k experts per layer and a
long prefill nearly all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

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


@dataclass(frozen=True)
class Decoder:
    """One MoE/dense decoder stack's byte-relevant sizes (elements, not bytes)."""

    layers: int
    dense_per_layer: float  # attention, norms, router, shared expert: read every call
    expert: float  # one routed expert's weights (0 for a dense stack)
    experts: int
    top_k: int
    kv_per_token: int  # K and V elements per token, all layers
    head: int  # final norm and output head, read once per call
    embed_row: int  # one input embedding row

    @classmethod
    def of(cls, body: nn.Module, head: int) -> "Decoder":
        layers = list(body.layers)
        dense, expert, experts, top_k = 0.0, 0.0, 0, 0
        for layer in layers:
            mlp = getattr(layer, "mlp", None)
            routed = getattr(mlp, "experts", None)
            if routed is not None and hasattr(routed, "gate_up_proj"):
                experts = routed.gate_up_proj.shape[0]
                expert += (routed.gate_up_proj.numel() + routed.down_proj.numel()) / experts
                top_k = int(getattr(mlp.gate, "top_k", 0) or body.config.num_experts_per_tok)
                dense += numel(layer) - numel(routed)
            else:
                dense += numel(layer)
        n = max(len(layers), 1)
        config = body.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        norm = numel(getattr(body, "norm", None))
        return cls(
            layers=len(layers),
            dense_per_layer=dense / n,
            expert=expert / n,
            experts=experts,
            top_k=top_k,
            kv_per_token=2 * len(layers) * config.num_key_value_heads * head_dim,
            head=norm + head,
            embed_row=config.hidden_size,
        )

    def weights(self, tokens: int) -> float:
        """Weight elements one call over `tokens` tokens reads (experts at their spread)."""
        spread = expected_experts(tokens, self.top_k, self.experts) if self.experts else 0.0
        return self.layers * (self.dense_per_layer + spread * self.expert) + self.head + tokens * self.embed_row


@dataclass(frozen=True)
class ByteModel:
    """Bytes per stage at real size; `element` is the weights' and caches' element size."""

    thinker: Decoder
    talker: Decoder
    text_projection: int
    predictor_layers: int  # one code-predictor step's body (all its layers and norm)
    predictor_head: int  # one of its 15 heads
    predictor_kv_per_token: int
    num_groups: int
    code2wav: int  # every code2wav weight but the code table (rows only)
    code2wav_kv_per_token: int
    code2wav_window: int
    audio_encoder: int
    element: int = 2

    @classmethod
    def of(cls, model: nn.Module, element: int = 2) -> "ByteModel":
        """From a (meta-device) Qwen3OmniMoeForConditionalGeneration at full depth."""
        thinker, talker = model.thinker, model.talker
        predictor = talker.code_predictor
        c2w = model.code2wav
        c2w_cfg = c2w.config
        cp_cfg = predictor.model.config
        cp_head_dim = getattr(cp_cfg, "head_dim", None) or cp_cfg.hidden_size // cp_cfg.num_attention_heads
        c2w_head_dim = getattr(c2w_cfg, "head_dim", None) or c2w_cfg.hidden_size // c2w_cfg.num_attention_heads
        return cls(
            thinker=Decoder.of(thinker.model.language_model, numel(thinker.lm_head)),
            talker=Decoder.of(talker.model, numel(talker.codec_head)),
            text_projection=numel(talker.text_projection),
            predictor_layers=numel(predictor.model.layers) + numel(predictor.model.norm),
            predictor_head=numel(predictor.lm_head[0]),
            predictor_kv_per_token=2 * cp_cfg.num_hidden_layers * cp_cfg.num_key_value_heads * cp_head_dim,
            num_groups=talker.config.num_code_groups,
            code2wav=numel(c2w) - numel(c2w.code_embedding),
            code2wav_kv_per_token=2 * c2w_cfg.num_hidden_layers * c2w_cfg.num_key_value_heads * c2w_head_dim,
            code2wav_window=c2w_cfg.sliding_window,
            audio_encoder=numel(thinker.model.audio_tower),
            element=element,
        )

    # ---- one steady tick: B sessions each get one codec frame --------------------------------

    def tick(self, batch: int, context: int) -> dict[str, float]:
        """Bytes per stage of one tick for `batch` sessions, each with `context` tokens of KV."""
        e = self.element
        steps = self.num_groups - 1
        return {
            "thinker_decode": e * (self.thinker.weights(batch) + batch * context * self.thinker.kv_per_token),
            "talker_step": e
            * (self.talker.weights(batch) + self.text_projection + batch * context * self.talker.kv_per_token),
            # 15 sequential steps, each reading the body and its own head; KV <= 17 positions.
            "code_predictor": e
            * (
                steps * (self.predictor_layers + self.predictor_head)
                + batch * steps * (self.num_groups + 1) * self.predictor_kv_per_token
            ),
            "code2wav": e * (self.code2wav + batch * self.code2wav_window * self.code2wav_kv_per_token),
        }

    def end_of_turn(self, thinker_tokens: int, talker_tokens: int, context: int) -> dict[str, float]:
        """Bytes from end of speech to the first frame for one session: the audio encoder's
        open block, the thinker prefill of `thinker_tokens` over `context` tokens of history,
        the talker prefix of `talker_tokens`, the first code-predictor loop and code2wav step."""
        e = self.element
        steady = self.tick(1, context)
        return {
            "audio_tail": e * self.audio_encoder,
            "thinker_prefill": e
            * (self.thinker.weights(thinker_tokens) + (context + thinker_tokens) * self.thinker.kv_per_token),
            "talker_prefill": e
            * (
                self.talker.weights(talker_tokens)
                + self.text_projection
                + (context + talker_tokens) * self.talker.kv_per_token
            ),
            "code_predictor": steady["code_predictor"],
            "code2wav": steady["code2wav"],
        }
